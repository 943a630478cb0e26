"""MatMulNBits and GatherBlockQuantized of cpu_reference against NumPy and ONNX Runtime CPU.

docs/cases.md 13, 14; docs/ops.md 2, 5. Tolerances: fp32 rtol 1e-5 atol 1e-5 (ORT uses another GEMM order),
fp16 rtol 2e-3. The dequantized weight itself is checked exactly against (q - zp) * scale.
"""

import numpy as np
import pytest

from core.protocol import KernelContext, NodeInfo
from providers.cpu_reference.ops import matmul_nbits, rowwise_matmul
from providers.cpu_reference.provider import CpuReferenceProvider


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes [..., n] LSB-first into uint8 (element i at bit i*bits), independently."""
    per = 8 // bits
    n = codes.shape[-1]
    padded = np.zeros((*codes.shape[:-1], -(-n // per) * per), np.uint32)
    padded[..., :n] = codes
    groups = padded.reshape(*codes.shape[:-1], -1, per)
    return sum(groups[..., i] << (i * bits) for i in range(per)).astype(np.uint8)


def _quantized(rng, n, k, bits, bs, zp_kind, scale_dtype):
    nb = -(-k // bs)
    q = rng.integers(0, 1 << bits, (n, nb * bs)).astype(np.uint8)
    b = _pack(q, bits).reshape(n, nb, bs * bits // 8)
    scales = (rng.standard_normal((n, nb)) * 0.1).astype(scale_dtype)
    if zp_kind == "none":
        zp_arr, zp = None, np.full((n, nb), 1 << (bits - 1), np.float64)
    elif zp_kind == "uint8":
        zcodes = rng.integers(0, 1 << bits, (n, nb)).astype(np.uint8)
        zp_arr, zp = _pack(zcodes, bits), zcodes.astype(np.float64)
    else:
        zp_arr = (rng.standard_normal((n, nb)) * 3 + (1 << (bits - 1))).astype(scale_dtype)
        zp = zp_arr.astype(np.float64)
    blocks = np.arange(k) // bs
    w = (q[:, :k] - zp[:, blocks]) * scales.astype(np.float64)[:, blocks]  # [N, K]
    return b, scales, zp_arr, w


CONFIGS = [(bits, bs, k) for bits in (4, 8) for bs, k in
           [(16, 48), (32, 64), (32, 80), (64, 192), (128, 256), (128, 200), (256, 512), (512, 1024), (512, 700)]]


@pytest.mark.parametrize("zp_kind", ["none", "uint8", "float"])
@pytest.mark.parametrize("bits,bs,k", CONFIGS)
def test_matmul_nbits_dequant_equals_q_minus_zp_times_scale(rng, bits, bs, k, zp_kind):
    n = 12
    b, scales, zp_arr, w = _quantized(rng, n, k, bits, bs, zp_kind, np.float32)
    got = matmul_nbits.dequantize(b, scales, zp_arr, k, n, bits, bs)
    np.testing.assert_allclose(got.T, w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits,bs,k,zp_kind", [c + (z,) for c in CONFIGS for z in ("none", "uint8", "float")
                                                if not (c[0] == 8 and z == "float")])
def test_matmul_nbits_matches_ort(one_node, rng, bits, bs, k, zp_kind):
    """ORT CPU refuses 8-bit weights with float zero points; that case is checked against NumPy only."""
    n, m = 10, 3
    b, scales, zp_arr, _ = _quantized(rng, n, k, bits, bs, zp_kind, np.float32)
    a = rng.standard_normal((2, m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    inputs = {"a": a, "b": b, "s": scales, "z": zp_arr, "g": None, "bias": bias}
    (want,), (got,) = one_node.both("MatMulNBits", inputs, {"y": np.float32}, domain="com.microsoft",
                                    K=k, N=n, bits=bits, block_size=bs)
    assert got.shape == (2, m, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("zp_kind", ["none", "uint8", "float"])
def test_matmul_nbits_fp16_scales_and_activations_match_ort(one_node, rng, zp_kind):
    k, n, bs = 96, 16, 32
    b, scales, zp_arr, _ = _quantized(rng, n, k, 4, bs, zp_kind, np.float16)
    a = rng.standard_normal((4, k)).astype(np.float16)
    inputs = {"a": a, "b": b, "s": scales, "z": zp_arr}
    (want,), (got,) = one_node.both("MatMulNBits", inputs, {"y": np.float16}, domain="com.microsoft",
                                    K=k, N=n, bits=4, block_size=bs)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-2)


def test_matmul_nbits_rows_bitwise_equal_at_m1_and_m_many(one_node, rng):
    k, n, bs = 200, 48, 32
    b, scales, zp_arr, _ = _quantized(rng, n, k, 4, bs, "none", np.float32)
    a = rng.standard_normal((9, k)).astype(np.float32)
    a[5] = a[2]
    m = one_node.model("MatMulNBits", {"a": a, "b": b, "s": scales}, {"y": np.float32},
                       domain="com.microsoft", K=k, N=n, bits=4, block_size=bs)
    (full,) = one_node.ref(m, {"a": a, "b": b, "s": scales})
    np.testing.assert_array_equal(full[5], full[2])
    for i in (0, 2, 8):
        (alone,) = one_node.ref(m, {"a": a[i:i + 1], "b": b, "s": scales})
        np.testing.assert_array_equal(alone[0], full[i])


def _ctx(op_type, attrs, inputs=("a", "b", "s")):
    node = NodeInfo(name="n", op_type=op_type, domain="com.microsoft", attrs=attrs, inputs=inputs,
                    outputs=("y",))
    return KernelContext(node, CpuReferenceProvider(), "head_major")


@pytest.mark.parametrize("attrs", [{"bits": 3, "block_size": 32}, {"bits": 4, "block_size": 24},
                                   {"bits": 4, "block_size": 8}, {"bits": 4, "block_size": 32, "weight_prepacked": 1}])
def test_matmul_nbits_unsupported_config_is_refused_and_raises(rng, attrs):
    k, n = 64, 8
    attrs = {"K": k, "N": n} | attrs
    ctx = _ctx("MatMulNBits", attrs)
    assert not matmul_nbits.supports(ctx.node)
    b = rng.integers(0, 255, (n, 2, 16)).astype(np.uint8)
    with pytest.raises(ValueError):
        matmul_nbits.run(ctx, np.ones((1, k), np.float32), b, np.ones((n, 2), np.float32))


def test_matmul_nbits_wrong_b_shape_raises(rng):
    ctx = _ctx("MatMulNBits", {"K": 64, "N": 8, "bits": 4, "block_size": 32})
    with pytest.raises(ValueError):
        matmul_nbits.run(ctx, np.ones((1, 64), np.float32), np.zeros((8, 1, 16), np.uint8),
                         np.ones((8, 2), np.float32))


def test_matmul_nbits_g_idx_refused():
    node = NodeInfo(name="n", op_type="MatMulNBits", domain="com.microsoft",
                    attrs={"K": 64, "N": 8, "block_size": 32}, inputs=("a", "b", "s", "", "g"), outputs=("y",))
    assert not matmul_nbits.supports(node)


@pytest.mark.parametrize("with_zp", [False, True])
@pytest.mark.parametrize("bits,bs,dtype", [(4, 16, np.float32), (4, 32, np.float16), (8, 32, np.float32)])
def test_gather_block_quantized_nibble_order_and_default_zp(one_node, rng, bits, bs, dtype, with_zp):
    v, d = 11, 64
    nb = d // bs
    q = rng.integers(0, 1 << bits, (v, d)).astype(np.uint8)
    data = _pack(q, bits)
    scales = (rng.standard_normal((v, nb)) * 0.1).astype(dtype)
    zcodes = rng.integers(0, 1 << bits, (v, nb)).astype(np.uint8)
    zp = zcodes if with_zp else np.full((v, nb), 1 << (bits - 1))
    idx = np.array([[0, 10, 3], [3, 7, 1]], np.int64)
    blocks = np.arange(d) // bs
    expected = ((q[idx].astype(np.float64) - zp[idx][..., blocks]) * scales[idx][..., blocks].astype(np.float64))
    inputs = {"data": data, "idx": idx, "scales": scales, "zp": _pack(zcodes, bits) if with_zp else None}
    (want,), (got,) = one_node.both("GatherBlockQuantized", inputs, {"y": dtype}, domain="com.microsoft",
                                    bits=bits, block_size=bs, gather_axis=0, quantize_axis=1)
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == np.float16 else dict(rtol=1e-6, atol=1e-7)
    assert got.dtype == dtype and got.shape == (2, 3, d)
    np.testing.assert_allclose(got.astype(np.float64), expected, **tol)
    np.testing.assert_array_equal(got, want)


def _old_matmul_nbits(a, w, bias):
    """The kernel's formula before it wrote into ctx.output (a fresh array): the bits to keep."""
    y = rowwise_matmul(a.astype(np.float32), w)
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float32)
    return y.astype(a.dtype)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_matmul_nbits_writes_into_its_output_buffer_with_the_same_bits(rng, dtype, with_bias):
    k, n, bs = 80, 24, 32
    b, scales, zp_arr, _ = _quantized(rng, n, k, 4, bs, "uint8", dtype)
    bias = rng.standard_normal(n).astype(dtype) if with_bias else None
    ctx = _ctx("MatMulNBits", {"K": k, "N": n, "bits": 4, "block_size": bs},
               ("a", "b", "s", "z", "", "bias" if with_bias else ""))
    a = rng.standard_normal((2, 3, k)).astype(dtype)
    (y,) = matmul_nbits.run(ctx, a, b, scales, zp_arr, None, bias)
    assert y is ctx.output(0, (2, 3, n), dtype)  # the node's persistent buffer, not a fresh array
    w = matmul_nbits.dequantize(b, scales, zp_arr, k, n, 4, bs)
    want = _old_matmul_nbits(a, w, bias)
    assert y.dtype == want.dtype and y.tobytes() == want.tobytes()
    y.fill(np.nan)  # poison: a second call writes every element again, into the same buffer
    (again,) = matmul_nbits.run(ctx, a, b, scales, zp_arr, None, bias)
    assert again is y and again.tobytes() == want.tobytes() and ctx.allocations == 1
    strided = rng.standard_normal((2, 6, k)).astype(dtype)[:, ::2]  # a non-contiguous A, same shape
    (y,) = matmul_nbits.run(ctx, strided, b, scales, zp_arr, None, bias)
    assert y is again and y.tobytes() == _old_matmul_nbits(strided, w, bias).tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gated_nbits_projections_write_into_scratch_slots_of_the_fused_node(rng, dtype):
    """SiluGatedMatMulNBits runs MatMulNBits on projection contexts whose outputs are scratch
    slots ("gate", 0) and ("up", 0) of the fused node's context: the fused result is the bits of
    the unfused chain, and a second step allocates nothing."""
    from providers.cpu_reference.ops import silu_gated_matmul_nbits, silu_mul

    k, n, bs = 64, 40, 32
    attrs = {"K": k, "N": n, "bits": 4, "block_size": bs}
    gate, up = (_quantized(rng, n, k, 4, bs, "uint8", dtype)[:3] for _ in range(2))
    node = NodeInfo(name="g", op_type="SiluGatedMatMulNBits", domain="lockstep", attrs=attrs,
                    inputs=("x", "bg", "sg", "zg", "bu", "su", "zu"), outputs=("y",))
    ctx = KernelContext(node, CpuReferenceProvider(), "head_major")
    x = rng.standard_normal((3, k)).astype(dtype)
    (y,) = silu_gated_matmul_nbits.run(ctx, x, *gate, *up)
    assert y is ctx.output(0, (3, n), dtype)
    scratch = [ctx.output((name, 0), (3, n), dtype) for name in ("gate", "up")]
    assert ctx.allocations == 3  # output 0 and the two scratch slots, all made by the run
    ws = [matmul_nbits.dequantize(*p, k, n, 4, bs) for p in (gate, up)]
    plain = KernelContext(node, CpuReferenceProvider(), "head_major")
    (want,) = silu_mul.run(plain, *(_old_matmul_nbits(x, w, None) for w in ws))
    assert y.tobytes() == want.tobytes()
    for buf in (y, *scratch):
        buf.fill(np.nan)  # poison: the next step writes every element of all three again
    (again,) = silu_gated_matmul_nbits.run(ctx, x, *gate, *up)
    assert again is y and again.tobytes() == want.tobytes() and ctx.allocations == 3

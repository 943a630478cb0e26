"""cuda op kernels against cpu_reference on fresh random inputs with poisoned outputs, plus
batch invariance (row i bitwise equal for every M) and the argmax tie / non-finite policy."""

import importlib

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from core.protocol import KernelContext, NodeInfo  # noqa: E402
from providers.cpu_reference.argmax import argmax_rows  # noqa: E402
from providers.cpu_reference.provider import CpuReferenceProvider  # noqa: E402

REF = CpuReferenceProvider()


def _node(op, domain="", attrs=None, inputs=("a", "b"), outputs=("y",), dtypes=()):
    return NodeInfo(name=op, op_type=op, domain=domain, attrs=attrs or {}, inputs=tuple(inputs),
                    outputs=tuple(outputs), input_dtypes=tuple(dtypes))


def _run(gpu, module, node, *inputs, poison=None, layout="head_major"):
    """Run cuda op ``module`` on device copies of ``inputs``; outputs poisoned beforehand."""
    mod = importlib.import_module(f"providers.cuda.ops.{module}")
    ctx = KernelContext(node, gpu, layout)
    dev = [None if x is None else (cupy.asarray(x) if isinstance(x, np.ndarray) and x.size > 64 or
                                   (isinstance(x, np.ndarray) and x.dtype.kind == "f") else x)
           for x in inputs]
    if poison is not None:
        for slot, (shape, dtype) in poison.items():
            buf = ctx.output(slot, shape, dtype)
            buf.view(np.uint8).fill(0x7F) if dtype != np.float16 else buf.fill(np.nan)
    outs = mod.run(ctx, *dev)
    return [None if o is None else (o.get() if isinstance(o, cupy.ndarray) else o) for o in outs], dev


def _ref(module, node, *inputs, layout="head_major"):
    mod = importlib.import_module(f"providers.cpu_reference.ops.{module}")
    return mod.run(KernelContext(node, REF, layout), *[None if x is None else np.copy(x) for x in inputs])


def _close(a, b, dtype):
    tol = 2e-2 if dtype == np.float16 else 2e-4
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all()
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert err < tol, err


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (5, 100, 37), (33, 1536, 576)])
def test_matmul_matches_reference(gpu, dtype, m, k, n):
    rng = np.random.default_rng(m * k)
    a = rng.standard_normal((m, k)).astype(dtype)
    w = (rng.standard_normal((k, n)) * 0.05).astype(dtype)
    node = _node("MatMul", dtypes=(dtype, dtype))
    (y,), _ = _run(gpu, "matmul", node, a, w, poison={0: ((m, n), dtype)})
    _close(y, _ref("matmul", node, a, w)[0], dtype)


def _nbits_case(rng, n, k, bits, bs, zp_kind, sdtype):
    nb = -(-k // bs)
    b = rng.integers(0, 256, (n, nb, bs * bits // 8), dtype=np.uint8)
    scales = (rng.random((n, nb)) * 0.02 + 0.001).astype(sdtype)
    zp = None
    if zp_kind == "uint8":
        zp = rng.integers(0, 256, (n, -(-nb * bits // 8)), dtype=np.uint8)
    attrs = {"K": k, "N": n, "bits": bits, "block_size": bs}
    inputs = ("a", "b", "s", "z") if zp is not None else ("a", "b", "s")
    return b, scales, zp, _node("MatMulNBits", "com.microsoft", attrs, inputs)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("bits,bs,k,zp_kind", [(4, 32, 576, None), (4, 16, 80, "uint8"), (8, 64, 200, None),
                                              (4, 128, 300, "uint8"), (8, 32, 96, "uint8")])
def test_matmul_nbits_matches_reference(gpu, dtype, bits, bs, k, zp_kind):
    rng = np.random.default_rng(bits * bs + k)
    m, n = 3, 72
    b, scales, zp, node = _nbits_case(rng, n, k, bits, bs, zp_kind, dtype)
    a = rng.standard_normal((1, m, k)).astype(dtype)
    (y,), _ = _run(gpu, "matmul_nbits", node, a, b, scales, zp, poison={0: ((1, m, n), dtype)})
    _close(y, _ref("matmul_nbits", node, a, b, scales, zp)[0], dtype)


@pytest.mark.parametrize("kind", ["dense16", "dense32", "int4"])
def test_linear_rows_are_batch_invariant(gpu, kind):
    rng = np.random.default_rng(7)
    k, n = 576, 200
    dtype = np.float32 if kind == "dense32" else np.float16
    a_all = rng.standard_normal((256, k)).astype(dtype)
    if kind == "int4":
        b, scales, zp, node = _nbits_case(rng, n, k, 4, 32, None, np.float16)
        args, module = (b, scales), "matmul_nbits"
    else:
        node = _node("MatMul", dtypes=(dtype, dtype))
        args, module = ((rng.standard_normal((k, n)) * 0.05).astype(dtype),), "matmul"
    single = np.stack([_run(gpu, module, node, a_all[i:i + 1], *args)[0][0][0] for i in range(8)])
    for m in (1, 2, 3, 8, 64, 256):
        y = _run(gpu, module, node, a_all[:m], *args)[0][0]
        rows = min(m, 8)
        assert np.array_equal(y[:rows].view(np.uint16 if dtype == np.float16 else np.uint32),
                              single[:rows].view(np.uint16 if dtype == np.float16 else np.uint32)), m


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_rms_norms_match_reference_and_are_row_invariant(gpu, dtype):
    rng = np.random.default_rng(3)
    d = 576
    x = rng.standard_normal((2, 5, d)).astype(dtype)
    skip = rng.standard_normal((2, 5, d)).astype(dtype)
    gamma = rng.standard_normal(d).astype(dtype)
    node = _node("SkipSimplifiedLayerNormalization", "com.microsoft", {"epsilon": 1e-5},
                 ("x", "s", "g"), ("y", "", "inv", "sum"))
    outs, _ = _run(gpu, "skip_simplified_layer_normalization", node, x, skip, gamma,
                   poison={0: (x.shape, dtype), 3: (x.shape, dtype)})
    ref = _ref("skip_simplified_layer_normalization", node, x, skip, gamma)
    for o, r in zip(outs, ref):
        if r is not None:
            _close(o, r, dtype)
    one, _ = _run(gpu, "skip_simplified_layer_normalization", node, x[1:2, 2:3], skip[1:2, 2:3], gamma)
    assert np.array_equal(one[0][0, 0], outs[0][1, 2])
    node = _node("SimplifiedLayerNormalization", "", {"epsilon": 1e-5}, ("x", "g"), ("y",))
    (y,), _ = _run(gpu, "simplified_layer_normalization", node, x, gamma, poison={0: (x.shape, dtype)})
    _close(y, _ref("simplified_layer_normalization", node, x, gamma)[0], dtype)


def _gqa(gpu, rng, dtype, bsz, s_len, total, seqlens, cap, layout, kv=None, qkv=None, poison=True):
    nq, nkv, h = 6, 2, 32
    attrs = {"num_heads": nq, "kv_num_heads": nkv, "do_rotary": 1, "scale": 0.0}
    node = _node("GroupQueryAttention", "com.microsoft", attrs,
                 ("qkv", "", "", "pk", "pv", "sl", "tot", "cos", "sin"), ("o", "pk", "pv"), (dtype,))
    if qkv is None:
        qkv = rng.standard_normal((bsz, s_len, (nq + 2 * nkv) * h)).astype(dtype)
    pos = np.arange(cap)[:, None] * (1.0 / 1000 ** (np.arange(h // 2) / (h // 2)))[None]
    cos, sin = np.cos(pos).astype(dtype), np.sin(pos).astype(dtype)
    shape = (bsz, nkv, cap, h) if layout == "head_major" else (bsz, cap, nkv, h)
    if kv is None:
        kv = [np.full(shape, np.nan, dtype), np.full(shape, np.nan, dtype)]
    sl = np.array(seqlens, np.int32)
    tot = np.array(total, np.int32)
    ref = _ref("group_query_attention", node, qkv, None, None, kv[0], kv[1], sl, tot, cos, sin, layout=layout)
    mod = importlib.import_module("providers.cuda.ops.group_query_attention")
    ctx = KernelContext(node, gpu, layout)
    if poison:
        ctx.output(0, (bsz, s_len, nq * h), dtype).fill(np.nan)
    dk, dv = cupy.asarray(kv[0]), cupy.asarray(kv[1])
    outs = mod.run(ctx, cupy.asarray(qkv), None, None, dk, dv, cupy.asarray(sl), tot, cupy.asarray(cos),
                   cupy.asarray(sin))
    assert outs[1] is dk and outs[2] is dv
    return outs[0].get(), dk.get(), dv.get(), ref, qkv


@pytest.mark.parametrize("layout", ["head_major", "seq_major"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_gqa_prefill_then_decode_matches_reference(gpu, layout, dtype):
    rng = np.random.default_rng(11)
    lens = [3, 7, 1]
    out, k, v, ref, _ = _gqa(gpu, rng, dtype, 3, 7, 7, [x - 1 for x in lens], 16, layout)
    for b, n in enumerate(lens):
        _close(out[b, :n], ref[0][b, :n], dtype)
    # decode: rows of the cache beyond each length hold NaN (poison) and must not matter
    kref, vref = np.array(ref[1]), np.array(ref[2])
    for b, n in enumerate(lens):
        sl = (slice(b, b + 1), slice(None), slice(n, None)) if layout == "head_major" else (slice(b, b + 1), slice(n, None))
        kref[sl] = np.nan
        vref[sl] = np.nan
    out2, _, _, ref2, _ = _gqa(gpu, rng, dtype, 3, 1, 16, lens, 16, layout, kv=[kref, vref])
    _close(out2, ref2[0], dtype)


def test_gqa_rows_are_batch_invariant(gpu):
    rng = np.random.default_rng(5)
    lens = [4, 9, 2]
    out, k, v, _, qkv = _gqa(gpu, rng, np.float16, 3, 9, 9, [x - 1 for x in lens], 32, "head_major")
    for b, n in enumerate(lens):
        one, k1, _, _, _ = _gqa(gpu, rng, np.float16, 1, n, n, [n - 1], 32, "head_major", qkv=qkv[b:b + 1, :n])
        assert np.array_equal(one[0].view(np.uint16), out[b, :n].view(np.uint16))
        assert np.array_equal(k1[0, :, :n].view(np.uint16), k[b, :, :n].view(np.uint16))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_device_argmax_ties_and_non_finite(gpu, dtype):
    rng = np.random.default_rng(1)
    v = 49152
    rows = rng.standard_normal((8, v)).astype(dtype)
    rows[0, [0, v - 1]] = 10
    rows[1, [5, 5 + 256]] = 10
    rows[2, :] = 1
    rows[3, 4097] = 10
    rows[3, 4096 * 3] = 10
    rows[4, :] = np.nan
    rows[5, 0] = np.nan
    rows[6, 77] = np.inf
    logits = cupy.asarray(np.stack([rows, rows[::-1]], 1))  # [B, 2, V]
    pos = cupy.asarray(np.array([0, 1, 0, 1, 0, 1, 0, 1], np.int32))
    result = cupy.full((8, 2), 0x7F7F7F7F, np.int32)
    gpu.device_argmax(logits, pos, result)
    picked = np.stack([logits.get()[b, pos.get()[b]] for b in range(8)])
    assert np.array_equal(result.get(), argmax_rows(picked))


def test_decode_advance(gpu):
    result = cupy.asarray(np.array([[5, 0], [-1, 1]], np.int32))
    ids = cupy.zeros((2, 1), np.int64) + 9
    mask = cupy.zeros((2, 6), np.int64)
    lengths = cupy.asarray(np.array([2, 4], np.int32))
    gpu.decode_advance(result, ids, mask, lengths)
    assert ids.get()[:, 0].tolist() == [5, 0]
    assert mask.get().tolist() == [[0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 0]]
    assert lengths.get().tolist() == [3, 5]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_gathers_match_reference(gpu, dtype):
    rng = np.random.default_rng(2)
    data = rng.standard_normal((100, 576)).astype(dtype)
    idx = rng.integers(0, 100, (3, 4)).astype(np.int64)
    node = _node("Gather", inputs=("d", "i"))
    (y,), _ = _run(gpu, "gather", node, data, cupy.asarray(idx), poison={0: ((3, 4, 576), dtype)})
    assert np.array_equal(y, data[idx])
    q = rng.integers(0, 256, (100, 288), dtype=np.uint8)
    sc = rng.random((100, 18)).astype(dtype)
    node = _node("GatherBlockQuantized", "com.microsoft", {"bits": 4, "block_size": 32}, ("d", "i", "s"))
    (y,), _ = _run(gpu, "gather_block_quantized", node, q, cupy.asarray(idx), sc, poison={0: ((3, 4, 576), dtype)})
    assert np.array_equal(y, _ref("gather_block_quantized", node, q, idx, sc)[0])


def test_capture_replays_a_step(gpu):
    rng = np.random.default_rng(4)
    a = cupy.asarray(rng.standard_normal((4, 576)).astype(np.float16))
    w = cupy.asarray((rng.standard_normal((576, 96)) * 0.05).astype(np.float16))
    node = _node("MatMul", dtypes=(np.float16, np.float16))
    mod = importlib.import_module("providers.cuda.ops.matmul")
    ctx = KernelContext(node, gpu, "head_major")
    eager = mod.run(ctx, a, w)[0].get()
    ctx.frozen = True
    gpu.begin_capture()
    y = mod.run(ctx, a, w)[0]
    graph = gpu.end_capture()
    y.fill(0)
    gpu.replay(graph)
    gpu.synchronize()
    assert np.array_equal(y.get(), eager)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_silu_mul_is_bitwise_the_unfused_sequence(gpu, dtype):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, 1, 1536)) * 4).astype(dtype)
    up = rng.standard_normal((3, 1, 1536)).astype(dtype)
    node = _node("SiluMul", domain="lockstep", inputs=("x", "up"), dtypes=(dtype, dtype))
    (y,), _ = _run(gpu, "silu_mul", node, x, up, poison={0: ((3, 1, 1536), dtype)})
    (ref,) = _ref("silu_mul", node, x, up)
    view = np.uint16 if dtype == np.float16 else np.uint32
    if dtype == np.float16:
        assert np.array_equal(y.view(view), np.asarray(ref).view(view))
    else:
        _close(y, ref, dtype)


def _unfused_gated(gpu, kind, x, gate_args, up_args, node_g):
    """The cuda provider's unfused MatMul(NBits), MatMul(NBits), SiluMul on the same inputs."""
    module = "matmul_nbits" if kind.startswith("int4") else "matmul"
    (g,), _ = _run(gpu, module, node_g, x, *gate_args)
    (u,), _ = _run(gpu, module, node_g, x, *up_args)
    node = _node("SiluMul", domain="lockstep", inputs=("x", "up"), dtypes=(x.dtype, x.dtype))
    return _run(gpu, "silu_mul", node, g, u)[0][0]


@pytest.mark.parametrize("kind", ["dense16", "dense32", "int4", "int4_zp"])
def test_gated_matmul_is_bitwise_the_unfused_chain_at_every_m(gpu, kind):
    """lockstep.SiluGatedMatMul(NBits) == MatMul, MatMul, SiluMul on this provider, bitwise, for
    M = 1 .. 256 (GLU epilogue on the tensor-core path; three kernels on the fp32 path); N = 52
    exercises the padded last group of 8 features; outputs poisoned."""
    rng = np.random.default_rng(23)
    k, n = 576, 52
    dtype = np.float32 if kind == "dense32" else np.float16
    x_all = (rng.standard_normal((256, k)) * 0.5).astype(dtype)
    if kind.startswith("int4"):
        zp_kind = "uint8" if kind == "int4_zp" else None
        bg, sg, zg, node_g = _nbits_case(rng, n, k, 4, 32, zp_kind, np.float16)
        bu, su, zu, _ = _nbits_case(rng, n, k, 4, 32, zp_kind, np.float16)
        gate_args, up_args = (bg, sg, zg), (bu, su, zu)
        fused_node = _node("SiluGatedMatMulNBits", "lockstep", node_g.attrs, ("x", "bg", "sg", "zg", "bu", "su", "zu"))
        module, fused_args = "silu_gated_matmul_nbits", (bg, sg, zg, bu, su, zu)
    else:
        wg, wu = [(rng.standard_normal((k, n)) * 0.05).astype(dtype) for _ in range(2)]
        node_g = _node("MatMul", dtypes=(dtype, dtype))
        gate_args, up_args = (wg,), (wu,)
        fused_node = _node("SiluGatedMatMul", "lockstep", {}, ("x", "wg", "wu"), dtypes=(dtype,) * 3)
        module, fused_args = "silu_gated_matmul", (wg, wu)
    view = np.uint16 if dtype == np.float16 else np.uint32
    for m in (1, 2, 3, 8, 64, 256):
        x = x_all[:m]
        (y,), _ = _run(gpu, module, fused_node, x, *fused_args, poison={0: ((m, n), dtype)})
        want = _unfused_gated(gpu, kind, x, gate_args, up_args, node_g)
        assert np.array_equal(y.view(view), want.view(view)), m

"""``gemv4`` (kernels/linear_gemv4.cu, ``Tuning.gemm_gemv``) on the GPU: int4 launches of 1-8 rows
are bitwise the default int4 kernel (``mma_nbits4``, split-K as the launcher picks it) with the
switch on, for every launch shape (warps, tiles per block, units in flight); each row of an 8-row
launch is bitwise its 1-row launch; and the products agree with a float64 product within fp16
rounding. Shapes cover K that ends inside a chunk (352), a single segment, long K (down
projections, 56 segments), rows that do not fill a tile, quantisation blocks of 32 to 128, zero
points absent and packed, fp16 and fp32 scales, bias, and the gate/up (GLU) epilogue.

    pytest -q tests/cuda/test_gemv4.py
"""

import numpy as np
import pytest
from _gpu import require_gpu
from attrs import evolve

cupy = require_gpu()

from providers.cuda.ops import NULL, _gemv4, _mma, _mma_layout  # noqa: E402
from providers.cuda.tuning import Tuning  # noqa: E402

OFF = Tuning(gemm_gemv=False)
ON = evolve(OFF, gemm_gemv=True)
#: (K, N, block_size, zero points, scale dtype)
CASES = [(64, 40, 32, False, np.float16), (352, 24, 32, True, np.float16), (2048, 48, 64, False, np.float32),
         (4096, 1000, 32, False, np.float16), (4608, 16, 128, True, np.float16), (14336, 72, 32, False, np.float16)]


def _weights(rng, rows: int, k: int, bs: int, zp: bool, s_dtype):
    """Raw MatMulNBits codes [rows, n_blocks, bs/2], scales and packed uint8 zero points (or None)."""
    nb = -(-k // bs)
    codes = rng.integers(0, 256, (rows, nb, bs // 2), dtype=np.uint8)
    scales = (rng.standard_normal((rows, nb)) * 0.05).astype(s_dtype)
    zps = rng.integers(0, 256, (rows, -(-nb // 2)), dtype=np.uint8) if zp else None
    return codes, scales, zps


def _packed(rows: int, k: int, bs: int, raw):
    codes, scales, zps = (None if x is None else cupy.asarray(x) for x in raw)
    return _mma_layout.pack_int4(cupy, codes, scales, zps, rows, k, bs)


def _run(a, w, m: int, glu_out: int, bias, tuning: Tuning | None = None, **shape):
    """y of one launch: through the launcher under ``tuning``, or ``gemv4`` of launch ``shape``."""
    y = cupy.full((m, glu_out or w.n), np.nan, np.float16)
    if tuning is None:
        _gemv4.launch(a, w, bias, y, m, NULL, glu_out, **shape)
    else:
        _mma.nbits4(a, w, bias, y, m, NULL, glu_out=glu_out, tuning=tuning)
    return y.get().view(np.uint16)


def _reference(a, raw, k: int, bs: int):
    """float64 a @ dequant(W)^T of raw MatMulNBits weights (zero point 8 when absent)."""
    codes, scales, zps = raw
    rows, nb = scales.shape
    q = np.stack((codes & 15, codes >> 4), -1).reshape(rows, -1)[:, :k].astype(np.float64)
    if zps is None:
        z = np.full((rows, nb), 8.0)
    else:
        z = np.stack((zps & 15, zps >> 4), -1).reshape(rows, -1)[:, :nb].astype(np.float64)
    deq = (q - np.repeat(z, bs, axis=1)[:, :k]) * np.repeat(scales.astype(np.float64), bs, axis=1)[:, :k]
    return a.astype(np.float64) @ deq.T


@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"K{c[0]}-N{c[1]}-bs{c[2]}-zp{int(c[3])}")
def test_gemv4_is_bitwise_the_default_int4_kernel(case, glu, m):
    k, n, bs, zp, s_dtype = case
    rng = np.random.default_rng(k + n + m)
    if glu:
        gate, up = (_weights(rng, n, k, bs, zp, s_dtype) for _ in range(2))
        from providers.cuda.ops.silu_gated_matmul_nbits import packed

        w = packed(cupy, n, k, bs, tuple(None if x is None else cupy.asarray(x) for x in (*gate, *up)))
        bias = None
    else:
        raw = _weights(rng, n, k, bs, zp, s_dtype)
        w = _packed(n, k, bs, raw)
        bias = cupy.asarray((rng.standard_normal(n) * 0.1).astype(np.float16)) if m % 2 else None
    a = cupy.asarray(rng.standard_normal((m, k)).astype(np.float16))
    glu_out = n if glu else 0
    default = _run(a, w, m, glu_out, bias, OFF)
    before = _gemv4.stats()["launches"]
    got = _run(a, w, m, glu_out, bias, ON)
    assert _gemv4.stats()["launches"] == before + 1  # the launcher took gemv4
    assert not np.isnan(default.view(np.float16)).any()
    assert np.array_equal(got, default)
    if not glu and bias is None:
        ref = _reference(a.get(), raw, k, bs)
        assert np.allclose(got.view(np.float16), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5]], ids=lambda c: f"K{c[0]}-N{c[1]}")
def test_every_launch_shape_is_bitwise_the_default(case):
    """Warps fewer than, equal to and more than the segments; tiles a block that do not divide the
    tiles; one and two units in flight: the same bits."""
    k, n, bs, zp, s_dtype = case
    rng = np.random.default_rng(7)
    w = _packed(n, k, bs, _weights(rng, n, k, bs, zp, s_dtype))
    a = cupy.asarray(rng.standard_normal((3, k)).astype(np.float16))
    default = _run(a, w, 3, 0, None, OFF)
    for warps in (1, 3, 8, 16):
        for tb in (1, 2, 3, 8):
            if _gemv4.shared_bytes(tb, k) > _gemv4.SHARED_MAX:
                continue
            for units in (1, 2):
                got = _run(a, w, 3, 0, None, warps=warps, tb=tb, units=units)
                assert np.array_equal(got, default), (warps, tb, units)


@pytest.mark.parametrize("glu", [False, True])
def test_each_row_of_eight_is_its_one_row_launch(glu):
    k, n, bs = 4096, 200, 32
    rng = np.random.default_rng(3)
    raw = _weights(rng, 2 * n if glu else n, k, bs, False, np.float16)
    w = _packed(2 * n if glu else n, k, bs, raw)
    a = cupy.asarray(rng.standard_normal((8, k)).astype(np.float16))
    glu_out = n if glu else 0
    batch = _run(a, w, 8, glu_out, None, ON)
    for r in range(8):
        assert np.array_equal(_run(a[r:r + 1], w, 1, glu_out, None, ON)[0], batch[r]), f"row {r}"


def test_a_captured_launch_replays_the_same_bits():
    """Captured in a CUDA graph (the decode step's form) and replayed twice: the eager bits."""
    k, n, bs = 4096, 1000, 32
    rng = np.random.default_rng(5)
    w = _packed(n, k, bs, _weights(rng, n, k, bs, False, np.float16))
    a = cupy.asarray(rng.standard_normal((1, k)).astype(np.float16))
    eager = _run(a, w, 1, 0, None, ON)
    y = cupy.full((1, n), np.nan, np.float16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        _mma.nbits4(a, w, None, y, 1, NULL, tuning=ON)
        stream.begin_capture()
        _mma.nbits4(a, w, None, y, 1, NULL, tuning=ON)
        graph = stream.end_capture()
        for _ in range(2):
            y.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            assert np.array_equal(y.get().view(np.uint16), eager)

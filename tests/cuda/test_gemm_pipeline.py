"""The pipelined weight-load schedule of the tensor-core GEMMs (kernels/linear_mma.cu PIPE,
``_mma.PIPELINE``) on the GPU: bitwise the plain schedule for dense, gate/up (GLU), RMSNorm
prologue and int4 kernels, at row counts of every token tiling (NJ = 1, 2, 4) and K that end
inside a segment, fill it, and take several segments per warp; the pipelined kernel actually ran;
and both agree with a float64 product within fp16 rounding."""

import numpy as np
import pytest
from _gpu import require_gpu

cupy = require_gpu()

from providers.cuda.ops import NULL, _mma  # noqa: E402

SHAPES = [(1, 64, 40), (3, 576, 72), (8, 2048, 48), (9, 2304, 32), (17, 4864, 16), (40, 8192, 24), (256, 1024, 80)]


@pytest.fixture
def ran(monkeypatch):
    """Expressions of the tensor-core kernels launched, in order."""
    seen = []
    launch = _mma._launch

    def recording(expr, *args):
        seen.append(expr)
        launch(expr, *args)

    monkeypatch.setattr(_mma, "_launch", recording)
    return seen


def _both(monkeypatch, ran, call):
    """``call()``'s result under the plain and the pipelined schedule, checking which ran."""
    out = []
    for pipe in (False, True):
        monkeypatch.setattr(_mma, "PIPELINE", pipe)
        del ran[:]
        out.append(call().get())
        assert ran and all(e.endswith(f", {_mma._BOOL[pipe]}>") for e in ran)
    return out


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_pipelined_dense_is_bitwise_the_plain_schedule(monkeypatch, ran, m, k, n, glu):
    rng = np.random.default_rng(k + n)
    a = rng.standard_normal((m, k)).astype(np.float16)
    w, up = (rng.standard_normal((k, n)).astype(np.float16) * np.float16(k ** -0.5) for _ in range(2))
    wp = cupy.asarray(_mma.pack(np, w, up if glu else None))
    da = cupy.asarray(a)

    def call():
        y = cupy.full((m, n), np.nan, np.float16)
        _mma.dense(da, wp, None, y, m, n, k, NULL, glu=glu)
        return y

    plain, piped = _both(monkeypatch, ran, call)
    assert np.array_equal(plain.view(np.uint16), piped.view(np.uint16))
    if not glu:
        ref = a.astype(np.float64) @ w.astype(np.float64)
        assert np.allclose(piped, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("k", [64, 576, 2048])
def test_pipelined_norm_prologue_is_bitwise_the_plain_schedule(monkeypatch, ran, k):
    rng = np.random.default_rng(k)
    n = 48
    x, skip = (cupy.asarray(rng.standard_normal((1, k)).astype(np.float16)) for _ in range(2))
    gamma = cupy.asarray(rng.standard_normal(k).astype(np.float16))
    wp = cupy.asarray(_mma.pack(np, rng.standard_normal((k, n)).astype(np.float16)))
    sums = []

    def call():
        y, s = cupy.full((1, n), np.nan, np.float16), cupy.full((1, k), np.nan, np.float16)
        _mma.dense(x, wp, None, y, 1, n, k, NULL, norm=_mma.Norm(skip, gamma, s, 1e-5))
        sums.append(s.get())
        return y

    plain, piped = _both(monkeypatch, ran, call)
    assert np.array_equal(plain.view(np.uint16), piped.view(np.uint16))
    assert np.array_equal(sums[0].view(np.uint16), sums[1].view(np.uint16))
    assert all(e.startswith("mma_dense<1, false, true, ") for e in ran)  # the RMSNorm prologue ran


@pytest.mark.parametrize("zp", [0, 1])
@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_pipelined_int4_is_bitwise_the_plain_schedule(monkeypatch, ran, m, k, n, scale_dtype, zp):
    rng = np.random.default_rng(k * 3 + n)
    bs = 32
    nb = k // bs
    codes = rng.integers(0, 256, (n, nb, bs // 2), dtype=np.uint8)
    scales = (rng.random((n, nb)) * 0.02).astype(scale_dtype)
    zps = rng.integers(0, 256, (n, -(-nb // 2)), dtype=np.uint8) if zp else None
    a = rng.standard_normal((m, k)).astype(np.float16)
    da, db, ds = cupy.asarray(a), cupy.asarray(codes), cupy.asarray(scales)
    dz = NULL if zps is None else cupy.asarray(zps)
    stride = 0 if zps is None else zps.shape[1]
    s_type = "__half" if scale_dtype == np.float16 else "float"

    def call():
        y = cupy.full((m, n), np.nan, np.float16)
        _mma.nbits4(da, db, ds, dz, zp, stride, None, y, m, n, k, bs, s_type, NULL)
        return y

    plain, piped = _both(monkeypatch, ran, call)
    assert np.array_equal(plain.view(np.uint16), piped.view(np.uint16))
    q = np.stack([codes & 15, codes >> 4], -1).reshape(n, nb, bs).astype(np.float64)
    if zps is None:
        z = np.full((n, nb, 1), 8.0)
    else:
        z = np.stack([zps & 15, zps >> 4], -1).reshape(n, -1)[:, :nb, None].astype(np.float64)
    w = ((q - z) * scales.astype(np.float64)[:, :, None]).reshape(n, k)
    ref = a.astype(np.float64) @ w.T
    assert np.allclose(piped, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())

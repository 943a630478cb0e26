"""The two RMSNorm kernels (kernels/rms_norm.cu): ``rms_norm_h8``, the one fp16 rows of a
multiple of 8 values take, gives bitwise what the general ``rms_norm`` gives, for every output
(y, the residual sum, inv_std_var), with and without skip and bias, a skip broadcast over rows,
rows of 1 to 3 pieces per thread and a piece count per row that leaves threads idle; and each
call ran the kernel it was meant to."""

import numpy as np
import pytest
from _gpu import require_gpu

require_gpu()

import cupy as cp  # noqa: E402

from providers.cuda.ops import _norm  # noqa: E402


def _run(x, skip, bias, gamma, vector: bool, monkeypatch):
    monkeypatch.setattr(_norm, "VECTOR", vector)
    rows, d = x.shape
    y, total = cp.empty_like(x), cp.empty_like(x) if skip is not None else None
    inv = cp.empty(rows, np.float32)
    before = _norm.stats()
    _norm.launch(x, skip, bias, gamma, y, total, None, inv, d, 1e-6)
    after = _norm.stats()
    ran = [k for k in before if after[k] > before[k]]
    outs = [a.get().view(np.uint16 if a.dtype == np.float16 else np.uint32) for a in (y, total, inv) if a is not None]
    return outs, ran


@pytest.mark.parametrize("d", [8, 576, 896, 2048, 2056, 4096, 6144, 8192])
@pytest.mark.parametrize("kind", ["plain", "skip", "skip_bias", "skip_broadcast"])
def test_vector_norm_is_bitwise_the_general_kernel(d, kind, monkeypatch):
    rng = np.random.default_rng(d)
    rows = 3

    def arr(*shape, scale=1.0):
        return cp.asarray((rng.standard_normal(shape) * scale).astype(np.float16))

    x, gamma = arr(rows, d, scale=4.0), arr(d)
    skip = None
    if kind == "skip_broadcast":
        skip = arr(d, scale=4.0)  # one row of skip for every row of x
    elif kind != "plain":
        skip = arr(rows, d, scale=4.0)
    bias = arr(d, scale=0.5) if kind == "skip_bias" else None
    fast, ran_fast = _run(x, skip, bias, gamma, True, monkeypatch)
    slow, ran_slow = _run(x, skip, bias, gamma, False, monkeypatch)
    assert ran_fast == ["rms_norm_h8"] and ran_slow == ["rms_norm"]
    for a, b in zip(fast, slow, strict=True):
        assert np.array_equal(a, b)


def test_rows_the_vector_kernel_cannot_take_run_the_general_one(monkeypatch):
    rng = np.random.default_rng(1)
    d = 100  # not a multiple of 8
    x = cp.asarray(rng.standard_normal((2, d)).astype(np.float16))
    gamma = cp.asarray(rng.standard_normal(d).astype(np.float16))
    _, ran = _run(x, None, None, gamma, True, monkeypatch)
    assert ran == ["rms_norm"]
    x32 = cp.asarray(rng.standard_normal((2, 64)).astype(np.float32))
    _, ran = _run(x32, None, None, cp.ones(64, np.float32), True, monkeypatch)
    assert ran == ["rms_norm"]
    # a view that starts 2 bytes into its allocation is not 16-byte aligned
    xv = cp.asarray(rng.standard_normal(2 * 64 + 1).astype(np.float16))[1:].reshape(2, 64)
    _, ran = _run(xv, None, None, cp.ones(64, np.float16), True, monkeypatch)
    assert ran == ["rms_norm"]

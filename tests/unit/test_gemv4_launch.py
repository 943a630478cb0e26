"""``gemv4`` (kernels/linear_gemv4.cu) checked on the host: its way of turning code nibbles into
q - z gives exactly the fp16 values ``mma_nbits4``'s gives (emulated in NumPy fp16 with the
kernel's constants), the launcher takes it only where the switch is on and for 1-8 rows, and
its launch shapes keep the partials within shared memory. The GPU tests
(tests/cuda/test_gemv4.py) check the kernel's bits against ``mma_nbits4``."""

from types import SimpleNamespace

import numpy as np
import pytest

from providers.cuda.ops import _gemv4
from providers.cuda.tuning import Tuning


def _half(bits):
    return np.asarray(bits, np.uint16).view(np.float16)


def _nozp():
    return _half(0x6408)  # 1024 + 8


def test_the_shift_free_nibbles_are_exactly_mma_nbits4s_q_minus_z():
    """Every (q, z): codes_minus_z of the word shifted by 4 (mma_nbits4) and gemv4_hi of the
    word ((1024 + 16 q) * 1/16 + (960 - (1024 + z)), one fused rounding) are the same fp16 bits."""
    q, z = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    word = (q << 4).astype(np.uint16) | 0x0302  # other nibbles set: the masks must drop them
    zq = _half(0x6400 + z)  # 1024 + z, as pack_int4 stores it
    old = _half(((word >> 4) & 0x000F) | 0x6400) - zq
    b = _half((word & 0x00F0) | 0x6400).astype(np.float64)
    zs = (_half(0x6380) - zq).astype(np.float64)  # 960 - (1024 + z), exact in fp16
    assert _half(0x6380) == 960 and _half(0x2C00) == 1 / 16 and _half(0xD480) == 960 - _nozp()
    new = (b * float(_half(0x2C00)) + zs).astype(np.float16)  # exact, so one rounding = none
    assert np.array_equal(new.view(np.uint16), old.view(np.uint16))
    assert np.array_equal(new.astype(np.int64), q - z)


def test_the_launcher_takes_gemv4_only_when_on_and_for_one_to_eight_rows():
    on, off = Tuning(gemm_gemv=True), Tuning()
    assert not off.gemm_gemv  # off by default until measured
    assert [m for m in range(0, 12) if _gemv4.applies(m, tuning=on)] == list(range(1, 9))
    assert not any(_gemv4.applies(m, tuning=off) for m in range(12))


@pytest.mark.parametrize("n,k,tb", [(4096, 4096, 1), (28672, 4096, 2), (4096, 14336, 1), (128256, 4096, 4),
                                    (40, 352, 1)])
def test_default_shapes_fill_the_device_and_fit_shared_memory(monkeypatch, n, k, tb):
    monkeypatch.setattr(_gemv4, "multiprocessors", lambda: 132)
    grid, block, shared, got = _gemv4.config(n, k)
    tiles = -(-n // 16)
    assert got == tb and grid == (-(-tiles // tb),)
    assert block == (32 * min(8, -(-k // 256)),) and shared == _gemv4.shared_bytes(tb, k) <= _gemv4.SHARED_DEFAULT


def test_launch_shapes_out_of_range_are_named():
    for kw in ({"warps": 0}, {"warps": 17}, {"tb": 0}, {"tb": 9}):
        with pytest.raises(ValueError, match="gemv4"):
            _gemv4.config(4096, 14336, **kw)
    w = SimpleNamespace(n=16, k=64)
    with pytest.raises(ValueError, match="9 rows"):
        _gemv4.launch(None, w, None, None, 9, 0)
    with pytest.raises(ValueError, match="3 units"):
        _gemv4.launch(None, w, None, None, 1, 0, units=3)


def test_a_grid_past_one_wave_takes_half_the_warps_where_that_fits_it(monkeypatch):
    """Two blocks of 8 warps or four of 4 a multiprocessor (the two-unit kernel's registers):
    the packed qkv's 384 blocks fit one wave only in blocks of 4 warps; the o projection's 256
    keep 8; a grid that fits no wave either way keeps 8."""
    monkeypatch.setattr(_gemv4, "multiprocessors", lambda: 132)

    def resident(threads):
        return 2 * 256 // threads

    assert _gemv4.config(6144, 4096, resident=resident)[1] == (128,)
    assert _gemv4.config(4096, 4096, resident=resident)[1] == (256,)
    assert _gemv4.config(14336, 4096, resident=resident)[1] == (256,)
    assert _gemv4.config(6144, 4096)[1] == (256,)  # no count known: the default

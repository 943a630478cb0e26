"""Host-side launch rules of the cuda GroupQueryAttention decode kernel (no GPU needed)."""

import numpy as np
import pytest

from providers.cuda.ops import group_query_attention as gqa


@pytest.mark.parametrize("sms", [1, 132, 144])
def test_decode_block_size_is_256_while_row_head_pairs_fit_the_multiprocessors(monkeypatch, sms):
    """256 threads up to one (row, kv head) pair per multiprocessor, 128 past it, whatever the
    multiprocessor count (the kernel is instantiated for exactly these two sizes)."""
    monkeypatch.setattr(gqa, "multiprocessors", lambda: sms)
    for nkv in (1, 2, 3, 8):
        for bsz in (1, 2, 7, 8, 31, 32, 33, 64, 256, 1024):
            expected = 256 if bsz * nkv <= sms else 128
            assert gqa.decode_threads(bsz, nkv) == expected, (bsz, nkv)
    assert {e for e in gqa._exprs("__half") if e.startswith("gqa_decode")} == {
        f"gqa_decode<__half, {n}, {hc}>" for n in (128, 256) for hc in (0, *gqa.STATIC_HEADS)}


def test_static_head_size_only_for_the_compiled_sizes(monkeypatch):
    """gqa_decode's HC argument is the head size where it is compiled for it (64, 128) and the
    switch is on; every other size, or the switch off, runs H at run time (HC = 0)."""
    monkeypatch.setattr(gqa, "STATIC_HEAD", True)
    assert [gqa.static_head(h) for h in (16, 32, 64, 80, 96, 128, 256)] == [0, 0, 64, 0, 0, 128, 0]
    monkeypatch.setattr(gqa, "STATIC_HEAD", False)
    assert [gqa.static_head(h) for h in (64, 128)] == [0, 0]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_decode_tile_rows_are_an_odd_number_of_16_byte_units(dtype):
    """The decode tiles' row stride holds a whole K/V row, is a whole number of 16-byte units
    (the score loop reads 16-byte units) and an odd one (a quarter warp reading one unit of
    eight rows hits eight different bank groups)."""
    item = np.dtype(dtype).itemsize
    for h in range(8, 264, 8):
        stride = gqa._decode_tile_stride(h, dtype)
        assert stride >= h
        assert (stride * item) % 16 == 0
        units = stride * item // 16
        assert units % 2 == 1
        assert {(r * units) % 8 for r in range(8)} == set(range(8))
        assert stride - h <= 32 // item  # at most two units of padding

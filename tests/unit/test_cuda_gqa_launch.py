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


def test_static_head_size_only_for_the_compiled_sizes():
    """gqa_decode's HC argument is the head size where it is compiled for it (64, 128) and the
    switch (tuning.attn_static_head) is on; every other size, or the switch off, runs H at run
    time (HC = 0)."""
    assert [gqa.static_head(h, True) for h in (16, 32, 64, 80, 96, 128, 256)] == [0, 0, 64, 0, 0, 128, 0]
    assert [gqa.static_head(h, False) for h in (64, 128)] == [0, 0]


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


@pytest.mark.parametrize("window,cap", [(24, 40), (64, 80), (100, 116), (4096, 4112), (24, 16), (200, 64)])
def test_ring_decode_grid_covers_every_window_in_chunk_order(window, cap):
    """A ring's decode block x takes the x-th CH-chunk of the row's window (keys p - m + 1 .. p,
    m = min(window, cap)); the grid must hold every chunk that window touches, at every position
    (the ring never wraps when cap < window: then p < cap)."""
    chunks = gqa.decode_chunks(cap, window, ring=True)
    limit = 3 * cap if cap >= window else cap
    for p in range(limit):
        lo = max(0, p - window + 1)
        assert p // gqa.CH - lo // gqa.CH + 1 <= chunks, p
    assert chunks <= -(-min(window, cap) // gqa.CH) + 1
    assert gqa.decode_chunks(cap, window, ring=False) == -(-cap // gqa.CH)


def test_ring_size_and_strides_of_the_staging_and_ring_caches():
    attrs = {"sliding_window_cache": 1, "local_window_size": 24}
    assert gqa.ring_rows(attrs, 40, first=False, s_len=1) == 40
    assert gqa.ring_rows(attrs, 40, first=True, s_len=50) == 40  # a prompt longer than the ring: staged
    assert gqa.ring_rows({"local_window_size": 24}, 64, first=False, s_len=1) == 0
    with pytest.raises(ValueError, match="subsequent prompt"):
        gqa.ring_rows(attrs, 40, first=False, s_len=3)
    assert gqa.strides(True, 2, 40, 16) == (2 * 40 * 16, 40 * 16, 16)
    assert gqa.strides(False, 2, 40, 16) == (40 * 2 * 16, 16, 2 * 16)
    assert "gqa_ring_store<float>" in gqa._exprs("float")


def test_cuda_runs_windowed_nodes_and_refuses_a_ring_without_a_window():
    from types import SimpleNamespace

    def node(**attrs):
        ins = ("qkv", "", "", "past_key_values.0.key", "past_key_values.0.value", "s", "t", "cos", "sin")
        return SimpleNamespace(attrs={"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1} | attrs, inputs=ins,
                               outputs=("o", "pk", "pv"), input_dtypes=(np.float16,) * len(ins), name="attn")

    assert gqa.supports(node(sliding_window_cache=1, local_window_size=24))
    assert "a ring needs a window > 0" in gqa.support_reason(node(sliding_window_cache=1, local_window_size=-1))


def test_ring_switch_off_refuses_windowed_nodes_with_what_to_do():
    from types import SimpleNamespace

    from providers.cuda.provider import CudaProvider  # importable without CuPy
    from providers.cuda.tuning import Tuning

    ins = ("qkv", "", "", "pk", "pv", "s", "t", "cos", "sin")
    node = SimpleNamespace(attrs={"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1, "sliding_window_cache": 1,
                                  "local_window_size": 24}, inputs=ins, outputs=("o", "pk", "pv"),
                           input_dtypes=(np.float16,) * len(ins), name="attn", domain=gqa.DOMAIN,
                           op_type=gqa.OP_TYPE)
    assert gqa.supports(node)
    assert not gqa.supports(node, ring=False) and "windowed_kv_cache=false" in gqa.support_reason(node, ring=False)
    # the provider answers under its tuning (no GPU here: its methods over a stand-in)
    for ring in (True, False):
        stand_in = SimpleNamespace(tuning=Tuning(attn_ring=ring))
        assert CudaProvider.supports(stand_in, node) is ring
        assert (CudaProvider.support_reason(stand_in, node) is None) is ring

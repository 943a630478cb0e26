"""Ring KV geometry of sliding-window layers (core.runtime.ring) at batch 3, both layouts."""

import numpy as np
import pytest
from onnx import helper

from core.counters import Counters
from core.models.model import ModelConfig
from core.runtime import kv, ring
from providers.cpu_reference.provider import CpuReferenceProvider


def geo(layout, cap):
    return kv.KVGeometry(layout, batch=3, kv_heads=2, capacity=cap, head_size=4, itemsize=4)


def _fill(g, lengths, code_rows=None, keep=None):
    """A buffer of ``g`` whose ring slot p mod C of (row b, head h) holds 1000c + 100h + p + 1
    (c = ``code_rows[b]``, default b) for the last ``min(length, keep or C)`` positions p of row
    b; 0 elsewhere."""
    buf = np.zeros(g.shape, np.float32)
    for b, n in enumerate(lengths):
        c = b if code_rows is None else code_rows[b]
        for p in ring.resident(n, keep or g.capacity):
            for h in range(g.kv_heads):
                idx = (b, h, p % g.capacity) if g.layout == "head_major" else (b, p % g.capacity, h)
                buf[idx] = 1000 * c + 100 * h + p + 1
    return buf


def _apply(copies, src, dst):
    sb, db = src.view(np.int8).reshape(-1), dst.view(np.int8).reshape(-1)
    for s_off, d_off, size in copies:
        db[d_off:d_off + size] = sb[s_off:s_off + size]


@pytest.mark.parametrize("layout", kv.LAYOUTS)
@pytest.mark.parametrize("src_cap,dst_cap", [(40, 40), (40, 24), (24, 40), (16, 40), (64, 40)])
def test_row_copies_move_the_resident_positions_to_their_slots(layout, src_cap, dst_cap):
    src_g, dst_g = geo(layout, src_cap), geo(layout, dst_cap)
    lengths = [min(src_cap, 5), 57, 0] if src_cap < 40 else [5, 57, 31]
    rows = [(0, 2, lengths[0]), (1, 0, lengths[1]), (2, 1, lengths[2])]
    src = _fill(src_g, lengths)
    dst = np.zeros(dst_g.shape, np.float32)
    _apply(ring.row_copies(src_g, dst_g, rows), src, dst)
    dst_lengths, sources = [0] * 3, [0] * 3
    for s, d, n in rows:
        dst_lengths[d], sources[d] = n, s
    want = _fill(dst_g, dst_lengths, sources, keep=min(src_cap, dst_cap))
    assert np.array_equal(dst, want)


def test_row_copies_of_unwrapped_rows_are_the_prefix_copies():
    src_g, dst_g = geo("head_major", 16), geo("head_major", 40)
    rows = [(0, 0, 3), (1, 2, 16), (2, 1, 0)]
    assert ring.row_copies(src_g, dst_g, rows) == kv.row_copies(src_g, dst_g, rows)


@pytest.mark.parametrize("window", [2, 8, 24])
def test_max_rewind_is_the_most_a_row_can_be_cut_back_exactly(window):
    """Write positions 0 .. L + k - 1 into a ring, cut back to L: the window of the next query
    (position L) is intact exactly when k <= max_rewind."""
    r, length = ring.ring_size(window), 100
    for k in range(1, r + 2):
        slots = np.full(r, -1)
        for p in range(length + k):
            slots[p % r] = p
        needed = range(max(0, length - window + 1), length)
        intact = all(slots[p % r] == p for p in needed)
        assert intact == (k <= ring.max_rewind(window)), k


def test_layer_geometry_is_the_full_one_or_a_ring_of_at_most_window_plus_slack():
    g = geo("seq_major", 256)
    assert ring.layer_geometry(g, 0) is g
    assert ring.layer_geometry(g, 24).capacity == 24 + ring.RING_SLACK
    assert ring.layer_geometry(geo("seq_major", 16), 24).capacity == 16


def _config(layers=3):
    return ModelConfig(num_layers=layers, num_heads=4, num_kv_heads=2, head_size=16, hidden_size=64, vocab_size=256,
                       context_length=256, eos_token_ids=(2,), pad_token_id=2)


def _gqa(layer, window, cache, past=None):
    node = helper.make_node("GroupQueryAttention", ["q", "", "", past or f"past_key_values.{layer}.key",
                                                    f"past_key_values.{layer}.value", "s", "t"],
                            ["o", f"present.{layer}.key", f"present.{layer}.value"], domain="com.microsoft",
                            name=f"attn{layer}", num_heads=4, kv_num_heads=2, local_window_size=window)
    if cache:
        node.attribute.append(helper.make_attribute("sliding_window_cache", 1))
    return node


def test_layer_windows_come_from_the_nodes_with_a_windowed_cache():
    graph = helper.make_graph([_gqa(0, 24, True), _gqa(1, -1, False), _gqa(2, 24, False)], "g", [], [])
    assert ring.layer_windows(graph, _config()) == (24, 0, 0)  # layer 2: a window mask, full cache
    bad = helper.make_graph([_gqa(0, 24, True, past="other")], "g", [], [])
    with pytest.raises(kv.KVLayoutError, match="other"):
        ring.layer_windows(bad, _config())


def test_kv_cache_rings_allocate_grow_and_commit_per_layer():
    """A growing cache with layer 0 a ring of window 24 (40 slots): layer 0 stays at most 40
    positions while layer 1 grows; growth keeps each layer's resident positions in their slots."""
    counters = Counters()
    cache = kv.KVCache(CpuReferenceProvider(), "head_major", 3, 2, 4, 2, np.float32, capacity=16,
                       max_capacity=128, policy="growing", counters=counters, windows=(24, 0))
    assert [g.capacity for g in cache.layer_geometries] == [16, 16]
    lengths = [16, 9, 0]
    for (k, _), g in zip(cache.layers, cache.layer_geometries):
        k[...] = _fill(g, lengths)
    assert cache.reserve_positions(20, lengths)
    assert [g.capacity for g in cache.layer_geometries] == [32, 32]
    assert cache.reserve_positions(60, lengths)
    assert [g.capacity for g in cache.layer_geometries] == [40, 64]
    for (k, v), g in zip(cache.layers, cache.layer_geometries):
        assert np.array_equal(k, _fill(g, lengths)) and not v.any()
    assert counters.kv_bytes == cache.nbytes == 2 * 3 * 2 * 4 * 4 * (40 + 64)
    assert cache.rewind_limit == ring.max_rewind(24)
    full = kv.KVCache(CpuReferenceProvider(), "head_major", 3, 2, 4, 2, np.float32, capacity=16,
                      max_capacity=128, policy="growing", counters=Counters())
    assert full.rewind_limit is None and full.windows == (0, 0)

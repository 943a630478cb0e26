"""KV geometry at batch 3, where a transposed axis or a wrong stride shows."""

import numpy as np
import pytest

from core.runtime import kv


def geo(layout, cap=8):
    return kv.KVGeometry(layout, batch=3, kv_heads=2, capacity=cap, head_size=4, itemsize=2)


@pytest.mark.parametrize("layout", kv.LAYOUTS)
def test_live_ranges_cover_exactly_the_live_elements(layout):
    g, lengths = geo(layout), [3, 0, 5]
    marks = np.zeros(g.shape, np.int8)
    for b, n in enumerate(lengths):
        if layout == "head_major":
            marks[b, :, :n] = 1
        else:
            marks[b, :n] = 1
    flat = np.zeros(g.nbytes, np.int8)
    for off, size in kv.live_ranges(g, lengths):
        flat[off: off + size] += 1
    expected = np.repeat(marks.reshape(-1), g.itemsize)
    assert np.array_equal(flat, expected)


def test_head_major_and_seq_major_ranges_differ():
    assert kv.live_ranges(geo("head_major"), [1, 1, 1]) != kv.live_ranges(geo("seq_major"), [1, 1, 1])


@pytest.mark.parametrize("layout", kv.LAYOUTS)
def test_commit_requests_are_page_aligned_and_cover_growth(layout):
    g, page = geo(layout, cap=64), 32
    old, new = [3, 0, 5], [9, 2, 5]
    reqs = kv.commit_requests(g, old, new, page)
    assert all(off % page == 0 and size % page == 0 for off, size in reqs)
    covered = set()
    for off, size in reqs:
        covered.update(range(off, off + size))
    before = {o for off, s in kv.live_ranges(g, old) for o in range(off, off + s)}
    for off, size in kv.live_ranges(g, new):
        for byte in range(off, off + size):
            assert byte in covered or (byte // page) in {x // page for x in before}
    assert kv.commit_requests(g, new, new, page) == []


def test_head_major_growth_moves_every_prefix_to_its_new_stride():
    g, lengths, new_cap = geo("head_major"), [3, 1, 8], 16
    src = np.arange(np.prod(g.shape), dtype=np.int16).reshape(g.shape)
    dst = np.zeros((3, 2, new_cap, 4), np.int16)
    sb, db = src.view(np.int8).reshape(-1), dst.view(np.int8).reshape(-1)
    for s_off, d_off, size in kv.growth_copies(g, new_cap, lengths):
        db[d_off: d_off + size] = sb[s_off: s_off + size]
    for b, n in enumerate(lengths):
        assert np.array_equal(dst[b, :, :n], src[b, :, :n])
        assert not dst[b, :, n:].any()


def test_seq_major_growth_refused_at_batch_above_one():
    with pytest.raises(kv.KVLayoutError, match="relocate"):
        kv.growth_copies(geo("seq_major"), 16, [1, 1, 1])
    single = kv.KVGeometry("seq_major", 1, 2, 8, 4, 2)
    assert kv.growth_copies(single, 16, [5]) == [(0, 0, 5 * 2 * 4 * 2)]


def test_lengths_beyond_capacity_are_refused():
    with pytest.raises(kv.KVLayoutError):
        kv.live_ranges(geo("head_major"), [9, 0, 0])


def test_round_capacity():
    assert kv.round_capacity(1, 8192) == 64
    assert kv.round_capacity(65, 8192) == 128
    assert kv.round_capacity(9000, 8192) == 8192

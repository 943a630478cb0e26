"""GroupQueryAttention with sliding_window_cache=1 on cpu_reference: Lockstep's ring KV cache
(docs/kv-geometry.md) against ONNX Runtime CPU's windowed cache, which keeps the same positions
in another layout (compacted to the front, ORT's WindowedCacheEnd). Both run the same history;
outputs and the new K/V rows must agree within the fp32 tolerance of test_cpu_ops_gqa.py. Then
the ring's own properties, bitwise: a prompt's outputs are its decode steps' outputs, and
seq_major equals head_major."""

import numpy as np
import pytest

NAMES = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
         "cos_cache", "sin_cache"]
TOL = dict(rtol=1e-5, atol=2e-5)
NQ, NKV, H, W, CAP = 4, 2, 16, 8, 12


def _ort_end(past: int, cap: int, window: int) -> int:
    """Rows ORT's windowed cache holds after ``past`` positions (group_query_attention.cc)."""
    gap = cap - window + 1
    if past <= cap:
        return past
    return past - gap * ((past - cap + gap - 1) // gap)


def _attrs(window=W):
    return dict(num_heads=NQ, kv_num_heads=NKV, local_window_size=window, do_rotary=1, rotary_interleaved=0,
                sliding_window_cache=1)


def _rotary(rng):
    theta = rng.uniform(0.01, 1.0, H // 2)
    t = np.arange(128)[:, None] * theta[None, :]
    return np.cos(t).astype(np.float32), np.sin(t).astype(np.float32)


def _run(one_node, runner, q, k, v, past, seqlens, total, cos, sin, layout="head_major"):
    feeds = dict(zip(NAMES, [q, k, v, past[0], past[1], np.asarray(seqlens, np.int32), np.array(total, np.int32),
                             cos, sin]))
    outs = {"out": np.float32, "present_key": np.float32, "present_value": np.float32}
    model = one_node.model("GroupQueryAttention", feeds, outs, "com.microsoft", **_attrs())
    return one_node.ort(model, feeds) if runner == "ort" else one_node.ref(model, feeds, kv_layout=layout)


def _pasts(history, pasts, cap):
    """(ring buffers, ORT buffers) [B, Nkv, cap, H] holding each row's history [B, Nkv, P, H]."""
    b = len(pasts)
    ring = [np.full((b, NKV, cap, H), np.nan, np.float32) for _ in range(2)]
    ort = [np.zeros((b, NKV, cap, H), np.float32) for _ in range(2)]
    for i, p in enumerate(pasts):
        end = _ort_end(p, cap, W)
        for hist, r, o in zip(history, ring, ort):
            kept = np.arange(max(0, p - cap), p)
            r[i][:, kept % cap] = hist[i][:, kept]
            o[i][:, :end] = hist[i][:, p - end:p]
    return ring, ort


def test_ring_decode_matches_ort_windowed_cache(one_node, rng):
    """Batch 3 at lengths before, at and past the ring's first wrap (ORT compacts at 13 and 18)."""
    pasts = [5, 12, 31]
    cos, sin = _rotary(rng)
    history = [rng.standard_normal((3, NKV, max(pasts), H)).astype(np.float32) for _ in range(2)]
    q = rng.standard_normal((3, 1, NQ * H)).astype(np.float32)
    k, v = (rng.standard_normal((3, 1, NKV * H)).astype(np.float32) for _ in range(2))
    ring, ort_past = _pasts(history, pasts, CAP)
    want = _run(one_node, "ort", q, k, v, ort_past, pasts, max(pasts) + 1, cos, sin)
    got = _run(one_node, "ref", q, k, v, ring, pasts, max(pasts) + 1, cos, sin)
    np.testing.assert_allclose(got[0], want[0], **TOL)
    assert got[1] is ring[0] and got[2] is ring[1]  # in place
    for b, p in enumerate(pasts):
        for g in (1, 2):  # the new row: ring slot p mod CAP, ORT's last resident row
            np.testing.assert_allclose(got[g][b, :, p % CAP], want[g][b, :, _ort_end(p + 1, CAP, W) - 1], **TOL)


def test_ring_prompt_longer_than_the_ring_matches_ort(one_node, rng):
    """A first prompt of 20 positions into 12 slots (window 8): its outputs and the resident
    positions both keep agree with ORT's (whose windowed cache refuses right padding)."""
    s = 20
    cos, sin = _rotary(rng)
    q = rng.standard_normal((1, s, NQ * H)).astype(np.float32)
    k, v = (rng.standard_normal((1, s, NKV * H)).astype(np.float32) for _ in range(2))
    ring = [np.full((1, NKV, CAP, H), np.nan, np.float32) for _ in range(2)]
    want = _run(one_node, "ort", q, k, v, [np.zeros_like(ring[0]) for _ in range(2)], [s - 1], s, cos, sin)
    got = _run(one_node, "ref", q, k, v, ring, [s - 1], s, cos, sin)
    np.testing.assert_allclose(got[0], want[0], **TOL)
    end = _ort_end(s, CAP, W)  # ORT keeps its last `end` positions, the ring its last CAP
    for g in (1, 2):
        for p in range(s - end, s):
            np.testing.assert_allclose(got[g][0, :, p % CAP], want[g][0, :, end - (s - p)], **TOL)


def test_ring_padded_prompt_row_is_bitwise_its_unpadded_call(one_node, rng):
    """Right padding (Lockstep's prefill): a row of 13 tokens padded to 20 gives the outputs and
    ring of its own 13-token call; the pad positions are not written over its live slots."""
    s, n = 20, 13
    cos, sin = _rotary(rng)
    q = rng.standard_normal((2, s, NQ * H)).astype(np.float32)
    k, v = (rng.standard_normal((2, s, NKV * H)).astype(np.float32) for _ in range(2))

    def ring(b):
        return [np.full((b, NKV, CAP, H), np.nan, np.float32) for _ in range(2)]

    batch = _run(one_node, "ref", q, k, v, ring(2), [s - 1, n - 1], s, cos, sin)
    alone = _run(one_node, "ref", q[1:, :n], k[1:, :n], v[1:, :n], ring(1), [n - 1], n, cos, sin)
    assert np.array_equal(batch[0][1, :n], alone[0][0])
    for g in (1, 2):
        assert np.array_equal(batch[g][1], alone[g][0], equal_nan=True)


def _ring_prompt_then_steps(one_node, rng, layout):
    """Outputs of a 20-token prompt run at once and run one decode step at a time (ring of 12)."""
    s = 20
    cos, sin = _rotary(rng)
    q = rng.standard_normal((1, s, NQ * H)).astype(np.float32)
    k, v = (rng.standard_normal((1, s, NKV * H)).astype(np.float32) for _ in range(2))

    def ring():
        shape = (1, NKV, CAP, H) if layout == "head_major" else (1, CAP, NKV, H)
        return [np.full(shape, np.nan, np.float32) for _ in range(2)]

    prompt = _run(one_node, "ref", q, k, v, ring(), [s - 1], s, cos, sin, layout)[0]
    buf, steps = ring(), []
    for t in range(s):
        out = _run(one_node, "ref", q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], buf, [t], 64, cos, sin, layout)
        steps.append(out[0])
    return prompt, np.concatenate(steps, axis=1)


@pytest.mark.parametrize("layout", ["head_major", "seq_major"])
def test_ring_prompt_outputs_are_bitwise_its_decode_steps(one_node, rng, layout):
    prompt, steps = _ring_prompt_then_steps(one_node, rng, layout)
    assert np.isfinite(steps).all()
    assert np.array_equal(prompt, steps)


def test_ring_seq_major_is_bitwise_head_major(one_node, request):
    seed = 7
    head = _ring_prompt_then_steps(one_node, np.random.default_rng(seed), "head_major")
    seq = _ring_prompt_then_steps(one_node, np.random.default_rng(seed), "seq_major")
    assert np.array_equal(head[1], seq[1])


def test_ring_smaller_than_the_window_is_refused_once_it_wraps(one_node, rng):
    cos, sin = _rotary(rng)
    q = rng.standard_normal((1, 1, NQ * H)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, NKV * H)).astype(np.float32) for _ in range(2))
    small = [np.zeros((1, NKV, W - 2, H), np.float32) for _ in range(2)]
    _run(one_node, "ref", q, k, v, small, [W - 3], 64, cos, sin)  # not wrapped yet: fine
    with pytest.raises(ValueError, match="smaller than the window"):
        _run(one_node, "ref", q, k, v, small, [W + 1], 64, cos, sin)

"""Split-KV attention and launch limits on the cuda provider, through core.Session (GPU only).

The decode attention splits each row's keys into chunks of 64 absolute positions (docs/cuda.md
"Attention"); the number of chunks depends on the row alone. These gates check what that design
promises: rows of very different lengths in one batch give their batch-1 bits, eager == captured
across a chunk boundary, a decode step gives the bits of a prefill over the same history, and
prefills far past the old 65,536-token launch limit run and match batch 1.
"""

import attrs
import numpy as np
import pytest
from _gpu import require_gpu

require_gpu()

from core.generation.loop import decode  # noqa: E402
from core.session import Session  # noqa: E402
from core.testing.tiny_model import TinyConfig, make_tiny_model  # noqa: E402


@pytest.fixture(scope="module", params=["float32", "float16"])
def long_model(request, tmp_path_factory):
    """Tiny builder-pattern model with a 4,096-position context."""
    folder = tmp_path_factory.mktemp(f"long-{request.param}")
    return make_tiny_model(folder, dtype=request.param, config=TinyConfig(context=4096))


def _prompts(lengths, seed=3):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, 250, n))) for n in lengths]


def test_rows_spanning_several_splits_are_batch_invariant(long_model, gpu):
    """Rows of 1, 300 and 2,049 tokens (1, 5 and 33 chunks) decoded together equal each row run
    alone, bitwise, tokens and logits; the singles use their own (smaller) KV capacity, so the
    split count cannot depend on the capacity either."""
    rows = _prompts([1, 300, 2049])
    together = decode(Session(long_model, gpu, batch=3), rows, 24, keep_logits=True)
    for b, row in enumerate(rows):
        alone = decode(Session(long_model, gpu, batch=1), [row], 24, keep_logits=True)
        assert np.array_equal(together.tokens[:, b], alone.tokens[:, 0]), f"row {b}"
        assert np.array_equal(together.logits[:, b], alone.logits[:, 0]), f"row {b}"


@pytest.mark.parametrize("batch", [1, 4])
def test_replay_equals_eager_across_a_split_boundary(long_model, gpu, batch):
    """Prompts of 58..61 tokens decoded for 12 steps cross position 64 (one chunk -> two):
    captured == eager bitwise, with one capture and the rest replays."""
    rows = _prompts([58 + b for b in range(batch)])
    eager = Session(long_model, gpu, batch=batch, capacity=128, capture=False)
    graph = Session(long_model, gpu, batch=batch, capacity=128, capture=True)
    e = decode(eager, rows, 12, keep_logits=True)
    g = decode(graph, rows, 12, keep_logits=True)
    assert np.array_equal(e.tokens, g.tokens) and np.array_equal(e.logits, g.logits)
    assert graph.counters.captures == 1 and graph.counters.replays == 11


def test_a_decode_step_equals_a_prefill_of_its_history(long_model, gpu):
    """Continuing a row gives the bits of prefilling its whole history: for a 100-token prompt
    decoded 40 steps (across 128), the logits of decode step k equal the logits of a fresh
    prefill of the prompt plus the first k generated tokens."""
    prompt = _prompts([100])[0]
    run = decode(Session(long_model, gpu, batch=1), [prompt], 40, keep_logits=True)
    for k in (1, 27, 28, 29, 40):
        history = prompt + [int(t) for t in run.tokens[:k, 0]]
        fresh = decode(Session(long_model, gpu, batch=1), [history], 0, keep_logits=True)
        assert np.array_equal(fresh.logits[0, 0], run.logits[k, 0]), f"step {k}"


def test_batch_256_by_1024_prefill_and_decode_match_batch_1(long_model, gpu):
    """262,144 prompt tokens in one prefill (4x the old 65,536-token launch limit of the
    embedding gather) and 4 decode steps; row 0 equals its batch-1 run bitwise."""
    rows = _prompts([1024] * 256, seed=11)
    big = decode(Session(long_model, gpu, batch=256, capacity=1088), rows, 4, keep_logits=True)
    one = decode(Session(long_model, gpu, batch=1, capacity=1088), rows[:1], 4, keep_logits=True)
    assert np.array_equal(big.tokens[:, 0], one.tokens[:, 0])
    assert np.array_equal(big.logits[:, 0], one.logits[:, 0])
    assert not big.errors.any()


def test_decode_block_sizes_give_the_same_bits(long_model, gpu, monkeypatch):
    """gqa_decode runs 256-thread blocks at small batches and 128-thread blocks at large ones
    (group_query_attention.decode_threads); each output element has the same arithmetic in
    both, so forcing either one gives the same tokens and logits, bitwise, across chunk
    boundaries (rows of 5, 70 and 300 tokens, 24 captured steps)."""
    from providers.cuda.ops import group_query_attention as gqa

    rows = _prompts([5, 70, 300])
    runs = {}
    for threads in (128, 256):
        monkeypatch.setattr(gqa, "decode_threads", lambda bsz, nkv, t=threads: t)
        before = gqa.stats()[f"decode_{threads}"]
        runs[threads] = decode(Session(long_model, gpu, batch=3), rows, 24, keep_logits=True)
        assert gqa.stats()[f"decode_{threads}"] > before  # that block size ran
    assert np.array_equal(runs[128].tokens, runs[256].tokens)
    assert np.array_equal(runs[128].logits, runs[256].logits)


@pytest.mark.parametrize("head_size", [64, 128])
def test_a_compile_time_head_size_gives_the_same_bits(head_size, gpu, monkeypatch, tmp_path):
    """gqa_decode is compiled for head sizes 64 and 128 (HC, group_query_attention.static_head):
    the index arithmetic becomes shifts, the floating-point operations stay the same. So the
    static and run-time kernels give the same tokens and logits, bitwise, for rows of 1 to 4
    chunks at batch 3 and 1, captured; and the static kernel did run."""
    from providers.cuda.ops import group_query_attention as gqa

    model = make_tiny_model(tmp_path, dtype="float16", config=TinyConfig(
        context=512, hidden=4 * head_size, heads=4, kv_heads=2, head_size=head_size))
    for rows in (_prompts([5, 70, 200]), _prompts([130])):
        runs = {}
        for static in (True, False):
            monkeypatch.setattr(gpu, "tuning", attrs.evolve(gpu.tuning, attn_static_head=static))
            before = gqa.stats()["decode_static_head"]
            runs[static] = decode(Session(model, gpu, batch=len(rows)), rows, 24, keep_logits=True)
            assert (gqa.stats()["decode_static_head"] > before) == static  # which kernel ran
        assert np.array_equal(runs[True].tokens, runs[False].tokens)
        assert np.array_equal(runs[True].logits, runs[False].logits)


def test_a_wrong_position_guess_gives_the_same_bits(long_model, gpu, monkeypatch):
    """gqa_decode loads the cos/sin rows and a chunk's first K/V tiles before the PDL wait at a
    guess of each row's position (kernels/group_query_attention.cu QkvRound) and reloads them
    after the wait when the guess was wrong. Guesses shifted by -1, +1 and far off (every block
    then reloads, or, for -1 across a chunk boundary, a live block guesses dead and a dead one
    live) give the tokens and logits of the right guess, bitwise, eager and captured, across
    chunk boundaries (rows of 5, 63, 64 and 300 tokens, 24 steps); so does the path left off, for
    more rows than HINT_ROWS or by the switch."""
    from providers.cuda.ops import group_query_attention as gqa

    rows = _prompts([5, 63, 64, 300])
    runs = {}
    monkeypatch.setattr(gpu, "tuning", attrs.evolve(gpu.tuning, attn_hint=True))  # whatever the environment says
    for shift in (0, -1, 1, -100000):
        monkeypatch.setattr(gqa, "HINT_SHIFT", shift)
        before = gqa.stats()["decode_hinted"]
        runs[shift] = decode(Session(long_model, gpu, batch=4, capture=shift == 0), rows, 24, keep_logits=True)
        assert gqa.stats()["decode_hinted"] > before  # the hinted prologue ran
    for off in ("rows", "switch"):  # more rows than HINT_ROWS, or LOCKSTEP_CUDA_ATTN_HINT=off
        if off == "rows":
            monkeypatch.setattr(gqa, "HINT_ROWS", 2)
        else:
            monkeypatch.setattr(gqa, "HINT_ROWS", 8)
            monkeypatch.setattr(gpu, "tuning", attrs.evolve(gpu.tuning, attn_hint=False))
        before = gqa.stats()["decode_hinted"]
        runs[off] = decode(Session(long_model, gpu, batch=4, capture=True), rows, 24, keep_logits=True)
        assert gqa.stats()["decode_hinted"] == before  # the loads after the wait
    for shift in (-1, 1, -100000, "rows", "switch"):
        assert np.array_equal(runs[0].tokens, runs[shift].tokens), shift
        assert np.array_equal(runs[0].logits, runs[shift].logits), shift
    # (G + 2) H <= 4 threads: SmolLM2's group of 3 (H 64) fits 128 threads; Qwen2.5-0.5B's of 7 only 256
    assert gqa.hinted(3, 64, 128) and not gqa.hinted(7, 64, 128) and gqa.hinted(7, 64, 256)
    assert not gqa.hinted(16, 128, 128) and gqa.hinted(6, 128, 256)

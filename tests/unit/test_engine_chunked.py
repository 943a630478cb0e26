"""Chunked prefill on cpu_reference: a prompt prefilled in chunks on the fixed grid of absolute
positions gives every request its solo run (with the same chunk size), bitwise the unchunked
prefill's tokens and logits, and the running rows keep decoding between the chunks (the cuda
twin is tests/cuda/test_engine_chunked_cuda.py)."""

from __future__ import annotations

import numpy as np
import pytest

from core.engine import Engine
from core.errors import RequestError
from core.runtime.runner import Runner
from core.testing.arrivals import fuzz_arrivals
from core.testing.engine_twins import assert_rows_agree, engine_rows, session_rows
from core.testing.tiny_model import make_tiny_model, write_byte_tokenizer

LONG = [int(t) for t in np.random.default_rng(3).integers(3, 250, 45)]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return Runner(write_byte_tokenizer(make_tiny_model(tmp_path_factory.mktemp("chunked"))), "cpu_reference")


def test_arrivals_with_long_prompts_in_small_chunks_equal_their_solo_runs(runner):
    report = fuzz_arrivals(runner, seed=49, requests=60, max_batch=4, capacity=64, prefill_chunk=8,
                           prompt_share=0.7, solo="engine", prefill_tokens=16)
    assert report.mismatches == []
    assert report.prefill_chunks > 60  # the chunked path ran: most prompts took several chunks
    assert report.max_running == 4 and report.aborted > 0 and report.sampled > 0


def test_chunked_prefill_is_bitwise_the_unchunked_one(runner):
    """Against a batch-1 Session's whole-prompt prefill: the same tokens (the fuzzer) ..."""
    report = fuzz_arrivals(runner, seed=50, requests=40, max_batch=4, capacity=64, prefill_chunk=5,
                           prompt_share=0.7, solo="session", prefill_tokens=10)
    assert report.mismatches == [] and report.prefill_chunks > 40


@pytest.mark.parametrize("sampled", [False, True])
def test_chunked_prefill_gives_the_fixed_batch_tokens_and_logits_bitwise(runner, sampled):
    """... and the same logits, every token's, as the fixed-batch Session (chunks of 1, 3 and 7)."""
    prompts = [LONG, LONG[:9], LONG[:20]]
    sampling = [{"do_sample": True, "temperature": 0.9, "top_k": 30, "seed": 7 + i} for i in range(3)] \
        if sampled else None
    s_tokens, s_logits = session_rows(runner, prompts, 6, 64, sampling)
    for chunk in (1, 3, 7):
        e_tokens, e_logits, _ = engine_rows(runner, prompts, 6, 64, sampling, max_batch=4, prefill_chunk=chunk)
        assert_rows_agree(runner, e_tokens, e_logits, s_tokens, s_logits, chunk)


def test_running_rows_decode_between_the_chunks_of_a_long_prompt(runner):
    engine = Engine(runner, max_batch=2, capacity=64, prefill_chunk=4, prefill_tokens=4)
    short = engine.submit([5, 6], max_tokens=16)
    engine.run_once()
    long = engine.submit(LONG, max_tokens=3)
    while long.events.empty():
        engine.run_once()
    made_meanwhile = short.events.qsize()  # the short row's tokens while the long prompt prefilled
    engine.run_until_idle()
    assert made_meanwhile >= 10  # 45 positions at one 4-position chunk an iteration: 12 iterations
    assert engine.counters.prefill_chunks == 12
    alone = Engine(runner, max_batch=1, capacity=64, prefill_chunk=None)
    want = [alone.submit(p, max_tokens=n) for p, n in (([5, 6], 16), (LONG, 3))]
    alone.run_until_idle()
    for got, ref in zip((short, long), want):
        assert [t for e in got for t in e.token_ids] == [t for e in ref for t in e.token_ids]


def test_a_prompt_filling_its_slot_in_chunks_beside_a_decoding_row(runner):
    """A prompt of capacity - 1 tokens (max_tokens 1): its lane, stepped as a padded lane
    between chunks, never reaches the capacity's reset, so nothing overwrites its KV."""
    cap = 32
    engine = Engine(runner, max_batch=2, capacity=cap, prefill_chunk=3, prefill_tokens=3)
    busy = engine.submit([9, 8, 7], max_tokens=cap - 3)
    engine.run_once()
    full = engine.submit(LONG[:cap - 1], max_tokens=1)
    engine.run_until_idle()
    alone = Engine(runner, max_batch=1, capacity=cap, prefill_chunk=None)
    want = [alone.submit([9, 8, 7], max_tokens=cap - 3), alone.submit(LONG[:cap - 1], max_tokens=1)]
    alone.run_until_idle()
    assert [[t for e in h for t in e.token_ids] for h in (busy, full)] == \
        [[t for e in h for t in e.token_ids] for h in want]


def test_aborting_a_request_mid_prefill_frees_its_slot(runner):
    engine = Engine(runner, max_batch=1, capacity=64, prefill_chunk=4, prefill_tokens=4)
    gone = engine.submit(LONG, max_tokens=4)
    engine.run_once()
    engine.abort(gone.request.id)
    nxt = engine.submit([1, 2, 3], max_tokens=4)
    engine.run_until_idle()
    assert [e.finish_reason for e in gone][-1] == "abort" and not engine.slots.filled
    alone = Engine(runner, max_batch=1, capacity=64)
    ref = alone.submit([1, 2, 3], max_tokens=4)
    alone.run_until_idle()
    assert [t for e in nxt for t in e.token_ids] == [t for e in ref for t in e.token_ids]


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True])
def test_a_bad_chunk_size_is_refused(runner, chunk):
    with pytest.raises(RequestError, match="prefill_chunk must be a positive integer"):
        Engine(runner, max_batch=1, capacity=64, prefill_chunk=chunk)


def test_serve_passes_prefill_chunk_and_the_decode_prefill_budget_to_the_engine(runner, monkeypatch):
    import core.serve.server as server_mod
    from core.cli import main

    made = []

    def engine(*args, **kwargs):
        made.append(kwargs)
        raise SystemExit(0)  # stop at the engine: nothing is served

    monkeypatch.setattr(server_mod, "Engine", engine)
    monkeypatch.setattr(server_mod, "serve", lambda server, *a: server.load())
    with pytest.raises(SystemExit):
        main(["serve", str(runner.model.folder), "--prefill-chunk", "8", "--decode-prefill-tokens", "8"])
    assert made[0]["prefill_chunk"] == 8 and made[0]["decode_prefill_tokens"] == 8


def test_a_request_aborted_before_its_first_chunk_leaves_the_others_right(runner):
    """A long prompt takes the iteration's budget; a request admitted beside it is aborted
    before any chunk of its own ran; the engine goes on and the rest equal their solo runs."""
    engine = Engine(runner, max_batch=3, capacity=64, prefill_chunk=4, prefill_tokens=8)
    long = engine.submit(LONG[:24], max_tokens=3)
    engine.run_once()  # admitted; its first two chunks
    gone = engine.submit([4, 5, 6, 7], max_tokens=3)
    engine.run_once()  # admitted, but the long prompt's chunks took the budget
    assert gone.request in engine._prefilling and engine._prefilling.pending[gone.request] == 0
    engine.abort(gone.request.id)
    later = engine.submit([8, 9], max_tokens=3)
    engine.run_until_idle()
    assert [e.finish_reason for e in gone] == ["abort"]
    alone = Engine(runner, max_batch=1, capacity=64, prefill_chunk=None)
    want = [alone.submit(LONG[:24], max_tokens=3), alone.submit([8, 9], max_tokens=3)]
    alone.run_until_idle()
    assert [[t for e in h for t in e.token_ids] for h in (long, later)] == \
        [[t for e in h for t in e.token_ids] for h in want]


def test_a_row_moved_into_a_slot_freed_mid_prefill_keeps_its_length(runner):
    """A long prompt in slot 0 is aborted part-way; compaction then moves the decoding row of
    slot 1 into slot 0, where nothing of the aborted prompt's progress may hold it back."""
    engine = Engine(runner, max_batch=2, capacity=64, prefill_chunk=4, prefill_tokens=6)
    gone = engine.submit(LONG[:24], max_tokens=3)
    engine.run_once()  # slot 0: its first chunk
    kept = engine.submit([5, 6], max_tokens=12)
    engine.run_once()  # slot 1: prefilled whole beside the long prompt's next chunk, decoding
    assert engine.scheduler.slot_of(kept.request) == 1 and engine.slots.filled.get(0) == 8
    engine.abort(gone.request.id)
    engine.run_until_idle()
    assert engine.counters.rows_moved >= 1  # it moved down into slot 0
    alone = Engine(runner, max_batch=1, capacity=64)
    want = alone.submit([5, 6], max_tokens=12)
    alone.run_until_idle()
    assert [t for e in kept for t in e.token_ids] == [t for e in want for t in e.token_ids]


def test_a_decode_prefill_budget_of_one_chunk_steps_the_decoding_rows_after_every_chunk(runner):
    """With ``decode_prefill_tokens`` one chunk, a long prompt arriving beside a decoding row
    prefills one chunk an iteration (the whole budget of 64 only while nothing decodes), the
    row taking a step after each; every request's tokens stay its solo run's."""
    def tokens(handles):
        return [[t for e in h for t in e.token_ids] for h in handles]

    made, got = {}, {}
    for budget in (None, 4):
        engine = Engine(runner, max_batch=3, capacity=64, prefill_chunk=4, prefill_tokens=64,
                        decode_prefill_tokens=budget)
        short = engine.submit([5, 6], max_tokens=16)
        engine.run_once()
        long = engine.submit(LONG, max_tokens=3)
        while long.events.empty():
            engine.run_once()
        made[budget] = short.events.qsize()  # the short row's tokens while the long prompt prefilled
        late = engine.submit(LONG[:30], max_tokens=5)  # arrives while both decode
        engine.run_until_idle()
        got[budget] = tokens((short, long, late))
        assert engine.counters.prefill_chunks == 12 + 8
    assert made[None] <= 3 and made[4] >= made[None] + 10  # 12 chunks in one iteration, or one an iteration
    alone = Engine(runner, max_batch=1, capacity=64, prefill_chunk=4)
    want = [alone.submit(p, max_tokens=n) for p, n in (([5, 6], 16), (LONG, 3), (LONG[:30], 5))]
    alone.run_until_idle()
    assert got[None] == got[4] == tokens(want)


@pytest.mark.parametrize("budget", [0, -3, 1.5])
def test_a_bad_decode_prefill_budget_is_refused(runner, budget):
    with pytest.raises(RequestError, match="decode_prefill_tokens must be a positive integer"):
        Engine(runner, max_batch=1, capacity=64, decode_prefill_tokens=budget)

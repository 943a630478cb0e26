"""Run-ahead (Session.step_async, Session.run_ahead) on the tiny model (cpu_reference): the loops
queue the next steps before reading the last one, give the same tokens as the synchronous loop,
and a step queued for a generation that then ends is discarded so that the session's later
steps, continuations and sampled draws are what they would have been without it."""

from __future__ import annotations

import numpy as np
import pytest

import core
from core.generation.loop import decode
from core.session import MAX_UNREAD, RequestError, Session
from core.testing.tiny_model import make_tiny_model, write_byte_tokenizer

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10]]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("ahead"))
    write_byte_tokenizer(folder)
    return core.Runner(folder, "cpu_reference")


def _session(runner, ahead: bool, batch: int = 4, **kw) -> Session:
    return Session(runner, batch=batch, capacity=kw.pop("capacity", 96), run_ahead=ahead, **kw)


def test_download_async_returns_the_tensor_as_it_was_when_queued(runner):
    p = runner.provider
    t = p.upload(np.arange(6, dtype=np.int32).reshape(3, 2))
    handle = p.download_async(t)
    p.write(t, np.full((3, 2), 7, np.int32))  # later work overwrites it
    assert np.array_equal(handle.wait(), np.arange(6).reshape(3, 2))
    assert np.array_equal(p.download(t), np.full((3, 2), 7))


def test_decode_runs_ahead_and_gives_the_tokens_of_the_synchronous_loop(runner):
    sync = _session(runner, False)
    want = decode(sync, PROMPTS, 12)
    ahead = _session(runner, True)
    got = decode(ahead, PROMPTS, 12)
    assert np.array_equal(got.tokens, want.tokens)
    assert ahead.counters.run_ahead_steps >= 10 and sync.counters.run_ahead_steps == 0  # the path ran
    assert ahead.counters.discarded_steps == 0  # the loop queues no step past ``steps``
    assert ahead.counters.decode_steps == sync.counters.decode_steps == 12
    assert np.array_equal(ahead.lengths, sync.lengths)
    assert len(got.seconds) == 13 and len(got.device_seconds) == 12
    assert all(d is not None and d >= 0 for d in got.device_seconds)  # the host timer of cpu_reference
    # later steps continue from the same state
    assert np.array_equal(ahead.step().tokens, sync.step().tokens)


def test_decode_with_an_observer_or_kept_logits_does_not_run_ahead(runner):
    s = _session(runner, True)
    decode(s, PROMPTS, 4, observer=lambda *_: None)
    assert s.counters.run_ahead_steps == 0
    t = decode(s, PROMPTS, 4, keep_logits=True)
    assert s.counters.run_ahead_steps == 0 and t.logits.shape[0] == 5


def _stop_token(runner) -> tuple[list[list[int]], list[list[int]]]:
    """Per row, the token it emits at its 4th step (a stop that ends every row early), and the
    greedy outputs of a synchronous run."""
    s = _session(runner, False)
    rows = s.stream(PROMPTS, max_new_tokens=12).run()
    return [[r.output_ids[3]] for r in rows], [r.output_ids for r in rows]


def test_a_generation_that_stops_early_discards_its_queued_steps(runner):
    stop, _ = _stop_token(runner)
    sync, ahead = _session(runner, False), _session(runner, True)
    want = sync.stream(PROMPTS, max_new_tokens=12, stop_token_ids=stop).run()
    got = ahead.stream(PROMPTS, max_new_tokens=12, stop_token_ids=stop).run()
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert ahead.counters.run_ahead_steps > 0 and ahead.counters.discarded_steps > 0
    assert ahead.counters.decode_steps == sync.counters.decode_steps  # discarded steps are not decode steps
    assert np.array_equal(ahead.lengths, sync.lengths)
    with pytest.raises(RequestError, match="run_ahead"):
        ahead.last_logits()  # the buffer holds a discarded step's logits
    # the next step feeds the last read tokens at the last read positions: the same bits
    a = ahead.step()
    a_logits = ahead.last_logits()  # the two sessions share the runner's logits buffer: read it now
    b = sync.step()
    assert np.array_equal(a.tokens, b.tokens)
    assert np.array_equal(a_logits, sync.last_logits())


def test_continuation_after_a_discarded_step_equals_the_synchronous_one(runner):
    stop, _ = _stop_token(runner)
    outs = []
    for ahead in (False, True):
        s = _session(runner, ahead)
        g = s.stream(PROMPTS, max_new_tokens=12, stop_token_ids=stop)
        g.run()
        g.extend([[5, 6], None, [7], [8, 9, 10]], max_new_tokens=6)
        outs.append([(r.output_ids, r.finish_reason) for r in g.run()])
    assert outs[0] == outs[1]


def test_sampled_rows_draw_the_same_tokens_with_run_ahead(runner):
    stop, _ = _stop_token(runner)
    sampling = [dict(do_sample=True, temperature=0.9, top_k=20, seed=3), None,
                dict(do_sample=True, top_p=0.8, seed=4, repetition_penalty=1.2), dict(do_sample=True, seed=5)]
    outs = []
    for ahead in (False, True):
        s = _session(runner, ahead)
        g = s.stream(PROMPTS, max_new_tokens=10, sampling=sampling, stop_token_ids=stop)
        first = [r.output_ids for r in g.run()]
        g.extend([[3], [4], [5], [6]], max_new_tokens=5)
        outs.append((first, [r.output_ids for r in g.run()], s.step().tokens.tolist()))
    assert outs[0] == outs[1]


def test_an_abandoned_generation_leaves_the_steps_it_showed(runner):
    s = _session(runner, True)
    it = iter(s.stream(PROMPTS, max_new_tokens=20))
    seen = [next(it) for _ in range(4 * 3)]  # three steps of four rows
    assert s.counters.run_ahead_steps > 0
    it.close()  # what a ``break`` out of the for loop does
    assert s.counters.discarded_steps > 0
    sync = _session(runner, False)
    decode(sync, PROMPTS, 2)  # the prefill's token and two steps: what the three deltas showed
    assert np.array_equal(s.lengths, sync.lengths)
    assert [d.row for d in seen] == [0, 1, 2, 3] * 3


def test_step_async_queue_limits_and_read_order(runner):
    s = _session(runner, True)
    sync = _session(runner, False)
    s.prefill(PROMPTS)
    sync.prefill(PROMPTS)
    queued = [s.step_async() for _ in range(MAX_UNREAD)]
    with pytest.raises(RequestError, match="unread"):
        s.step_async()
    second = queued[1].result()  # reads the first one too, in order
    assert queued[0].read
    assert np.array_equal(queued[0].result().tokens, sync.step().tokens)
    assert np.array_equal(second.tokens, sync.step().tokens)
    with pytest.raises(RequestError):
        s.discard(queued[0])  # a read step cannot be discarded
    late = s.step_async()
    out = s.step()  # a plain step discards the unread one first
    with pytest.raises(RequestError, match="discarded"):
        late.result()
    assert np.array_equal(out.tokens, sync.step().tokens)
    assert np.array_equal(s.lengths, sync.lengths)


def test_a_refused_step_async_changes_nothing(runner):
    s = _session(runner, True, capacity=8)
    s.prefill([[1, 2, 3]] * 4)
    with pytest.raises(RequestError, match="force_tokens"):
        s.step_async(force_tokens=[1, 2])
    queued = [s.step_async() for _ in range(2)]
    for p in queued:
        p.result()
    before = s.lengths.copy()
    for _ in range(8 - 3 - 2):
        s.step()
    with pytest.raises(RequestError, match="KV cache full"):
        s.step_async()
    assert np.array_equal(s.lengths, before + 3)
    assert not s.can_run_ahead()


def test_no_run_ahead_into_kv_growth(runner):
    s = Session(runner, batch=2, capacity=8, kv_policy="growing", max_capacity=64, run_ahead=True)
    s.prefill([[1, 2, 3, 4, 5, 6, 7], [1]])
    assert s.can_run_ahead()  # position 8 fits the 8 allocated
    s.step_async()
    assert not s.can_run_ahead()  # position 9 needs growth: queued alone, after the device is idle
    s.step_async().result()
    assert s.capacity > 8 and s.counters.growth_events >= 1


def test_a_closed_sessions_queued_steps_cannot_touch_the_next_owner_of_its_state(runner):
    """close() drops the unread steps, so a discard afterwards (an abandoned stream's cleanup,
    say) does nothing to the session that took the pooled decode state next."""
    want = decode(_session(runner, False, batch=1), [[5, 6, 7]], 4).tokens
    s1 = _session(runner, True, batch=1)
    s1.prefill([[9, 9]])
    p = s1.step_async()
    s1.step_async()
    s1.close()
    assert p.discarded
    s2 = _session(runner, True, batch=1)  # the same pooled state
    s2.prefill([[5, 6, 7]])
    got = [s2.step().tokens]
    s1.discard(p)  # a no-op now
    got += [s2.step().tokens for _ in range(3)]
    assert np.array_equal(np.concatenate(got), want[1:, 0])


def test_an_abandoned_stream_closed_after_its_session_leaves_the_next_one_alone(runner):
    sync = _session(runner, False, batch=1)
    want = [r.output_ids for r in sync.stream([[5, 6, 7]], max_new_tokens=6).run()]
    s1 = _session(runner, True, batch=1)
    it = iter(s1.stream([[9, 9]], max_new_tokens=20))
    next(it)
    s1.close()
    s2 = _session(runner, True, batch=1)
    g = s2.stream([[5, 6, 7]], max_new_tokens=6)
    gi = iter(g)
    next(gi)
    it.close()  # the first stream's cleanup runs now
    for _ in gi:
        pass
    assert [r.output_ids for r in g.rows] == want


def test_a_repetition_penalty_keeps_one_step_ahead_and_its_draws(runner):
    """A second queued step would mark, in the penalty history, a token the first one chose; a
    penalised session queues one step ahead at most, so discards leave the draws alone."""
    samp = [dict(repetition_penalty=100.0)]
    sync = _session(runner, False, batch=1)
    sync.prefill([[5, 6, 7]], samp)
    want = [sync.step().tokens[0] for _ in range(6)]
    s = _session(runner, True, batch=1)
    s.prefill([[5, 6, 7]], samp)
    assert s.max_unread() == 1
    got = [s.step().tokens[0]]
    q = s.step_async()
    with pytest.raises(RequestError, match="may be"):
        s.step_async()
    s.discard(q)
    got += [s.step().tokens[0] for _ in range(5)]
    assert got == want
    # through the stream: break out, then step on
    outs = []
    for ahead in (False, True):
        s = _session(runner, ahead, batch=1)
        it = iter(s.stream([[5, 6, 7]], max_new_tokens=20,
                           sampling=[dict(do_sample=True, seed=4, repetition_penalty=1.5)]))
        for _ in range(6):
            next(it)
        it.close()
        outs.append([s.step().tokens[0] for _ in range(3)])
    assert outs[0] == outs[1]


def test_a_step_the_caller_read_during_a_stream_is_not_discarded_by_its_cleanup(runner):
    s = _session(runner, True, batch=1)
    it = iter(s.stream([[5, 6, 7]], max_new_tokens=20))
    next(it)  # the stream has queued its next steps
    assert s._unread
    s._unread[0].result()  # the caller reads one of them (a misuse, but not an error)
    it.close()  # the cleanup discards only what nobody read
    assert not s._unread


def test_no_run_ahead_into_a_new_kv_page(runner):
    """A step that backs a new page of the KV cache (kv_commit; on cuda a VMM map, and under a
    device budget perhaps a re-plan of the weights) is not queued behind an unread one."""
    s = Session(runner, batch=1, capacity=96, kv_policy="fixed", run_ahead=True)
    s.prefill([[1, 2]])
    seen = {True: 0, False: 0}
    for _ in range(90):
        needed = int(s.lengths.max()) + 1
        seen[s.state.kv.commit_needed(needed)] += 1
        assert s.can_run_ahead() == (not s.state.kv.commit_needed(needed))
        s.step()
    assert seen[True] >= 1 and seen[False] >= 1  # both cases met on the way

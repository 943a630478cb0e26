"""The engine's policy, requests and loop on cpu_reference (solo equivalence: test_engine_fuzz.py)."""

from __future__ import annotations

import threading
import time

import pytest

from core.engine import Engine, EngineClosedError, QueueFullError
from core.engine.scheduler import Scheduler, buckets
from core.runtime.runner import Runner
from core.session import RequestError, Session
from core.testing.arrivals import solo_tokens
from core.testing.tiny_model import make_tiny_model, write_byte_tokenizer


class _Req:
    def __init__(self, rid: str, n: int = 4):
        self.id, self.prompt_ids = rid, [1] * n


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return Runner(write_byte_tokenizer(make_tiny_model(tmp_path_factory.mktemp("engine"))), "cpu_reference")


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError):
        buckets(0)


def test_scheduler_lowest_free_slot_and_bucket():
    s = Scheduler(slots=8, prefill_tokens=100)
    for i in range(5):
        s.submit(_Req(f"r{i}"))
    assert [slot for _, slot in s.admit()] == [0, 1, 2, 3, 4]
    assert s.bucket() == 8
    for slot in (3, 4):
        s.release(slot)
    assert s.bucket() == 4
    s.release(0)
    s.submit(_Req("late"))
    assert s.admit()[0][1] == 0  # the lowest free slot keeps the rows packed
    assert s.find("late")[:2] == ("running", s.running[0])


def test_compaction_moves_the_highest_rows_into_the_lowest_free_slots():
    s = Scheduler(slots=8, prefill_tokens=100)
    for i in range(8):
        s.submit(_Req(f"r{i}"))
    s.admit()
    for slot in (0, 1, 2, 4, 5):
        s.release(slot)
    assert s.bucket() == 8 and s.compaction() == [(7, 0), (6, 1)]
    assert sorted(s.running) == [0, 1, 3] and s.bucket() == 4
    assert [r.id for r in (s.running[0], s.running[1], s.running[3])] == ["r7", "r6", "r3"]
    assert s.compaction() == []  # three rows need bucket 4: nothing above it is left
    s.release(3)
    assert s.compaction() == [] and s.bucket() == 2


def test_a_row_left_alone_in_a_high_slot_decodes_at_bucket_one(runner):
    engine = Engine(runner, max_batch=8, capacity=48)
    short = [engine.submit([3 + i, 4], max_tokens=2) for i in range(7)]
    long = engine.submit([9, 8, 7], max_tokens=24)
    engine.run_until_idle()
    assert all(list(h)[-1].finish_reason == "length" for h in short)
    tokens = [t for e in long for t in e.token_ids]
    assert engine.counters.rows_moved == 1 and 1 in engine.slots._buckets  # slot 7 -> 0, then bucket 1
    assert tokens == solo_tokens(Session(runner, batch=1, capacity=48, kv_policy="fixed"), long.request)


def test_scheduler_prefill_budget_admits_at_least_one():
    s = Scheduler(slots=4, prefill_tokens=10)
    for i, n in enumerate((30, 4, 4, 4)):
        s.submit(_Req(f"r{i}", n))
    assert [r.id for r, _ in s.admit()] == ["r0"]  # over budget alone: still admitted
    assert [r.id for r, _ in s.admit()] == ["r1", "r2"]


def test_request_validation_names_the_problem(runner):
    engine = Engine(runner, max_batch=2, capacity=32)
    bad = [({"prompt_ids": []}, "empty"), ({"prompt_ids": [1, 999]}, "outside"),
           ({"prompt_ids": [1], "max_tokens": 0}, "max_tokens"),
           ({"prompt_ids": [1] * 30, "max_tokens": 5}, "positions"),
           ({"prompt_ids": [1], "stop": [""]}, "stop"),
           ({"prompt_ids": [1], "sampling": {"temperature": -1}}, "temperature"),
           ({"prompt_ids": [1], "stop_token_ids": [256]}, "stop_token_ids")]
    for kwargs, word in bad:
        with pytest.raises(RequestError, match=word):
            engine.request(**kwargs)
    assert not engine.busy()


def test_a_request_beyond_its_slot_names_the_largest_max_tokens(runner):
    engine = Engine(runner, max_batch=2, capacity=32)
    with pytest.raises(RequestError, match=r"the prompt has 1 token; with max_tokens=40 it needs 40 positions, "
                       r"and a slot holds 32: max_tokens can be at most 32$"):
        engine.request(prompt_ids=[1], max_tokens=40)
    with pytest.raises(RequestError, match=r"has 30 tokens; .*max_tokens can be at most 3$"):
        engine.request(prompt_ids=[1] * 30, max_tokens=5)
    with pytest.raises(RequestError, match=r"has 40 tokens; .*: shorten the prompt$"):
        engine.request(prompt_ids=[1] * 40, max_tokens=1)
    assert engine.request(prompt_ids=[1] * 30, max_tokens=3).max_tokens == 3


def test_stop_string_across_tokens_and_no_broken_utf8(runner):
    engine = Engine(runner, max_batch=2, capacity=32)
    req = engine.request([5, 6], max_tokens=20, stop=["cd"])
    text = "é€ab" + "c" + "dzz"
    pieces = []
    for tok in text.encode():
        event = req.feed(tok, False)
        pieces.append(event.text)
        assert "\ufffd" not in event.text
        if event.finish_reason:
            break
    assert event.finish_reason == "stop" and req.stop == "cd"
    assert "".join(pieces) == req.text == "é€ab"


def test_abort_frees_the_slot_before_the_next_step(runner):
    engine = Engine(runner, max_batch=1, capacity=32)
    first = engine.submit([3, 4, 5], max_tokens=20)
    second = engine.submit([7, 8], max_tokens=3)
    engine.run_once()  # the first is admitted and decodes; the second waits
    assert engine.running == 1 and engine.waiting == 1
    engine.abort(first.request.id)
    engine.run_once()  # the abort frees slot 0 and the second takes it in the same iteration
    assert engine.scheduler.running[0] is second.request
    engine.run_until_idle()
    assert [e.finish_reason for e in first][-1] == "abort"
    tokens = [t for e in second for t in e.token_ids]
    session = Session(runner, batch=1, capacity=32, kv_policy="fixed")
    assert tokens == solo_tokens(session, second.request)


def test_full_queue_refuses_and_the_engine_serves_on(runner):
    engine = Engine(runner, max_batch=1, capacity=32, max_waiting=2)
    handles = [engine.submit([3], max_tokens=2) for _ in range(2)]
    with pytest.raises(QueueFullError):
        engine.submit([3], max_tokens=2)
    engine.run_until_idle()
    assert [list(h)[-1].finish_reason for h in handles] == ["length", "length"]
    engine.submit([3], max_tokens=2)  # room again


def test_thread_owner_shutdown_aborts_the_rest(runner):
    engine = Engine(runner, max_batch=2, capacity=64).start()
    done = engine.submit([9, 10, 11], max_tokens=4)
    events = list(done)
    assert events[-1].finish_reason == "length" and events[-1].usage.completion_tokens == 4
    started = threading.Event()

    def slow(event):  # 60 tokens take at least 0.6 s: shutdown comes long before the last
        started.set()
        time.sleep(0.01)

    long = engine.request([9], max_tokens=60, sink=slow)
    engine.add(long)
    assert started.wait(10)
    engine.shutdown(timeout=10)
    assert long.finish_reason == "abort" and 0 < len(long.output_ids) < 60
    with pytest.raises(EngineClosedError):
        engine.submit([1], max_tokens=1)


def test_a_failing_sink_aborts_only_its_request(runner):
    engine = Engine(runner, max_batch=2, capacity=32)

    def broken(event):
        raise RuntimeError("consumer bug")

    bad = engine.request([4, 5], max_tokens=10, sink=broken)
    engine.add(bad)
    good = engine.submit([4, 5], max_tokens=10)
    engine.run_until_idle()
    assert bad.finish_reason == "abort"
    assert list(good)[-1].finish_reason == "length"


@pytest.mark.parametrize("seed", range(20))
def test_window_detokenizer_joins_to_the_full_decode(runner, seed):
    import numpy as np

    from core.engine.detok import WindowDetokenizer

    tok = runner.model.tokenizer
    rng = np.random.default_rng(seed)
    text = "".join(rng.choice(["a", " b", "é", "€", "😀", "東京", "\n"], 40))
    ids = list(text.encode())
    if seed % 2:  # and raw random bytes: invalid sequences decode to U+FFFD in both
        ids = rng.integers(0, 256, 80).tolist()
    d = WindowDetokenizer(tok, holdback=seed % 3)
    parts = []
    for t in ids:
        d.add(t)
        parts.append(d.release())
        assert not parts[-1].endswith("\ufffd") or seed % 2
    parts.append(d.finish())
    assert "".join(parts) == d.text == tok.decode(ids)
    if not seed % 2:
        assert d.text == text and not any("\ufffd" in p for p in parts)


@pytest.mark.parametrize("run_ahead", [True, False])
def test_run_ahead_queues_the_next_step_and_drops_its_extra_token(runner, run_ahead):
    engine = Engine(runner, max_batch=2, capacity=32, run_ahead=run_ahead)
    handle = engine.submit([3, 4, 5], max_tokens=10)
    engine.run_until_idle()
    tokens = [t for e in handle for t in e.token_ids]
    assert tokens == solo_tokens(Session(runner, batch=1, capacity=32, kv_policy="fixed"), handle.request)
    # 9 decode steps give tokens 2..10; running ahead, none past the row's max_tokens is queued
    assert engine.counters.decode_steps == 9
    assert (engine.counters.run_ahead_steps > 0) == run_ahead
    # a row that ends early (a stop token) had the next step queued already: its token is dropped
    stop = tokens[4]
    ends = tokens.index(stop) + 1
    early = engine.submit([3, 4, 5], max_tokens=10, stop_token_ids=[stop])
    engine.run_until_idle()
    assert [t for e in early for t in e.token_ids] == tokens[:ends]
    assert engine.counters.decode_steps == 9 + (ends - 1) + run_ahead


def test_a_failing_decode_step_fails_its_rows_and_the_engine_serves_on(runner, monkeypatch):
    engine = Engine(runner, max_batch=2, capacity=32)
    doomed = engine.submit([3, 4], max_tokens=8)
    engine.run_once()  # admitted and prefilled, one step
    real = engine.slots.decode

    def broken(*args):
        raise RuntimeError("device fault")
    monkeypatch.setattr(engine.slots, "decode", broken)
    engine.run_once()
    assert doomed.request.finish_reason == "error" and engine.running == 0
    monkeypatch.setattr(engine.slots, "decode", real)
    after = engine.submit([3, 4], max_tokens=8)
    engine.run_until_idle()
    tokens = [t for e in after for t in e.token_ids]
    assert tokens == solo_tokens(Session(runner, batch=1, capacity=32, kv_policy="fixed"), after.request)


def test_session_batch_equals_the_engine_bitwise(runner):
    """The fixed-batch Session and the engine give the same tokens for the same rows (both are
    each row's solo run): Session(batch=4) against four requests arriving together."""
    rows = [[5, 6, 7], [9], [11, 12, 13, 14, 15, 16], [20, 21]]
    sampling = [None, {"do_sample": True, "temperature": 0.9, "seed": 3}, None,
                {"do_sample": True, "top_k": 5, "seed": 8}]
    session = Session(runner, batch=4, capacity=32, kv_policy="fixed")
    out = session.prefill(rows, sampling)
    batch = [out.tokens]
    for _ in range(11):
        batch.append(session.step().tokens)
    engine = Engine(runner, max_batch=4, capacity=32)
    handles = [engine.submit(r, max_tokens=12, sampling=s) for r, s in zip(rows, sampling)]
    engine.run_until_idle()
    for b, h in enumerate(handles):
        assert [t for e in h for t in e.token_ids] == [int(step[b]) for step in batch]

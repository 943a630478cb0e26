"""Tensor parallel as an engine step runner (docs/parallel.md, docs/engine.md): ``core.run(...,
tensor_parallel=R)`` and ``lockstep run --tensor-parallel R`` decode on the engine over a
:class:`~core.parallel.runner.TensorParallelRunner`, bitwise the fixed-batch
TensorParallelSession's rows, within the stated tolerance of the unsharded run, and stop their
ranks; a dead rank ends the request with a RankError and leaves nothing (cpu_reference,
simulated ranks)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal

import numpy as np
import pytest

import core
from core.cli import main as cli_main
from core.engine import Engine
from core.engine.logprobs import chosen
from core.parallel import RankError
from core.parallel.runner import TensorParallelRunner
from core.session import RequestError, Session
from core.testing.tiny_model import TinyConfig, make_tiny_model, write_byte_tokenizer

#: docs/parallel.md: fp32 logits within 1e-5 x max|logit| of the unsharded run
RTOL_FP32 = 1e-5
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [3, 4, 200, 17]]
NEWS = [7, 3, 6]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_byte_tokenizer(make_tiny_model(tmp_path_factory.mktemp("tpe2") / "m"))


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tpe3"), config=TinyConfig(heads=6, kv_heads=3), seed=3)


def _tp_pids() -> list[int]:
    return [p.pid for p in multiprocessing.active_children() if p.name.startswith("lockstep-tp-rank")]


@pytest.mark.parametrize("ranks", [2, 3])
def test_core_run_tensor_parallel_is_the_engine_bitwise_the_tp_session(ranks, tiny, tiny3):
    folder = tiny if ranks == 2 else tiny3
    before = _tp_pids()
    got = core.run(str(folder), input_ids=PROMPTS, max_new_tokens=NEWS, tensor_parallel=ranks)
    assert _tp_pids() == before  # core.run stopped the ranks it started
    c = got.counters
    assert c["engine_requests"] == len(PROMPTS) and c["tensor_parallel"] == ranks
    assert c["decode_steps"] > 0 and c["all_reduces"] == (c["prefill_runs"] + c["decode_steps"]) * (1 + 2 * 2)
    tp = Session(str(folder), batch=len(PROMPTS), capacity=64, kv_policy="fixed", tensor_parallel=ranks)
    try:
        want = tp.stream(PROMPTS, NEWS).run()
    finally:
        tp.close()
    assert [r.output_ids for r in got.rows] == [w.output_ids for w in want]
    assert [r.finish_reason for r in got.rows] == [w.finish_reason for w in want]


def test_tp_engine_bitwise_the_tp_session_and_within_the_tolerance_of_the_unsharded_run(tiny):
    """Each token's log-probability on the TP engine (chunked prefill): bitwise the fixed-batch
    TP session's, and against the unsharded run's logits fed the same tokens (teacher forcing)
    within the stated tolerance; tokens equal wherever the top two differ clearly."""
    runner = TensorParallelRunner(tiny, "cpu_reference", tensor_parallel=2)
    try:
        engine = Engine(runner, max_batch=4, capacity=64, prefill_chunk=3)  # chunked prefill on the ranks too
        handles = [engine.submit(p, max_tokens=6, logprobs=True) for p in PROMPTS]
        engine.run_until_idle()
        events = [[e for e in h] for h in handles]
        engine.shutdown()
        assert engine.counters.prefill_chunks > 0 and engine.counters.all_reduces > 0
    finally:
        runner.close()
    assert runner.alive_ranks() == []
    tp = Session(tiny, batch=len(PROMPTS), capacity=64, kv_policy="fixed", tensor_parallel=2)
    try:  # the fixed-batch TP session's logits give the engine's log-probabilities bit for bit
        out = tp.prefill(PROMPTS)
        session_lps = [[chosen(x, t) for x, t in zip(tp.last_logits(), out.tokens.tolist())]]
        for _ in range(5):
            out = tp.step()
            session_lps.append([chosen(x, t) for x, t in zip(tp.last_logits(), out.tokens.tolist())])
    finally:
        tp.close()
    for b, evs in enumerate(events):
        lps = [lp for e in evs for lp in e.logprobs]
        assert lps == [step[b] for step in session_lps[:len(lps)]]
    for prompt, evs in zip(PROMPTS, events):
        lps = [lp for e in evs for lp in e.logprobs]
        tokens = [lp.token for lp in lps]
        ref = Session(tiny, batch=1, capacity=64, prefill_groups="off")
        ref.prefill([prompt])
        logits = [ref.last_logits()[0]]
        for t in tokens[:-1]:
            ref.step(force_tokens=[t])
            logits.append(ref.last_logits()[0])
        ref.close()
        x = np.array(logits, np.float32)
        scale = np.abs(x).max()
        lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
        want = x[np.arange(len(tokens)), tokens] - lse
        assert np.abs(np.array([lp.logprob for lp in lps]) - want).max() <= 2 * RTOL_FP32 * scale
        top2 = np.sort(x, axis=-1)[:, -2:]
        decisive = (top2[:, 1] - top2[:, 0]) > 4 * RTOL_FP32 * scale
        assert decisive.mean() > 0.8
        assert np.array_equal(np.array(tokens)[decisive], x.argmax(-1)[decisive])


def test_lockstep_run_tensor_parallel_goes_through_the_engine(tiny, capsys):
    before = _tp_pids()
    args = ["run", "--model", str(tiny), "--raw", "--max-new-tokens", "4", "--json", "--prompt", "Hello",
            "--prompt", "Name a color.", "--tensor-parallel", "2"]
    assert cli_main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["counters"]["engine_requests"] == 2 and doc["counters"]["tensor_parallel"] == 2
    ref = core.run(str(tiny), prompts=["Hello", "Name a color."], max_new_tokens=4, chat=False)
    assert [r["output_ids"] for r in doc["rows"]] == [r.output_ids for r in ref.rows]
    assert _tp_pids() == before


def test_sampling_is_refused_and_a_capacity_as_tight_as_the_sessions_runs_on_the_engine(tiny):
    runner = TensorParallelRunner(tiny, tensor_parallel=2)
    try:
        engine = Engine(runner, max_batch=2, capacity=64)
        with pytest.raises(RequestError, match="greedily only"):
            engine.submit(PROMPTS[0], max_tokens=3, sampling={"do_sample": True, "seed": 1})
        h = engine.submit(PROMPTS[1], max_tokens=3)
        engine.run_until_idle()
        assert len([t for e in h for t in e.token_ids]) == 3
        engine.shutdown()
    finally:
        runner.close()
    # 7 prompt tokens + 3 new need 9 positions, in an engine slot as on the Session
    got = core.run(str(tiny), input_ids=[PROMPTS[0]], max_new_tokens=3, capacity=9, tensor_parallel=2)
    assert got.counters["engine_requests"] == 1 and got.counters["tensor_parallel"] == 2
    assert got.rows[0].output_ids == core.run(str(tiny), input_ids=[PROMPTS[0]], max_new_tokens=3).rows[0].output_ids


def test_a_dead_rank_ends_the_request_with_a_rank_error_and_leaves_nothing(tiny, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_RANK_TIMEOUT", "2")
    st = core.stream(str(tiny), input_ids=PROMPTS, max_new_tokens=8, tensor_parallel=2)
    runner = st.generation.runner
    pids = runner.rank_pids
    deltas = iter(st)
    next(deltas)  # the prefill ran
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RankError, match=r"rank 1 died \(exit code -9\)"):
        list(deltas)
    assert runner.alive_ranks() == [] and not set(pids) & set(_tp_pids())
    with pytest.raises(RequestError, match="closed"):
        runner._call("close", 0)

"""Weight and device budgets through the engine: ``core.run`` with ``weight_budget`` /
``device_budget`` (or on a Runner whose weights stream) decodes on the engine, its steps paging
the streamed weights in as the Session's do, bitwise the resident run and the Session path, and
the engine's counters meter the streaming (``htod_bytes``, ``page_ins``, ``evictions``; per
token per advanced row) as the Session reports it; ``lockstep serve --weight-budget /
--device-budget`` and /metrics (cpu_reference; the cuda twin is
tests/cuda/test_run_engine_cuda.py)."""

from __future__ import annotations

import numpy as np
import pytest

import core
from core.runtime import residency
from core.runtime.runner import Runner
from core.session import Session
from core.testing.tiny_model import TinyConfig, make_tiny_model

PROMPTS = [[int(t) for t in np.random.default_rng(9).integers(3, 120, n)] for n in (3, 11, 6)]
NEWS = [7, 4, 9]
SAMPLED = [{"do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 5 + i} for i in range(3)]


@pytest.fixture(autouse=True)
def small_tensors_stream(monkeypatch):
    """The tiny model's matrices are a few KiB: let everything but the embedding stream."""
    monkeypatch.setattr(residency, "SMALL_BYTES", 512)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("budget") / "m", config=TinyConfig(layers=4, vocab=128, context=256))


def streamed_runner(folder) -> Runner:
    runner = Runner(folder, "cpu_reference", weight_budget=0.5)
    assert runner.residency.streams and runner.residency.page_ins_per_step > runner.residency.slots
    return runner


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "seeded"])
def test_a_weight_budget_runs_on_the_engine_bitwise_the_resident_run_and_the_session_path(folder, sampling):
    resident = core.run(Runner(folder, "cpu_reference"), input_ids=PROMPTS, max_new_tokens=NEWS, sampling=sampling)
    got = core.run(folder, input_ids=PROMPTS, max_new_tokens=NEWS, sampling=sampling, weight_budget=0.5)
    c = got.counters
    assert c["engine_requests"] == len(PROMPTS)  # the engine, not the Session fallback
    assert c["weight_bytes_streamed_per_step"] > 0 and c["weight_budget"] is not None
    assert c["htod_bytes"] > 0 and c["page_ins"] > 0 and c["evictions"] > 0 and c["htod_bytes_per_token"] > 0
    assert [r.output_ids for r in got.rows] == [r.output_ids for r in resident.rows]
    assert resident.counters["htod_bytes"] == 0
    runner = streamed_runner(folder)
    session = Session(runner, batch=len(PROMPTS), capacity=64, kv_policy="fixed")
    want = session.stream(PROMPTS, NEWS, sampling=sampling).run()
    session.close()
    assert [r.output_ids for r in got.rows] == [w.output_ids for w in want]
    assert [r.finish_reason for r in got.rows] == [w.finish_reason for w in want]


def test_the_engine_meters_what_the_ring_copied_as_the_session_does(folder):
    """Rows of one length: every decode step advances every row on both paths, so the per-token
    figures are the Session's; the totals are what the staging ring copied, prefill included."""
    news = [6] * len(PROMPTS)
    runner = streamed_runner(folder)
    got = core.run(runner, input_ids=PROMPTS, max_new_tokens=news)
    c, r = got.counters, runner.residency
    assert c["engine_requests"] == len(PROMPTS)
    assert c["htod_bytes"] == runner.stream.bytes_copied > 0, "the counters are not what the ring copied"
    assert c["page_ins"] == runner.stream.copies
    runs = c["decode_steps"] + c["prefill_runs"]  # one plan run each (the rows prefill in one padded run)
    assert c["htod_bytes"] == runs * r.weight_bytes_streamed_per_step
    assert c["page_ins"] == runs * r.page_ins_per_step
    assert c["htod_bytes_per_token"] == r.weight_bytes_streamed_per_step / len(PROMPTS)
    assert c["page_ins_per_token"] == r.page_ins_per_step / len(PROMPTS)
    session = Session(runner, batch=len(PROMPTS), capacity=64, kv_policy="fixed")
    want = session.stream(PROMPTS, news).run()
    s = session.counters
    session.close()
    assert [row.output_ids for row in got.rows] == [w.output_ids for w in want]
    for name in ("htod_bytes_per_token", "page_ins_per_token", "weight_bytes_streamed_per_step", "hit_rate"):
        assert c[name] == getattr(s, name), name
    assert c["evictions"] > 0 and s.evictions > 0


def test_a_padded_lane_advances_no_row(folder):
    """One row of three slots still running: its steps count one token each (per advanced row)."""
    runner = streamed_runner(folder)
    got = core.run(runner, input_ids=PROMPTS, max_new_tokens=[1, 1, 8])
    c, r = got.counters, runner.residency
    assert c["engine_requests"] == 3 and c["htod_bytes_per_token"] > 0
    # steps of the one live row (compacted into bucket 1) count one token each
    assert c["htod_bytes_per_token"] == r.weight_bytes_streamed_per_step


def test_a_device_budget_runs_on_the_engine_bitwise_the_resident_run(folder):
    resident = core.run(folder, input_ids=PROMPTS, max_new_tokens=NEWS)
    weights = Runner(folder, "cpu_reference").model.weight_bytes()
    # half the weights, beside the slots' KV cache and their workspace (reserved since the engine
    # opens its state through Runner.open_state), its prefill runs' included
    got = core.run(folder, input_ids=PROMPTS, max_new_tokens=NEWS, device_budget=weights // 2 + 512 * 1024)
    c = got.counters
    assert c["engine_requests"] == len(PROMPTS) and c["kv_bytes"] > 0
    assert c["weight_bytes_streamed_per_step"] > 0 and c["htod_bytes"] > 0 and c["page_ins"] > 0
    assert [r.output_ids for r in got.rows] == [r.output_ids for r in resident.rows]


def test_a_capacity_as_tight_as_a_sessions_row_with_a_budget_runs_on_the_engine(folder):
    """11 prompt tokens + 3 new in 13 positions (the last token's KV is never written), streamed."""
    got = core.run(folder, input_ids=[PROMPTS[1]], max_new_tokens=3, capacity=13, weight_budget=0.5)
    assert got.counters["engine_requests"] == 1 and got.counters["htod_bytes"] > 0
    assert got.rows[0].output_ids == core.run(folder, input_ids=[PROMPTS[1]], max_new_tokens=3).rows[0].output_ids


def test_serve_takes_the_budgets_and_its_metrics_export_the_streaming_counters(folder, monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from core import cli
    from core.serve import server as server_mod

    a = cli.build_parser().parse_args(["serve", str(folder), "--weight-budget", "50%", "--device-budget", "4GiB"])
    assert (a.weight_budget, a.device_budget) == ("50%", "4GiB")
    seen: dict = {}
    monkeypatch.setattr(server_mod, "build_server", lambda *args, **kw: seen.update(args=args, kw=kw))
    monkeypatch.setattr(server_mod, "serve", lambda *args: None)
    assert a.func(a) == 0
    assert seen["args"][-2:] == ("50%", "4GiB")  # weight and device budgets
    assert seen["kw"]["expert_budget"] is None
    bad = cli.build_parser().parse_args(["serve", str(folder), "--weight-budget", "0"])
    with pytest.raises(core.RequestError, match="--weight-budget"):
        bad.func(bad)

    monkeypatch.undo()
    monkeypatch.setattr(residency, "SMALL_BYTES", 512)
    srv = server_mod.build_server(folder, max_batch=2, capacity=64, weight_budget=0.5)
    engine = srv.load()
    try:
        srv.metrics.watch(engine)
        assert engine.runner.residency.streams
        handle = engine.submit(PROMPTS[0], max_tokens=5)
        assert [t for e in handle for t in e.token_ids] == core.run(folder, input_ids=[PROMPTS[0]],
                                                                    max_new_tokens=5).rows[0].output_ids
        text = generate_latest(srv.metrics.registry).decode()
        for name in ("lockstep_htod_bytes_total", "lockstep_page_ins_total", "lockstep_evictions_total",
                     "lockstep_htod_bytes_per_token", "lockstep_weight_bytes_streamed_per_step"):
            value = float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith(name + " ")))
            assert value > 0, name
        assert float(next(ln.split()[1] for ln in text.splitlines()
                          if ln.startswith("lockstep_htod_bytes_total "))) == engine.counters.htod_bytes
    finally:
        engine.shutdown()

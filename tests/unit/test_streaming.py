"""Weight streaming under a budget on cpu_reference: the residency planner, bitwise equality
with the resident run, and counters that prove streaming happened (docs/cases.md 16-18).

cpu_reference streams through the default host WeightStream (synchronous host copies into
staging slots), so these tests check the plan, the schedule, the slot views the kernels read
and the counters; the GPU suite checks the copy stream and events (tests/cuda/test_cuda_streaming.py).
"""

import numpy as np
import pytest

from core.generation.loop import decode
from core.runtime import residency
from core.runtime.residency import BudgetError, Weight, parse_budget, plan_residency
from core.runtime.runner import Runner
from core.session import RequestError, Session
from core.testing.tiny_model import TinyConfig, make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider

ROWS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3], [4, 4, 4, 4], [7, 8], [9], [1, 2, 3]]


@pytest.fixture(autouse=True)
def small_tensors_stream(monkeypatch):
    """The tiny model's matrices are a few KiB: let everything but the embedding stream."""
    monkeypatch.setattr(residency, "SMALL_BYTES", 512)


@pytest.fixture(scope="module", params=[None, "int4"])
def model_dir(request, tmp_path_factory):
    config = TinyConfig(layers=6, vocab=128, context=256)  # many tensors, none dominant
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), quant=request.param, config=config)


def trace(runner, rows, steps=12, **kw):
    s = Session(runner, batch=len(rows), capacity=64, **kw)
    logits = []
    t = decode(s, rows, steps, observer=lambda *_: logits.append(s.last_logits()))
    return t.tokens, np.stack(logits), s.counters


def streamable_bytes(runner):
    return runner.residency.weight_bytes_streamed_per_step


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.9])
@pytest.mark.parametrize("batch", [1, 3])
def test_streamed_runs_are_bitwise_the_resident_run(model_dir, fraction, batch):
    resident = Runner(model_dir, CpuReferenceProvider())
    weights = residency.weights_of(resident.plan)
    streamable = sum(w.nbytes for w in weights if not residency._pinned(w))
    budget = residency.budget_for(weights, fraction, slots=2, mappable=True)
    streamed = Runner(model_dir, CpuReferenceProvider(), weight_budget=budget, staging_slots=2)
    r = streamed.residency
    assert streamed.weight_bytes + r.staging_bytes <= budget
    assert r.weight_bytes_streamed_per_step >= fraction * streamable
    want = trace(resident, ROWS[:batch])
    got = trace(streamed, ROWS[:batch])
    assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])
    c = got[2]
    steps = c.decode_steps + 1  # the prefill streams too
    assert c.htod_bytes == steps * r.weight_bytes_streamed_per_step > 0
    assert c.page_ins == steps * r.page_ins_per_step > 0
    assert streamed.stream.bytes_copied == c.htod_bytes, "the counters are not what the ring copied"
    assert c.weight_bytes + c.staging_bytes <= budget


def test_the_smallest_ring_over_200_steps_equals_the_resident_run(model_dir):
    resident = Runner(model_dir, CpuReferenceProvider())
    streamed = Runner(model_dir, CpuReferenceProvider(), weight_budget=0.5, staging_slots=2)
    assert streamed.residency.slots == 2 and streamed.residency.page_ins_per_step > 2
    rows = ROWS[:2]
    want = decode(Session(resident, batch=2, capacity=256), rows, 200).tokens
    s = Session(streamed, batch=2, capacity=256)
    got = decode(s, rows, 200).tokens
    assert np.array_equal(want, got)
    assert s.counters.evictions > 0 and s.counters.htod_bytes > 0


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_htod_bytes_per_token_fall_as_one_over_batch(model_dir, batch):
    runner = Runner(model_dir, CpuReferenceProvider(), weight_budget=0.5)
    _, _, c = trace(runner, ROWS[:batch], steps=8)
    per_step = runner.residency.weight_bytes_streamed_per_step
    assert per_step > 0
    assert c.htod_bytes_per_token == pytest.approx(per_step / batch, rel=0.05)
    assert c.page_ins_per_token == pytest.approx(runner.residency.page_ins_per_step / batch, rel=0.05)


def test_counters_report_the_residency(model_dir):
    runner = Runner(model_dir, CpuReferenceProvider(), weight_budget="50%")
    _, _, c = trace(runner, ROWS[:2], steps=2)
    r = runner.residency
    d = c.to_dict()
    for name in ("weight_bytes_resident", "weight_bytes_streamed_per_step", "htod_bytes_per_token",
                 "page_ins_per_token", "hit_rate", "byte_hit_rate", "evictions", "staging_bytes"):
        assert name in d
    assert 0 < c.byte_hit_rate < 1 and 0 < c.hit_rate < 1
    assert c.staging_bytes == r.slots * r.slot_bytes
    assert c.weight_bytes_streamed_per_step == r.weight_bytes_streamed_per_step


def test_a_budget_too_small_for_the_staging_ring_is_refused_before_any_work(model_dir):
    prov = CpuReferenceProvider()
    with pytest.raises(BudgetError, match="smallest working budget"):
        Runner(model_dir, prov, weight_budget=1000)
    with pytest.raises(RequestError, match="smallest working budget"):
        Session(model_dir, prov, batch=1, weight_budget=1000)
    Session(model_dir, prov, batch=1, weight_budget=0.6).prefill([[1, 2]])  # still usable


def test_admission_keeps_gathered_and_small_tensors_and_the_head_of_the_step():
    ws = [Weight("embed", 1024, True, -1), Weight("norm0", 10, False, 0), Weight("q0", 512, False, 0),
          Weight("mlp0", 768, False, 0), Weight("q1", 512, False, 1), Weight("mlp1", 768, False, 1),
          Weight("head", 1024, False, -1)]
    residency.SMALL_BYTES = 100
    # execution order alone would keep q0 + mlp0 and stream q1, mlp1, head (2304 bytes through
    # 1024-byte slots); keeping the largest page (head) resident shrinks the slots to 768 bytes
    # and streams 2048 bytes: the planner keeps the better of the two
    plan = plan_residency(ws, budget=1034 + 2 * 1024 + 1280, slots=2)
    assert plan.streamed == ("mlp0", "q1", "mlp1")
    assert plan.slot_bytes == 768 and plan.slots == 2 and plan.page_ins_per_step == 3
    assert plan.weight_bytes_resident == 1024 + 10 + 512 + 1024
    assert plan.byte_hit_rate == pytest.approx(1 - 2048 / 4618)
    even = [Weight(f"w{i}", 512, False, i, f"w{i}") for i in range(6)]
    assert plan_residency(even, budget=2 * 512 + 3 * 512, slots=2).streamed == ("w3", "w4", "w5")
    # one node's weights are one page: copied together into one slot
    ps = [Weight(f"d{i}", 512, False, 0, f"d{i}") for i in range(4)]
    ps += [Weight("g", 256, False, 0, "mlp"), Weight("u", 256, False, 0, "mlp")]
    paged = plan_residency(ps, budget=2559, slots=2)
    assert paged.pages == (("d2",), ("d3",), ("g", "u"))
    assert paged.placement()["g"] == (0, 0) and paged.placement()["u"] == (0, 256)
    # a weight several nodes read every step (the rotary caches) stays resident
    reused = [Weight("cos", 4096, False, -1, "a", readers=6)] + ps
    assert "cos" not in plan_residency(reused, budget=2559 + 4096, slots=2).streamed
    assert plan_residency(ws, None).streamed == ()
    with pytest.raises(BudgetError, match="at least 2 slots"):
        plan_residency(ws, 3000, slots=1)


@pytest.mark.parametrize("text, expected", [("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("40%", 400),
                                            ("0.4", 400), (0.25, 250), (123, 123), (None, None)])
def test_budgets_are_read_as_bytes_or_fractions(text, expected):
    assert parse_budget(text, 1000) == expected


@pytest.mark.parametrize("bad", ["lots", "-3", 0, 1.5, True, "150%"])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(BudgetError):
        parse_budget(bad, 1000)


def test_kv_growth_under_a_device_budget_streams_more_weights_and_loses_nothing(model_dir):
    """Elastic budget: a growing session whose KV growth needs device memory re-plans the
    residency (more weights stream), counts one invalidation per re-plan with its reason, and
    gives the tokens of the fully resident run."""
    from test_capture_policy import RecordingCapture

    from core.protocol import Capabilities

    class StreamingCapture(RecordingCapture):
        def capabilities(self):
            return Capabilities(dtypes=("float32",), graph_capture=True, weight_streaming=True)

    resident = Runner(model_dir, CpuReferenceProvider())
    rows = ROWS[:3]
    want = decode(Session(resident, batch=3, capacity=200), rows, 120).tokens
    prov = StreamingCapture()
    weights = sum(w.nbytes for w in residency.weights_of(resident.plan))
    kv_per_position = 2 * 6 * 3 * 2 * 16 * 4  # K and V, layers, rows, kv heads, head size, fp32
    # room for every weight beside a small cache, not beside the grown one
    # (the cache grows 16 -> 32 -> 64 -> 128 positions for 5 + 120 tokens), and the workspace
    work = resident.workspace_estimate(3, 200, (3, 16))  # its prefill's: three prompts at the first capacity
    runner = Runner(model_dir, prov, device_budget=int(0.6 * weights) + 128 * kv_per_position + work)
    assert not runner.residency.streams
    s = Session(runner, batch=3, capacity=16, kv_policy="growing", max_capacity=200, capture=True)
    prov.session = s
    got = decode(s, rows, 120).tokens
    c = s.counters
    assert np.array_equal(want, got)
    assert c.replans >= 1 and runner.residency.streams and c.htod_bytes > 0
    replan_reasons = [r for r in c.invalidation_reasons if r.startswith("weight plan changed")]
    assert len(replan_reasons) == c.replans
    assert (runner.weight_bytes + runner.residency.staging_bytes + runner.kv_device_bytes
            + runner.workspace_reserved <= runner.device_budget)


def test_the_smallest_working_budget_in_the_error_is_exact(model_dir):
    prov = CpuReferenceProvider()
    with pytest.raises(BudgetError) as info:
        Runner(model_dir, prov, weight_budget=1)
    smallest = int(str(info.value).rsplit("is ", 1)[1].split()[0].replace(",", ""))
    runner = Runner(model_dir, prov, weight_budget=smallest)
    assert runner.residency.streams and runner.weight_bytes + runner.residency.staging_bytes <= smallest
    with pytest.raises(BudgetError):
        Runner(model_dir, prov, weight_budget=smallest - 1)


def test_a_device_budget_is_bytes_not_a_fraction(model_dir):
    with pytest.raises(BudgetError, match="not a fraction"):
        Runner(model_dir, CpuReferenceProvider(), device_budget="50%")
    with pytest.raises(BudgetError, match="device budget of 1 byte leaves too little"):
        Runner(model_dir, CpuReferenceProvider(), device_budget=1)


def test_a_kv_cache_too_large_for_the_device_budget_names_the_smallest_working_one(model_dir):
    """A KV cache that leaves the weights less than their smallest working set is refused with
    the device budget that works for it; that budget opens the session, one byte less does not."""
    from test_capture_policy import RecordingCapture

    from core.protocol import Capabilities

    class Streaming(RecordingCapture):
        def capabilities(self):
            return Capabilities(dtypes=("float32",), graph_capture=True, weight_streaming=True)

    weights = sum(w.nbytes for w in residency.weights_of(Runner(model_dir, CpuReferenceProvider()).plan))
    runner = Runner(model_dir, Streaming(), device_budget=weights)
    with pytest.raises(BudgetError, match="cannot hold a KV cache") as info:
        Session(runner, batch=64, capacity=256)
    smallest = int(str(info.value).split("device budget for this KV cache is ")[1].split()[0].replace(",", ""))
    # the refusal changed nothing: the same Runner serves the next session bitwise a fresh one's
    assert runner.kv_device_bytes == 0
    want = decode(Session(Runner(model_dir, CpuReferenceProvider()), batch=1, capacity=16), ROWS[:1], 8).tokens
    runner.provider.session = s = Session(runner, batch=1, capacity=16)
    assert np.array_equal(decode(s, ROWS[:1], 8).tokens, want)
    Session(Runner(model_dir, Streaming(), device_budget=smallest), batch=64, capacity=256).close()
    with pytest.raises(BudgetError, match="cannot hold a KV cache"):
        Session(Runner(model_dir, Streaming(), device_budget=smallest - 1), batch=64, capacity=256)

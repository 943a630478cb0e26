"""One budget for a MoE model's dense weights and its experts (core.runtime.expert_budget,
docs/moe.md "Expert budgets"), on cpu_reference with the tiny folders of core.testing.moe_families.

A Runner given an expert budget, or a weight or device budget on a MoE model, pages the experts
(a plan of resident experts and a ring of 2 slots) and plans the other weights beside them. The
greedy tokens and logits of three rows are bitwise the all-resident run's, the session's counters
show the page-ins (the path ran), and a budget too small is refused naming the smallest one,
which then works. A plain device budget sizes the experts' share around the KV cache and
workspace of the decode states the caller will open (``Runner(reserve_for=...)``), so the
session opens within the budget.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from core.generation.generate import run
from core.generation.loop import decode
from core.models.model import load_model
from core.runtime.expert_budget import ExpertLayout
from core.runtime.experts import ExpertBudgetError
from core.runtime.residency import BudgetError
from core.runtime.runner import Runner
from core.session import Session
from core.testing.families import prepared_family

pytest.importorskip("onnxruntime_genai", reason="the builder (the models extra) makes the family folders")
pytest.importorskip("transformers")

pytestmark = pytest.mark.model

STEPS = 8
CAPACITY = 64
PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 21)), [200, 7, 7, 31, 64, 128, 9, 250, 1, 33, 77, 12, 6]]
CASES = [("gpt-oss", "fp32"), ("lfm2-moe", "int4")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-budget")
    built: dict = {}

    def get(family: str, precision: str):
        if (family, precision) not in built:
            built[family, precision] = load_model(prepared_family(family, root / f"{family}-{precision}", precision,
                                                                  "cpu"))
        return built[family, precision]

    return get


def _run(model, **budgets):
    """(tokens, logits, session, runner) of the three prompts under ``budgets`` (Runner kwargs)."""
    runner = Runner(model, "cpu_reference", **budgets)
    session = Session(runner, batch=len(PROMPTS), capacity=CAPACITY)
    logits: list = []
    trace = decode(session, PROMPTS, STEPS, observer=lambda *_: logits.append(session.last_logits()))
    return trace.tokens, np.stack(logits), session, runner


def _paged(session, runner, size):
    c = session.counters
    assert runner.expert_residency is not None
    assert c.expert_page_ins > 0 and c.expert_routed == c.expert_hits + c.expert_page_ins
    assert c.expert_bytes_copied == c.expert_page_ins * size and 0 < c.expert_hit_rate < 1
    assert c.expert_bytes_per_step > 0 and c.expert_bytes_per_token > 0


@pytest.mark.parametrize("family,precision", CASES)
def test_an_expert_budget_pages_the_experts_bitwise_the_resident_run(folders, family, precision):
    model = folders(family, precision)
    layout = ExpertLayout.of(model)
    size = max(layout.sizes.values())
    tokens, logits, resident, full = _run(model)
    assert resident.counters.expert_routed == 0 and full.expert_residency is None
    paged_tokens, paged_logits, session, runner = _run(model, expert_budget=(2 * len(layout.counts) + 2) * size)
    assert all(r == {0, 1} for r in runner.expert_residency.plan.resident.values())
    _paged(session, runner, size)
    assert runner.weight_bytes == full.weight_bytes - layout.total_bytes + (2 * len(layout.counts) + 2) * size
    assert np.array_equal(paged_tokens, tokens) and np.array_equal(paged_logits, logits)


@pytest.mark.parametrize("family,precision", CASES)
def test_a_weight_or_device_budget_shares_one_plan_with_the_experts(folders, family, precision):
    """The experts stream first: the dense weights stay resident and the experts get the rest
    (a weight budget), or the expert budget given beside a device budget."""
    model = folders(family, precision)
    layout = ExpertLayout.of(model)
    size = max(layout.sizes.values())
    tokens, logits, resident, full = _run(model)
    dense = full.weight_bytes - layout.total_bytes
    experts = (len(layout.counts) + 2) * size  # the ring and one expert a layer
    for budgets in ({"weight_budget": dense + experts},
                    {"device_budget": dense + experts + full.reservation(len(PROMPTS), CAPACITY),
                     "expert_budget": experts}):
        paged_tokens, paged_logits, session, runner = _run(model, **budgets)
        assert runner.residency.weight_bytes_streamed_per_step == 0  # the dense weights stay resident
        assert sum(len(r) for r in runner.expert_residency.plan.resident.values()) == len(layout.counts)
        _paged(session, runner, size)
        assert np.array_equal(paged_tokens, tokens) and np.array_equal(paged_logits, logits), budgets


def test_a_budget_too_small_names_the_smallest_working_one(folders):
    model = folders("gpt-oss", "fp32")
    layout = ExpertLayout.of(model)
    ring = layout.ring_bytes(2)
    with pytest.raises(BudgetError, match="smallest working budget is") as err:
        Runner(model, "cpu_reference", weight_budget=ring + 1000)
    smallest = int(re.search(r"smallest working budget is ([\d,]+) bytes", str(err.value)).group(1).replace(",", ""))
    with pytest.raises(BudgetError):
        Runner(model, "cpu_reference", weight_budget=smallest - 1)
    tokens, logits, _, _ = _run(model)
    paged_tokens, paged_logits, session, runner = _run(model, weight_budget=smallest)
    assert runner.expert_residency.plan.ring_slots == 2
    assert np.array_equal(paged_tokens, tokens) and np.array_equal(paged_logits, logits)
    with pytest.raises(ExpertBudgetError, match=f"smallest expert budget is {ring:,} bytes"):
        Runner(model, "cpu_reference", expert_budget=ring - 1)


def _within(runner, budget):
    """The Runner's device accounting (weights with the resident experts and ring, staging, KV,
    reserved workspace) is within ``budget``."""
    used = runner.weight_bytes + runner.residency.staging_bytes + runner.kv_device_bytes + runner.workspace_reserved
    assert runner.kv_device_bytes > 0 and runner.workspace_reserved > 0
    assert used <= budget, (used, budget)


@pytest.mark.parametrize("family,precision", CASES)
def test_a_plain_device_budget_leaves_the_experts_room_for_the_kv_cache(folders, family, precision):
    """A device budget alone: the experts get what the dense weights and the decode state's KV
    and workspace leave (before, they took everything the dense weights left and the session was
    refused); bitwise the resident run, page-ins counted, the accounting within the budget."""
    model = folders(family, precision)
    layout = ExpertLayout.of(model)
    size = max(layout.sizes.values())
    tokens, logits, resident, full = _run(model)
    dense = full.weight_bytes - layout.total_bytes
    reserve = full.reservation(len(PROMPTS), CAPACITY)
    experts = (len(layout.counts) + 2) * size  # the ring and one expert a layer
    budget = dense + experts + reserve
    paged_tokens, paged_logits, session, runner = _run(model, device_budget=budget,
                                                       reserve_for=(len(PROMPTS), CAPACITY))
    assert runner.expert_reserve == reserve and runner.expert_device_bytes == experts
    assert runner.residency.weight_bytes_streamed_per_step == 0 and runner.replans == 0
    _paged(session, runner, size)
    _within(runner, budget)
    assert np.array_equal(paged_tokens, tokens) and np.array_equal(paged_logits, logits)
    # a Session made from the model, and lockstep run's path (generate.run), pass their own batch and capacity
    session = Session(model, "cpu_reference", batch=len(PROMPTS), capacity=CAPACITY, device_budget=budget)
    assert np.array_equal(decode(session, PROMPTS, STEPS).tokens, tokens)
    _within(session.runner, budget)
    plain = run(model, "cpu_reference", input_ids=PROMPTS, max_new_tokens=STEPS)
    result = run(model, "cpu_reference", input_ids=PROMPTS, max_new_tokens=STEPS, device_budget=budget)
    assert [r.output_ids for r in result.rows] == [r.output_ids for r in plain.rows]
    assert result.counters["expert_page_ins"] > 0


def test_a_plain_device_budget_too_small_names_the_smallest_working_one(folders):
    model = folders("gpt-oss", "fp32")
    shape = (len(PROMPTS), CAPACITY)
    with pytest.raises(BudgetError, match="reserved for the KV cache and workspace") as err:
        Runner(model, "cpu_reference", device_budget=ExpertLayout.of(model).ring_bytes(2) + 1000, reserve_for=shape)
    smallest = int(re.search(r"smallest working budget is ([\d,]+) bytes", str(err.value)).group(1).replace(",", ""))
    with pytest.raises(BudgetError):
        Runner(model, "cpu_reference", device_budget=smallest - 1, reserve_for=shape)
    tokens, logits, _, _ = _run(model)
    paged_tokens, paged_logits, session, runner = _run(model, device_budget=smallest, reserve_for=shape)
    assert runner.expert_residency.plan.ring_slots == 2 and session.counters.expert_page_ins > 0
    _within(runner, smallest)
    assert np.array_equal(paged_tokens, tokens) and np.array_equal(paged_logits, logits)


def test_a_state_beyond_the_reservation_is_refused_naming_the_fix(folders):
    """At the smallest budget the experts keep the ring alone, so they have nothing to give back:
    a state larger than the Runner was made for is refused (naming reserve_for), and the Runner
    serves the state it was made for."""
    model = folders("gpt-oss", "fp32")
    with pytest.raises(BudgetError) as err:
        Runner(model, "cpu_reference", device_budget=1000, reserve_for=(1, 8))
    smallest = int(re.search(r"smallest working budget is ([\d,]+) bytes", str(err.value)).group(1).replace(",", ""))
    runner = Runner(model, "cpu_reference", device_budget=smallest, reserve_for=(1, 8))
    with pytest.raises(BudgetError, match=r"reserve_for=\(batch, capacity\)"):
        Session(runner, batch=len(PROMPTS), capacity=CAPACITY)
    assert runner.kv_device_bytes == 0 and runner.workspace_reserved == 0
    alone = decode(Session(model, "cpu_reference", batch=1, capacity=8), [PROMPTS[0][:4]], 4).tokens
    assert np.array_equal(decode(Session(runner, batch=1, capacity=8), [PROMPTS[0][:4]], 4).tokens, alone)
    _within(runner, smallest)


def test_serve_reserves_its_slots_before_the_experts_share(folders):
    """``lockstep serve`` (build_server) makes its Runner for --max-batch slots of --capacity
    positions: under a plain device budget the engine's slots open and decode its tokens."""
    pytest.importorskip("fastapi", reason="the serve extra")
    from core.serve.server import build_server

    model = folders("gpt-oss", "fp32")
    layout = ExpertLayout.of(model)
    _, _, _, full = _run(model)
    reserve = full.reservation(len(PROMPTS), CAPACITY)
    budget = full.weight_bytes - layout.total_bytes + (len(layout.counts) + 2) * max(layout.sizes.values()) + reserve
    engine = build_server(model, "cpu_reference", max_batch=len(PROMPTS), capacity=CAPACITY, served="moe",
                          device_budget=budget).load()
    try:
        assert engine.runner.expert_reserve == reserve and engine.runner.expert_residency is not None
        handle = engine.submit(PROMPTS[0], max_tokens=5)
        want = run(model, "cpu_reference", input_ids=[PROMPTS[0]], max_new_tokens=5).rows[0].output_ids
        assert [t for e in handle for t in e.token_ids] == want
        _within(engine.runner, budget)  # the slots reserve their workspace (Runner.open_state)
    finally:
        engine.shutdown()


def _metered(runner):
    """(the list ``runner``'s expert meter calls go to: "copy" for ``expert_meter_async``, "read"
    for ``expert_meter``, the read that waits on cuda; the unwrapped ``expert_meter``)."""
    calls: list = []
    meter, read = runner.expert_meter_async, runner.expert_meter
    runner.expert_meter_async = lambda: calls.append("copy") or meter()
    runner.expert_meter = lambda: calls.append("read") or read()
    return calls, read


def test_the_expert_counters_read_the_meter_once_a_request_and_equal_per_step_reads(folders):
    """A decode step never reads the expert meter (on cuda that read waits for the step, and
    run-ahead loses its overlap): a request copies it a fixed number of times however many steps
    it runs, and the counters then equal those of a run that read them after every step (what
    each step did before), per-step figures the decode total over the steps."""
    model = folders("gpt-oss", "fp32")
    layout = ExpertLayout.of(model)
    budget = (2 * len(layout.counts) + 2) * max(layout.sizes.values())

    def session():
        runner = Runner(model, "cpu_reference", expert_budget=budget)
        return Session(runner, batch=len(PROMPTS), capacity=CAPACITY), _metered(runner)[0]

    copies = []
    for steps in (STEPS, 3 * STEPS):
        lazy, calls = session()
        tokens = decode(lazy, PROMPTS, steps).tokens  # run ahead: no observer
        copies.append(len(calls))
        figures = {k: v for k, v in lazy.counters.to_dict().items() if k.startswith("expert_")}
        assert calls == ["copy"] * (copies[-1] + 1)  # reading the counters copies the meter once more
    assert copies[0] == copies[1] <= 3
    assert figures["expert_page_ins"] == lazy.runner.expert_residency.counters.page_ins > 0
    eager, _ = session()
    seen: list = []
    eager_tokens = decode(eager, PROMPTS, 3 * STEPS,
                          observer=lambda *_: seen.append((eager.counters.expert_page_ins,
                                                           eager.counters.expert_bytes_copied))).tokens
    c = eager.counters
    assert np.array_equal(eager_tokens, tokens)
    assert {k: v for k, v in c.to_dict().items() if k.startswith("expert_")} == figures
    steps_run, (prefill_pages, prefill_bytes) = c.decode_steps, seen[0]
    assert c.expert_page_ins_per_step == (c.expert_page_ins - prefill_pages) / steps_run
    assert c.expert_bytes_per_token == (c.expert_bytes_copied - prefill_bytes) / (steps_run * len(PROMPTS))


def test_kv_growth_past_the_reservation_moves_resident_experts_to_the_ring(folders):
    """A plain device budget sizes the experts around a KV cache of 16 positions; a growing
    cache then doubles twice (to 64): the experts give the KV's bytes back (resident experts
    moved to the ring, highest index first) instead of the dense weights streaming, every
    step stays within the budget, and the tokens and logits are bitwise the resident run's."""
    model = folders("gpt-oss", "fp32")
    layout = ExpertLayout.of(model)
    size = max(layout.sizes.values())
    full = Runner(model, "cpu_reference")
    dense = full.weight_bytes - layout.total_bytes
    reserve = full.reservation(len(PROMPTS), 16)
    budget = dense + (2 * len(layout.counts) + 2) * size + reserve  # the ring and two experts a layer
    want = Session(model, "cpu_reference", batch=len(PROMPTS), capacity=CAPACITY)
    logits: list = []
    tokens = decode(want, PROMPTS, 3 * STEPS, observer=lambda *_: logits.append(want.last_logits())).tokens
    runner = Runner(model, "cpu_reference", device_budget=budget, reserve_for=(len(PROMPTS), 16))
    assert all(r == {0, 1} for r in runner.expert_residency.plan.resident.values())
    # may grow to the model context: its workspace is the one the load's reservation sized
    # (Runner.reservation), so what grows past the reservation is the KV alone
    context = runner.model.config.context_length
    session = Session(runner, batch=len(PROMPTS), capacity=16, max_capacity=context, kv_policy="growing")
    used: list = []
    got: list = []

    def observe(*_):
        used.append(runner.weight_bytes + runner.residency.staging_bytes + runner.kv_device_bytes
                    + runner.workspace_reserved)
        got.append(session.last_logits())

    assert np.array_equal(decode(session, PROMPTS, 3 * STEPS, observer=observe).tokens, tokens)
    assert np.array_equal(np.stack(got), np.stack(logits))
    c = session.counters
    assert c.growth_events == 2 and session.state.kv.capacity == CAPACITY
    assert max(used) <= budget and runner.kv_device_bytes > reserve - runner.workspace_reserved
    resident = runner.expert_residency.plan.resident
    moved = 2 * len(layout.counts) - sum(len(r) for r in resident.values())
    assert moved >= 1 and all(r <= {0, 1} for r in resident.values())
    assert used[-1] + size > budget  # no more moved than needed: one expert back would not fit
    assert runner.residency.weight_bytes_streamed_per_step == 0  # the dense weights stay resident
    assert c.replans == runner.replans >= 1 and c.expert_page_ins > 0
    _within(runner, budget)
    # one byte past the budget moves exactly one more expert, and says so
    over = budget - used[-1] + 1
    assert runner.reserve_kv(over).startswith("expert plan changed")
    assert 2 * len(layout.counts) - sum(len(r) for r in runner.expert_residency.plan.resident.values()) == moved + 1
    _within(runner, budget)
    runner.reserve_kv(-over)
    assert np.array_equal(decode(session, PROMPTS, STEPS).tokens, tokens[:STEPS + 1])  # the session serves on


def test_the_engine_counts_its_own_expert_paging_without_reading_the_meter_per_step(folders):
    """``core.run`` (the engine) on a Runner that already served a Session: the engine's expert
    counters start at its slots (the Session's paging is not in them), the meter is copied a
    fixed number of times however many tokens the request decodes, and never read with a wait."""
    model = folders("gpt-oss", "fp32")
    layout = ExpertLayout.of(model)
    budget = (2 * len(layout.counts) + 2) * max(layout.sizes.values())
    copies = []
    for tokens in (STEPS, 3 * STEPS):
        runner = Runner(model, "cpu_reference", expert_budget=budget)
        decode(Session(runner, batch=1, capacity=CAPACITY), [PROMPTS[1]], STEPS)
        before = runner.expert_meter()
        calls, read = _metered(runner)
        result = run(runner, input_ids=[PROMPTS[0]], max_new_tokens=tokens)
        assert len(result.rows[0].output_ids) == tokens and "read" not in calls
        copies.append(len(calls))
        after = read()
        assert [result.counters[k] for k in ("expert_routed", "expert_hits", "expert_page_ins",
                                             "expert_bytes_copied")] == [b - a for a, b in zip(before, after)]
        assert result.counters["expert_page_ins"] > 0
    assert copies[0] == copies[1] <= 4

"""The expert-residency plan, ring and counters (core.runtime.experts) and the cpu_reference pager
(providers.cpu_reference.expert_pager) on a one-node QMoE model (docs/moe.md)."""

import numpy as np
import pytest

from core.runtime.experts import ExpertBudgetError, SlotRing, plan_experts
from providers.cpu_reference.expert_pager import ExpertResidency

NODES = {"l0": 8, "l1": 8}
SIZES = {"l0": 100, "l1": 100}


def test_uniform_plan_keeps_the_same_low_experts_of_every_layer():
    plan = plan_experts(NODES, SIZES, budget_bytes=6 * 100 + 50, ring_slots=2)
    assert plan.resident == {"l0": frozenset({0, 1}), "l1": frozenset({0, 1})}
    assert plan.resident_bytes == 400 and plan.ring_bytes == 200


def test_measured_frequencies_keep_the_hottest_experts_across_layers():
    freq = {"l0": [0, 0, 0, 9, 0, 0, 0, 1], "l1": [5, 0, 0, 0, 0, 4, 0, 0]}
    plan = plan_experts(NODES, SIZES, budget_bytes=5 * 100, ring_slots=1, frequencies=freq)
    # shares: l0/3 0.9, l1/0 0.56, l1/5 0.44, l0/7 0.1
    assert plan.resident == {"l0": frozenset({3, 7}), "l1": frozenset({0, 5})}


def test_no_budget_keeps_everything_resident_without_a_ring():
    plan = plan_experts(NODES, SIZES, None, ring_slots=2)
    assert all(r == frozenset(range(8)) for r in plan.resident.values()) and plan.ring_slots == 0


@pytest.mark.parametrize("budget,slots", [(150, 2), (1500, 0)])
def test_budgets_that_cannot_work_are_refused_before_any_run(budget, slots):
    with pytest.raises(ExpertBudgetError):
        plan_experts(NODES, SIZES, budget, slots)


def test_ring_evicts_first_in_first_out_but_never_a_pinned_slot():
    ring = SlotRing(2)
    assert ring.admit(("a", 1), set()) == 0 and ring.admit(("a", 2), set()) == 1
    assert ring.admit(("a", 3), {0}) == 1  # slot 0 is pinned: the next unpinned one goes
    assert ring.lookup(("a", 1)) == 0 and ring.lookup(("a", 2)) is None
    with pytest.raises(RuntimeError):
        ring.admit(("a", 4), {0, 1})


def _qmoe(one_node, rng, e=8, h=32, inter=32):
    codes = rng.integers(0, 256, (e, 2 * inter, h // 2), dtype=np.uint8)
    down = rng.integers(0, 256, (e, h, inter // 2), dtype=np.uint8)
    inputs = {"x": rng.standard_normal((5, h)).astype(np.float32),
              "router": rng.standard_normal((5, e)).astype(np.float32),
              "w1": codes, "s1": rng.uniform(0.01, 0.05, (e, 2 * inter, h // 16)).astype(np.float32),
              "b1": None, "w2": down, "s2": rng.uniform(0.01, 0.05, (e, h, inter // 16)).astype(np.float32)}
    model = one_node.model("QMoE", inputs, {"y": np.float32}, "com.microsoft", k=2, normalize_routing_weights=1,
                           activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.702, activation_beta=1.0,
                           swiglu_limit=7.0, expert_weight_bits=4, block_size=16)
    return model, inputs


def test_paged_qmoe_node_is_bitwise_the_resident_node_and_counts_its_page_ins(one_node, rng):
    from core.executor import Plan
    from providers.cpu_reference.provider import CpuReferenceProvider

    model, inputs = _qmoe(one_node, rng)
    (want,) = one_node.ref(model, inputs)
    provider = CpuReferenceProvider()
    node = model.graph.node[0].name or "QMoE_0"
    plan = plan_experts({node: 8}, {node: 1000}, budget_bytes=3000, ring_slots=2)
    residency = provider.expert_residency = ExpertResidency(plan)
    feeds = {k: v for k, v in inputs.items() if v is not None}
    graph_plan = Plan(model.graph, {}, provider)
    first = graph_plan.run(feeds)["y"]
    second = graph_plan.run(feeds)["y"]
    c = residency.counters
    assert plan.resident[node] == frozenset({0})
    assert np.array_equal(first, want) and np.array_equal(second, want)
    routed = len(np.unique(np.argsort(-inputs["router"], axis=1)[:, :2]))
    assert routed - 1 > plan.ring_slots  # more cold experts than slots: a run takes several waves
    assert c.page_ins > 0 and c.routed == 2 * routed and c.routed == c.hits + c.page_ins
    assert c.page_ins >= 2 * (routed - 1) - 2  # at most the 2 ring slots survive into the second run
    assert c.page_in_bytes == 1000 * c.page_ins and c.bytes_per_token == c.page_in_bytes / 10
    assert c.frequencies()[node].sum() == pytest.approx(1.0)


def test_shrink_moves_the_last_admitted_experts_to_the_ring_until_the_bytes_are_given_back():
    from core.runtime.experts import check_shrunk, shrink

    plan = plan_experts(NODES, SIZES, budget_bytes=6 * 100, ring_slots=2)  # 0, 1 of each layer
    smaller = shrink(plan, 150)  # two experts: 1 of l1, then 1 of l0
    assert smaller.resident == {"l0": frozenset({0}), "l1": frozenset({0})} and smaller.ring_slots == 2
    assert shrink(plan, 10_000).resident == {"l0": frozenset(), "l1": frozenset()}
    assert shrink(plan, 0) == plan
    check_shrunk(plan, smaller)
    with pytest.raises(ValueError, match="only move resident experts"):
        check_shrunk(smaller, plan)  # growing back is no shrink
    everything = plan_experts(NODES, SIZES, None, ring_slots=2)
    assert shrink(everything, 100) is everything  # no ring to page into


def test_the_cpu_pager_replanned_to_fewer_resident_experts_gives_the_same_bits(one_node, rng):
    from core.executor import Plan
    from core.runtime.experts import shrink
    from providers.cpu_reference.provider import CpuReferenceProvider

    model, inputs = _qmoe(one_node, rng)
    (want,) = one_node.ref(model, inputs)
    provider = CpuReferenceProvider()
    node = model.graph.node[0].name or "QMoE_0"
    plan = plan_experts({node: 8}, {node: 1000}, budget_bytes=6000, ring_slots=2)
    residency = provider.expert_residency = ExpertResidency(plan)
    feeds = {k: v for k, v in inputs.items() if v is not None}
    graph_plan = Plan(model.graph, {}, provider)
    assert np.array_equal(graph_plan.run(feeds)["y"], want)
    before = residency.counters.page_ins
    residency.replan(shrink(plan, 4000))
    assert residency.plan.resident[node] == frozenset()
    assert np.array_equal(graph_plan.run(feeds)["y"], want)
    routed = set(np.unique(np.argsort(-inputs["router"], axis=1)[:, :2]).tolist())
    assert len(routed & {0, 1, 2, 3}) > 2  # more experts that were resident than the ring holds
    assert residency.counters.page_ins - before >= len(routed) - 2  # only the ring's two can still hit
    with pytest.raises(ValueError):
        residency.replan(plan)

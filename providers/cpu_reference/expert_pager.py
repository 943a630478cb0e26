"""Expert residency on cpu_reference: the plan of core.runtime.experts carried out (docs/moe.md).

The host copy of every expert is the bank (the node's cached fp32 experts). A resident expert
is read from the bank in place; any other expert is read only from a slot of the ring, after a
page-in copied it there, so a run under a budget computes from copies: bitwise the resident run
when the copies are right, wrong (or a KeyError) when the bookkeeping is. A page-in counts the
expert's stored bytes (what a device copy would move), not its fp32 size here.

Turn it on for a session with :func:`use_expert_residency`; ``provider.expert_residency = None``
turns it off.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from core.provider import ReadyDownload
from core.runtime.experts import ExpertCounters, ExpertPlan, SlotRing, check_shrunk, moe_layout, plan_experts
from providers.cpu_reference.ops._moe import Expert, Experts, Routing


class ExpertResidency:
    """The plan, the ring's slots (one fp32 copy of an expert each) and the counters.

    Attributes:
        plan: the static plan (resident experts per node, ring size).
        ring: slot bookkeeping (which (node, expert) each slot holds).
        counters: routed / hits / page-ins / bytes, cumulative over every MoE node call.
    """

    def __init__(self, plan: ExpertPlan):
        self.plan = plan
        self.ring = SlotRing(plan.ring_slots)
        self.counters = ExpertCounters(moe_nodes=len(plan.num_experts))
        self._slots: list[Expert | None] = [None] * plan.ring_slots

    def replan(self, plan: ExpertPlan) -> None:
        """Run under ``plan`` from the next call on: the current plan with fewer resident
        experts (core.runtime.experts.shrink); the ones moved are paged from the bank like any
        cold expert, so the results do not change.

        Raises:
            ValueError: ``plan`` is not the current one with fewer resident experts.
        """
        check_shrunk(self.plan, plan)
        self.plan = plan

    def meter_async(self) -> ReadyDownload:
        """(routed, hits, page-ins, page-in bytes) so far, as a finished handle (``wait()``):
        the host counters are current."""
        c = self.counters
        return ReadyDownload(np.array([c.routed, c.hits, c.page_ins, c.page_in_bytes], np.int64))

    def _page_in(self, slot: int, source: Expert) -> Expert:
        """Copy ``source`` into ``slot`` (reusing its arrays when the shapes match)."""
        names = ("fc1", "fc2", "fc3", "b1", "b2", "b3")
        src: list[np.ndarray | None] = [getattr(source, n) for n in names]
        held = self._slots[slot]
        dst: list[np.ndarray | None] = [None] * len(names) if held is None else [getattr(held, n) for n in names]
        if any(s is None or d is None or d.shape != s.shape for s, d in zip(src, dst)
               if s is not None or d is not None):
            dst = [None if s is None else np.empty_like(s) for s in src]
        for s, d in zip(src, dst):
            if s is not None and d is not None:
                np.copyto(d, s)
        fc1, fc2 = dst[0], dst[1]
        if fc1 is None or fc2 is None:
            raise ValueError(f"expert slot {slot}: fc1 and fc2 are required")
        held = Expert(fc1, fc2, *dst[2:])
        self._slots[slot] = held
        return held

    def waves(self, node: str, experts: Experts, routing: Routing) -> Iterator[list[tuple[int, Expert]]]:
        """The routed experts of MoE node ``node`` in ascending index order, each read from the
        bank (resident) or a ring slot; split into waves that each hold at most ``ring_slots``
        slots, the next wave's page-ins reusing the slots of the last.

        Raises:
            KeyError: ``node`` is not in the plan.
        """
        resident = self.plan.resident[node]
        chosen = [int(e) for e in np.unique(routing.experts)]
        c = self.counters
        c.routed += len(chosen)
        c.token_rows += routing.experts.shape[0]
        counts = np.bincount(routing.experts.reshape(-1), minlength=self.plan.num_experts[node])
        c.routed_counts[node] = c.routed_counts.get(node, 0) + counts
        wave: list[tuple[int, Expert]] = []
        pinned: set[int] = set()
        for e in chosen:
            if e in resident:
                wave.append((e, experts.expert(e)))
                c.hits += 1
                continue
            slot = self.ring.lookup((node, e))
            held = None if slot is None else self._slots[slot]
            if slot is not None and held is not None:  # still in the ring from an earlier call
                c.hits += 1
                pinned.add(slot)
                wave.append((e, held))
                continue
            if len(pinned) == self.ring.slots:  # the ring is full of this wave: run it first
                yield wave
                wave, pinned = [], set()
            slot = self.ring.admit((node, e), pinned)
            pinned.add(slot)
            wave.append((e, self._page_in(slot, experts.expert(e))))
            c.page_ins += 1
            c.page_in_bytes += self.plan.expert_bytes[node]
        yield wave


def use_expert_residency(session, budget_bytes: int | None, ring_slots: int = 2,
                         frequencies: Mapping[str, Sequence[float]] | None = None) -> Any:
    """Plan the experts of ``session``'s model under ``budget_bytes`` (core.runtime.experts.plan_experts)
    and run its MoE / QMoE nodes under that plan from the next call on; returns the residency
    (its ``counters``). The budget covers the resident experts and the ring, not other weights
    (for one budget with them: the Runner's ``expert_budget``, ``weight_budget`` or
    ``device_budget``). A cuda session goes to providers.cuda.expert_pager (the same arguments
    and counters; call it before the session's first run).

    Raises:
        ValueError: the session's provider is neither cpu_reference nor cuda, the model has no
            MoE node, or its Runner pages its experts already.
        core.runtime.experts.ExpertBudgetError: the budget cannot hold the ring, or leaves
            experts with no slot.
    """
    runner = session.runner
    if getattr(runner, "expert_residency", None) is not None:
        raise ValueError("the session's Runner pages its experts already (an expert, weight or device budget)")
    if runner.provider.name == "cuda":
        from providers.cuda.expert_pager import use_expert_residency as on_cuda

        return on_cuda(session, budget_bytes, ring_slots, frequencies)
    model = runner.model
    counts, sizes = moe_layout(model.graph, model.initializers)
    if not counts:
        raise ValueError("the model has no MoE / QMoE node")
    residency = page_runner(runner, plan_experts(counts, sizes, budget_bytes, ring_slots, frequencies))
    runner.expert_residency = residency
    return residency


def page_runner(runner, plan: ExpertPlan) -> Any:
    """Run ``runner``'s MoE / QMoE nodes under the expert ``plan`` from its next call on, on
    cpu_reference or cuda (providers.cuda.expert_pager.page_runner); returns the pager.

    Raises:
        ValueError: a provider other than cpu_reference and cuda.
    """
    provider = runner.provider
    if provider.name == "cuda":
        from providers.cuda.expert_pager import page_runner as on_cuda

        return on_cuda(runner, plan)
    if provider.name != "cpu_reference":
        raise ValueError(f"expert residency runs on cpu_reference and cuda, not {provider.name!r}")
    residency = ExpertResidency(plan)
    provider.expert_residency = residency
    return residency

"""Expert residency of mixture-of-experts models: a static plan, a ring of expert slots, counters.

Under a budget, the experts of every ``MoE`` / ``QMoE`` node are pages of their own (docs/moe.md,
"Expert residency"). :func:`plan_experts` keeps the most-used experts resident (measured routing
frequencies, or uniform when none: then the lower expert indices of each layer first) and sets
aside a ring of ``ring_slots`` expert slots, shared by all layers, for the rest. A step copies in
only the experts its rows routed to that are neither resident nor still in the ring
(:class:`SlotRing`, first in first out, never evicting a slot the current wave uses), and
:class:`ExpertCounters` counts what was routed and copied.

Provider-agnostic bookkeeping (NumPy only); the cpu_reference pager
(providers.cpu_reference.expert_pager) moves the weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np


class ExpertBudgetError(ValueError):
    """The budget cannot hold the ring of expert slots, or leaves experts with no slot to page into."""


@attrs.frozen
class ExpertPlan:
    """Which experts stay resident, and the ring the others are paged into.

    Attributes:
        resident: MoE node name -> the expert indices resident on the device.
        num_experts: MoE node name -> its number of experts.
        expert_bytes: MoE node name -> bytes of one expert as stored (weights, scales, biases):
            what a page-in copies host to device.
        ring_slots: expert slots of the ring shared by every layer (0: everything is resident).
    """

    resident: Mapping[str, frozenset[int]]
    num_experts: Mapping[str, int]
    expert_bytes: Mapping[str, int]
    ring_slots: int

    @property
    def resident_bytes(self) -> int:
        """Bytes of the resident experts."""
        return sum(len(r) * self.expert_bytes[n] for n, r in self.resident.items())

    @property
    def ring_bytes(self) -> int:
        """Bytes of the ring (its slots sized for the largest expert)."""
        return self.ring_slots * max(self.expert_bytes.values(), default=0)


def plan_experts(num_experts: Mapping[str, int], expert_bytes: Mapping[str, int], budget_bytes: int | None,
                 ring_slots: int, frequencies: Mapping[str, Sequence[float]] | None = None) -> ExpertPlan:
    """The static plan: under ``budget_bytes`` (None: unlimited, all resident, no ring), the ring
    of ``ring_slots`` slots first, then experts by descending routing frequency (``frequencies``:
    node -> per-expert counts or shares; uniform when None), ties by expert index then node order (so a
    uniform plan keeps experts 0, 1, ... of every layer alike).

    Raises:
        ExpertBudgetError: the budget is below the ring's bytes, or some expert is not resident
            while ``ring_slots`` is 0.
        ValueError: a frequency vector of the wrong length, or ring_slots < 0.
    """
    if ring_slots < 0:
        raise ValueError(f"ring_slots={ring_slots} must be >= 0")
    if budget_bytes is None:
        return ExpertPlan({n: frozenset(range(e)) for n, e in num_experts.items()}, dict(num_experts),
                          dict(expert_bytes), 0)
    ring = ring_slots * max(expert_bytes.values(), default=0)
    if budget_bytes < ring:
        raise ExpertBudgetError(f"an expert budget of {budget_bytes} bytes cannot hold a ring of {ring_slots} "
                                f"slots ({ring} bytes)")
    scored = []
    for order, (node, count) in enumerate(num_experts.items()):
        freq = np.full(count, 1.0 / count) if frequencies is None else np.asarray(frequencies[node], np.float64)
        if freq.shape != (count,):
            raise ValueError(f"frequencies of {node!r} have shape {freq.shape}, expected ({count},)")
        share = freq / freq.sum() if freq.sum() > 0 else np.full(count, 1.0 / count)
        scored += [(-float(share[e]), e, order, node) for e in range(count)]
    left = budget_bytes - ring
    resident: dict[str, set[int]] = {n: set() for n in num_experts}
    for _, e, _, node in sorted(scored):
        if expert_bytes[node] <= left:
            resident[node].add(e)
            left -= expert_bytes[node]
    if ring_slots == 0 and any(len(resident[n]) < c for n, c in num_experts.items()):
        raise ExpertBudgetError(f"an expert budget of {budget_bytes} bytes leaves experts non-resident "
                                "and ring_slots=0 gives them no slot")
    return ExpertPlan({n: frozenset(r) for n, r in resident.items()}, dict(num_experts), dict(expert_bytes),
                      ring_slots)


def shrink(plan: ExpertPlan, nbytes: int) -> ExpertPlan:
    """``plan`` with resident experts moved to the ring until at least ``nbytes`` are given
    back, or none is left resident (the ring stays): the highest expert index first, the later
    node first among equals (the reverse of :func:`plan_experts`' uniform order, so a uniform
    plan stays one). The moved experts are paged like any cold one: the results do not change.
    A plan without a ring (everything resident) is returned as it is.
    """
    if plan.ring_slots == 0:
        return plan
    order = sorted(((e, i, node) for i, (node, r) in enumerate(plan.resident.items()) for e in r), reverse=True)
    resident = {n: set(r) for n, r in plan.resident.items()}
    freed = 0
    for e, _, node in order:
        if freed >= nbytes:
            break
        resident[node].discard(e)
        freed += plan.expert_bytes[node]
    return attrs.evolve(plan, resident={n: frozenset(r) for n, r in resident.items()})


def check_shrunk(old: ExpertPlan, new: ExpertPlan) -> None:
    """Refuse a re-plan that is not ``old`` with fewer resident experts (the pagers' ``replan``).

    Raises:
        ValueError: other nodes, another ring, or an expert resident in ``new`` only.
    """
    if (new.num_experts != old.num_experts or new.ring_slots != old.ring_slots or new.ring_slots == 0
            or any(not new.resident[n] <= old.resident[n] for n in old.resident)):
        raise ValueError("an expert re-plan may only move resident experts to the ring")


class SlotRing:
    """The ring of expert slots: which (node, expert) each slot holds, filled first in first out.

    A wave pins the slots it uses; :meth:`admit` never evicts a pinned slot, so a wave holds at
    most ``slots`` cold experts (the pager splits larger sets into several waves).
    """

    def __init__(self, slots: int):
        self.slots = slots
        self.holds: list[tuple[str, int] | None] = [None] * slots
        self._next = 0

    def lookup(self, key: tuple[str, int]) -> int | None:
        """The slot holding ``key`` (node, expert), or None."""
        try:
            return self.holds.index(key)
        except ValueError:
            return None

    def admit(self, key: tuple[str, int], pinned: set[int]) -> int:
        """A slot for ``key`` (node, expert), evicting the oldest unpinned one.

        Raises:
            RuntimeError: every slot is pinned (a wave larger than the ring).
        """
        for _ in range(self.slots):
            slot = self._next
            self._next = (self._next + 1) % self.slots
            if slot not in pinned:
                self.holds[slot] = key
                return slot
        raise RuntimeError(f"all {self.slots} expert slots are pinned by the current wave")


@attrs.define
class ExpertCounters:
    """Cumulative expert-residency counters of a session (every MoE node, every step).

    Attributes:
        routed: distinct (node, expert) pairs routed, summed over the node calls.
        hits: those found resident or still in the ring.
        page_ins: experts copied into a ring slot.
        page_in_bytes: bytes those copies moved (the experts' stored bytes).
        token_rows: token rows seen by the MoE nodes, summed over the node calls.
        moe_nodes: the number of MoE nodes (token_rows / moe_nodes is the tokens processed).
        routed_counts: node -> per-expert count of (token, expert) routes (calibration).
    """

    routed: int = 0
    hits: int = 0
    page_ins: int = 0
    page_in_bytes: int = 0
    token_rows: int = 0
    moe_nodes: int = 0
    routed_counts: dict[str, np.ndarray] = attrs.field(factory=dict)

    @property
    def hit_rate(self) -> float:
        """hits / routed (1.0 before anything was routed)."""
        return self.hits / self.routed if self.routed else 1.0

    @property
    def bytes_per_token(self) -> float:
        """Page-in bytes per token processed (0.0 before any token)."""
        tokens = self.token_rows / max(self.moe_nodes, 1)
        return self.page_in_bytes / tokens if tokens else 0.0

    def frequencies(self) -> dict[str, np.ndarray]:
        """node -> the share of routes each expert took (for :func:`plan_experts`)."""
        return {n: c / c.sum() if c.sum() else c for n, c in self.routed_counts.items()}


#: Ops whose experts the plan pages.
MOE_OPS = ("MoE", "QMoE")


def moe_layout(graph, initializers: Mapping[str, np.ndarray]) -> tuple[dict[str, int], dict[str, int]]:
    """(node name -> number of experts, node name -> stored bytes of one expert) of the MoE and
    QMoE nodes of ``graph`` (an onnx GraphProto), in graph order; an expert's bytes are its share
    of every per-expert initializer the node reads (weights, scales, biases, zero points).

    Raises:
        ValueError: a node's expert weights are not an initializer.
    """
    from core.executor import node_infos

    counts, sizes = {}, {}
    for node in node_infos(graph):
        if node.domain != "com.microsoft" or node.op_type not in MOE_OPS:
            continue
        fc1 = initializers.get(node.inputs[2])
        if fc1 is None:
            raise ValueError(f"{node.name}: expert weights {node.inputs[2]!r} are not an initializer")
        e = int(fc1.shape[0])
        per_expert = [initializers[x] for x in node.inputs[2:14] if x and x in initializers]
        counts[node.name] = e
        sizes[node.name] = sum(int(a.nbytes) // e for a in per_expert if a.ndim >= 1 and a.shape[0] == e)
    return counts, sizes

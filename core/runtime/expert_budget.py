"""One budget for a mixture-of-experts model's dense weights and its experts (docs/moe.md,
"Expert budgets").

Under an expert budget, or a weight or device budget on a model with MoE / QMoE nodes, the
Runner pages the experts (core.runtime.experts: a static plan of resident experts and a ring of
expert slots) and plans the other weights with the normal residency plan
(core.runtime.residency); both draw on one budget. Experts are what streams first: the dense
weights stay resident while the budget holds them beside the ring, and only a budget below that
streams dense weights too (the experts then keep the ring alone).

:class:`ExpertPlacer` is the load's placer for such a model: the experts' constants are never
uploaded (their prepare hooks run on the host arrays, and they stay host arrays in the kernels'
layout, from which the provider's pager builds its pages); every other constant goes where the
dense placer (core.runtime.placement.BudgetPlacer) or, with none, a plain upload puts it.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from core.opdefs import is_host
from core.runtime import forecast, residency, rowblocks
from core.runtime.experts import ExpertBudgetError, moe_layout


@attrs.frozen
class ExpertLayout:
    """The MoE nodes of a model: node -> experts, node -> stored bytes of one expert."""

    counts: dict[str, int]
    sizes: dict[str, int]

    @classmethod
    def of(cls, model) -> ExpertLayout:
        """The layout of ``model``'s MoE / QMoE nodes (empty without any)."""
        counts, sizes = moe_layout(model.graph, model.initializers)
        return cls(counts, sizes)

    @property
    def total_bytes(self) -> int:
        """Stored bytes of every expert."""
        return sum(self.counts[n] * self.sizes[n] for n in self.counts)

    def ring_bytes(self, slots: int) -> int:
        """Bytes of a ring of ``slots`` slots of the largest expert."""
        return slots * max(self.sizes.values(), default=0)


def is_expert(weight: residency.Weight, nodes) -> bool:
    """Whether ``weight`` is an expert tensor (its first reader is one of the MoE ``nodes``)."""
    return (weight.node or weight.page) in nodes


def split(budget: int | None, expert_budget: int | None, dense_bytes: int, layout: ExpertLayout,
          slots: int) -> tuple[int | None, int | None]:
    """(dense weight budget, expert budget) of one ``budget`` (bytes; None: no weight or device
    budget) and an explicit ``expert_budget`` (bytes or None). ``dense_bytes``: the dense
    weights' bytes (all resident).

    Without an explicit expert budget the experts stream first: they get what the resident dense
    weights leave, and at least the ring; with one, the dense weights get the rest. A dense
    budget too small for the dense weights' smallest plan is refused by the load
    (:meth:`ExpertPlacer.start`, naming the smallest working budget).

    Raises:
        core.runtime.experts.ExpertBudgetError: ``expert_budget`` below the ring, or above
            ``budget``; the message names the smallest expert budget.
    """
    ring = layout.ring_bytes(slots)
    if expert_budget is not None and expert_budget < ring:
        raise ExpertBudgetError(f"an expert budget of {residency._bytes(expert_budget)} cannot hold a ring of "
                                f"{slots} expert slots; the smallest expert budget is {residency._bytes(ring)}")
    if budget is None:
        return None, expert_budget
    if expert_budget is not None and expert_budget >= budget:
        raise ExpertBudgetError(f"an expert budget of {residency._bytes(expert_budget)} leaves nothing of the "
                                f"budget of {residency._bytes(budget)} for the other weights")
    experts = ring if expert_budget is None else expert_budget
    if budget >= dense_bytes + experts:
        return None, budget - dense_bytes if expert_budget is None else expert_budget
    return max(budget - experts, 1), experts


def refusal(budget: int | None, dense: int, experts: int, reserved: int = 0) -> residency.BudgetError:
    """The error of a ``budget`` that cannot hold the dense weights' smallest plan (``dense``
    bytes) beside the experts' ``experts`` bytes and the ``reserved`` bytes a plain device
    budget sets aside for the decode states' KV and workspace: it names the smallest working
    budget."""
    b = residency._bytes
    room = f" and the {b(reserved)} reserved for the KV cache and workspace" if reserved else ""
    return residency.BudgetError(
        f"a budget of {b(budget or 0)} cannot hold the dense weights' smallest plan ({b(dense)}) beside the experts' "
        f"{b(experts)} (resident experts and ring){room}; the smallest working budget is "
        f"{b(dense + experts + reserved)}")


class ExpertPlacer:
    """The load's placer of a model whose experts are paged (module docstring).

    Args:
        nodes: the MoE node names.
        inner: the dense weights' placer (core.runtime.placement.BudgetPlacer, planning without
            the experts) or None.
        expert_bytes: the experts' share (resident experts and ring).
        reserved: bytes a plain device budget sets aside for the decode states (named in a
            refusal's smallest working budget).
        budget: the budget a refusal names (default: the dense budget plus the experts' share).
    """

    def __init__(self, nodes, inner=None, expert_bytes: int = 0, reserved: int = 0, budget: int | None = None):
        self.nodes, self.inner, self.expert_bytes, self.reserved = frozenset(nodes), inner, expert_bytes, reserved
        self.budget = budget
        #: constant name -> its host array (the experts, in the kernels' layout)
        self.experts: dict[str, Any] = {}

    def start(self, plan) -> None:
        """Start the dense placer.

        Raises:
            core.runtime.residency.BudgetError: the dense budget cannot hold the dense weights'
                smallest plan; names the smallest working budget (that plan plus the experts').
        """
        inner = self.inner
        if inner is None:
            return
        try:
            inner.start(plan)
        except residency.BudgetError:
            view = forecast.Forecast(plan)
            weights = tuple(w for w in residency.weights_of(view) if not is_expert(w, self.nodes))
            unread = view.unread_bytes()
            weights = (*weights, residency.unread_weight(unread)) if unread else weights
            need = residency.smallest_budget(weights, inner.slots, inner.mappable, rowblocks.plan_splits(view),
                                             inner.page_bytes)
            budget = inner.budget + self.expert_bytes if self.budget is None else self.budget
            raise refusal(budget, need, self.expert_bytes, self.reserved) from None

    def prepare_on_device(self, plan, node) -> bool:
        if node.name in self.nodes:
            return False  # the expert hook runs on the host arrays: the device never sees them
        return True if self.inner is None else self.inner.prepare_on_device(plan, node)

    def place(self, plan, name: str, value: Any, node: str, source: str) -> Any:
        if node in self.nodes and not is_host_small(value):
            host = value if isinstance(value, np.ndarray) else plan.provider.download(value)
            self.experts[name] = host
            return host
        if self.inner is not None:
            return self.inner.place(plan, name, value, node, source)
        on_host = name in plan._pending or (plan.host_dispatch and is_host(value))
        return plan.provider.upload(value) if on_host else value


def is_host_small(value: Any) -> bool:
    """A scalar or empty constant (an attribute-like input of a MoE node, not an expert tensor)."""
    shape = getattr(value, "shape", ())
    return len(shape) == 0 or int(np.prod(shape)) == 0


def page(runner, layout: ExpertLayout, budget: int | None, slots: int):
    """Plan ``runner``'s experts under ``budget`` bytes (uniform frequencies: experts 0, 1, ... of
    every layer resident) and hand them to its provider's pager; returns the pager (its ``plan``
    and ``counters``).

    Raises:
        core.runtime.experts.ExpertBudgetError: the budget cannot hold the ring.
        ValueError: a provider without an expert pager (cpu_reference and cuda have one).
    """
    from core.runtime.experts import plan_experts
    from providers.cpu_reference.expert_pager import page_runner

    return page_runner(runner, plan_experts(layout.counts, layout.sizes, budget, slots))

"""Loading under a budget: each weight goes to the device or to pinned host memory as the plan
prepares it, so the device never holds the whole model.

The :class:`~core.executor.Plan` calls a placer (:class:`BudgetPlacer`) at three points of its
load (:mod:`core.executor.weights`, "Placement"):

- ``start(plan)`` once the graph is fused and folded, before any weight is prepared: the placer
  plans residency with the same planner the Runner uses afterwards
  (:func:`core.runtime.residency.plan_residency`), over the weights the load will have: the
  prepared forms the provider declares, forecast from the initializers' shapes
  (:mod:`core.runtime.forecast`; memory maps: nothing is read), and the constants no step
  reads, resident as the Runner counts them. So it knows which pages (nodes) will stream and
  which tables will be mapped, and the smallest working budget it names is the loaded plan's;
- ``prepare_on_device(plan, node)`` before a node's prepare hook: True when the node's raw
  weights, their prepared form and one transient of the hook fit beside what is resident
  (:data:`SCRATCH` times the raw bytes); else the hook runs on the host arrays (NumPy), and
  the device sees only the result it keeps;
- ``place(plan, name, value, node, source)`` when a constant is final: resident (uploaded once,
  in the kernels' layout), staged (one pinned host copy, in the kernels' layout, that the
  staging ring streams from every step) or mapped (a gathered table read in place from pinned
  host memory).

The placer keeps a ledger of the device bytes it lets the load hold (resident weights plus the
scratch of the node being prepared): ``peak_bytes`` is its high-water mark, at most the budget
less the staging ring the Runner allocates afterwards (which the scratch may use while no ring
exists). A weight the prediction keeps resident but that would overflow the ledger (a prepared
form larger than its raw bytes) is staged instead; the Runner's plan from the real sizes then
moves the few weights it decides otherwise (:func:`core.runtime.streaming.apply`, newly
streamed ones first, so the device only shrinks before it grows).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.opdefs import is_host
from core.runtime import forecast, residency, rowblocks

#: Device bytes a prepare hook may hold per raw byte of its node's weights: the raw upload,
#: the prepared form and one transient copy (a transpose of the padded weight).
SCRATCH = 3


class BudgetPlacer:
    """The load-time placement for a weight budget (module docstring).

    Args:
        budget: device bytes for the weights and the staging ring.
        slots: staging slots (None: the planner's default).
        mappable: gathered tables may be mapped from pinned host memory.
        page_bytes: the page size of row blocks (:mod:`core.runtime.rowblocks`; None: default).
        exclude_nodes: nodes whose weights this placer does not plan (a MoE model's paged
            experts: core.runtime.expert_budget).

    Attributes:
        predicted: the residency plan from the raw sizes (set by :meth:`start`).
        decisions: constant name -> "resident", "staged" or "mapped", in placement order.
        resident_bytes: device bytes of the weights placed resident so far (and the values
            folded before the load's placement started).
        peak_bytes: the ledger's high-water mark (resident bytes plus a prepare's scratch).
        host_prepared: nodes whose prepare hook ran on the host arrays.
    """

    def __init__(self, budget: int, slots: int | None = None, mappable: bool = False, page_bytes: int | None = None,
                 exclude_nodes: frozenset[str] = frozenset()):
        self.budget, self.slots, self.mappable, self.page_bytes = int(budget), slots, mappable, page_bytes
        self.exclude_nodes = exclude_nodes
        self.predicted: residency.ResidencyPlan | None = None
        self.decisions: dict[str, str] = {}
        self.resident_bytes = self.peak_bytes = 0
        self.host_prepared: list[str] = []
        self._streamed_pages: set[str] = set()
        self._mapped: set[str] = set()
        self._pinned: set[str] = set()
        self._preloaded: set[str] = set()

    def start(self, plan) -> None:
        """Plan residency from the initializers' sizes (nothing read from them).

        Raises:
            core.runtime.residency.BudgetError: the budget cannot hold what must stay resident
                plus a staging ring (the message names the smallest working budget).
        """
        view = forecast.Forecast(plan)  # the prepared forms' names and sizes, from their shapes
        weights = tuple(w for w in residency.weights_of(view) if (w.node or w.page) not in self.exclude_nodes)
        unread = view.unread_bytes()  # resident whatever the plan, as the Runner counts them
        weights = (*weights, residency.unread_weight(unread)) if unread else weights
        splits = rowblocks.plan_splits(view)
        self.predicted = p = residency.plan_residency(weights, self.budget, self.slots, self.mappable, splits,
                                                      self.page_bytes)
        streamed = set(p.streamed)
        self._streamed_pages = {w.node or w.page for w in p.weights if w.name in streamed}
        self._mapped = set(p.mapped)
        self._pinned = {x for w in weights if residency._pinned(w) for x in (w.name, *w.aliases)} - self._mapped
        self._preloaded = {name for name in plan.constants if name not in plan._pending}
        self.resident_bytes = plan.weight_bytes(exclude=plan._pending)
        self.peak_bytes = self.resident_bytes

    @property
    def room(self) -> int:
        """Device bytes the load may keep resident: the budget less the staging ring to come."""
        assert self.predicted is not None, "start() first"
        return self.budget - self.predicted.staging_bytes

    def prepare_on_device(self, plan, node) -> bool:
        """Whether ``node``'s prepare hook runs on the device (module docstring); the ledger
        counts its scratch when it does."""
        raw = sum(int(plan.constants[x].nbytes) for x in set(node.inputs) if x in plan._pending)
        if self.resident_bytes + SCRATCH * raw > self.budget:
            self.host_prepared.append(node.name)
            return False
        plan.provider.reset_peak()  # blocks freed by earlier placements go back before this one
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes + SCRATCH * raw)
        return True

    def place(self, plan, name: str, value: Any, node: str, source: str) -> Any:
        """Where constant ``name`` (first read by ``node``, made from initializer ``source``)
        goes (``node`` "": no step reads it, so it stays resident); returns what the plan's
        constant becomes (a device tensor, the staged host copy, or a device view of it)."""
        provider = plan.provider
        nbytes = int(value.nbytes)
        # an initializer not placed yet, or a host-prepared form on a device provider
        on_host = name in plan._pending or (plan.host_dispatch and is_host(value))
        # the table, or its prepared form (named as the forecast named it, or by its source)
        if (name in self._mapped or source in self._mapped) and nbytes >= residency.SMALL_BYTES:
            kind = "mapped"
        elif nbytes < residency.SMALL_BYTES or source in self._pinned or name in self._pinned or not node:
            kind = "resident"
        elif node in self._streamed_pages or self.resident_bytes + nbytes > self.room:
            kind = "staged"
        else:
            kind = "resident"
        self.decisions[name] = kind
        counted = name in self._preloaded and not on_host  # folded before start(): in the ledger already
        if kind == "resident":
            self.resident_bytes += 0 if counted else nbytes
            self.peak_bytes = max(self.peak_bytes, self.resident_bytes)
            return provider.upload(value) if on_host else value
        self.resident_bytes -= nbytes if counted else 0
        host = np.asarray(value) if on_host else provider.download(value)
        staged = plan.staged_weights[name] = provider.stage(host)
        del host, value
        if not on_host:
            provider.reset_peak()  # the device copy is gone: give its block back now
        return provider.map_host(staged) if kind == "mapped" else staged

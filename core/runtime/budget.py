"""The device budget's accounting of a :class:`~core.runtime.runner.Runner` (a mixin): what the
budget counts (weights with the paged experts, staging, KV, reserved workspace), what gives way
when a decode state's KV or workspace grows past it (resident experts first, then the dense
weights' residency plan), and the refusals that name the budget that works."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.runtime import residency
from core.runtime.experts import shrink


class DeviceBudget:
    """The budget methods of :class:`~core.runtime.runner.Runner`; the attributes they read
    (``device_budget``, ``kv_device_bytes``, ``workspace_reserved``, ``residency``,
    ``expert_residency``, ``expert_reserve``, ``replans``, ``lock``) are the Runner's."""

    device_budget: int | None
    kv_device_bytes: int
    workspace_reserved: int
    residency: Any
    expert_residency: Any
    expert_reserve: int
    replans: int
    lock: Any

    if TYPE_CHECKING:  # the Runner's, read here
        @property
        def weight_bytes(self) -> int: ...

        @property
        def expert_device_bytes(self) -> int: ...

        def _plan_residency(self, budget: int | None) -> Any: ...

        def _smallest_weight_budget(self) -> int: ...

    def _budget_error(self, exc: residency.BudgetError, weight_budget, paged: bool) -> residency.BudgetError:
        """A load's refusal under a device budget: the weight minimum named as such, with how to
        find the device budget per batch (a paged MoE refusal already names a device budget)."""
        if self.device_budget is None or weight_budget is not None:
            return exc
        head = f"a device budget of {residency._bytes(self.device_budget)} leaves too little for the weights: "
        if paged:
            return residency.BudgetError(head + str(exc))
        why = str(exc).replace("the smallest working budget is", "the smallest working weight budget is")
        return residency.BudgetError(head + f"{why}; a device budget holds that plus the KV cache and the workspace "
                                     "of the batch and context you run (`lockstep plan MODEL --device-budget SIZE "
                                     "--batch N` gives the smallest per batch)")

    def reserve_kv(self, extra: int) -> str | None:
        """Account ``extra`` more KV bytes (a decode state allocating or committing); under a
        device budget, shrink the weight budget first when they would not fit (elastic budget:
        on a MoE model under a plain device budget, resident experts move to the ring first).

        Returns:
            None, or the reason the weight plan changed (its graphs are then invalid).

        Raises:
            core.runtime.residency.BudgetError: weights, KV and the reserved workspace cannot
                share the device budget even with the most weights streamed.
        """
        with self.lock:
            return self._reserve(extra, 0)

    def _reserve(self, kv: int, work: int) -> str | None:
        """Account ``kv`` more KV bytes and ``work`` more workspace bytes; when the sum would not
        fit the device budget, move resident experts to the ring (:meth:`_shrink_experts`), then
        re-plan the dense weights under what is left if that is not enough."""
        self.kv_device_bytes += kv
        self.workspace_reserved += work
        if self.device_budget is None or kv + work <= 0:
            return None
        if self._used() <= self.device_budget:
            return None
        experts_moved = self._shrink_experts(self._used() - self.device_budget)  # experts give back first
        if experts_moved is not None and self._used() <= self.device_budget:
            return experts_moved
        budget = self.device_budget - self.kv_device_bytes - self.workspace_reserved - self.expert_device_bytes
        try:
            self.residency = self._plan_residency(budget)
        except residency.BudgetError:
            self.kv_device_bytes -= kv
            self.workspace_reserved -= work
            need = self._smallest_weight_budget()
            b = residency._bytes
            kv_all, work_all = self.kv_device_bytes + kv, self.workspace_reserved + work
            if self.expert_reserve:  # the experts' share grows with the budget: only a larger reservation helps
                raise residency.BudgetError(
                    f"a device budget of {b(self.device_budget)} cannot hold a KV cache of {b(kv_all)} and a "
                    f"workspace of {b(work_all)}: the experts' {b(self.expert_device_bytes)} were planned at load "
                    f"around {b(self.expert_reserve)} for the KV cache and workspace; make the Runner with "
                    "reserve_for=(batch, capacity) of this state, or give an expert budget") from None
            raise residency.BudgetError(
                f"a device budget of {b(self.device_budget)} cannot hold a KV cache of {b(kv_all)} and a "
                f"workspace of {b(work_all)} beside the weights: {b(max(budget, 0))} would be left for them "
                f"and they need at least {b(need)}; the smallest working device budget for this KV cache is "
                f"{b(kv_all + work_all + need + self.expert_device_bytes)} (or lower the batch or the "
                "context)") from None
        self.replans += 1
        changed = (f"weight plan changed: KV of {self.kv_device_bytes:,} bytes and a workspace of "
                   f"{self.workspace_reserved:,} bytes left {budget:,} bytes of the "
                   f"{self.device_budget:,} byte device budget for weights; "
                   f"{self.residency.weight_bytes_streamed_per_step:,} bytes now stream per step")
        return changed if experts_moved is None else f"{experts_moved}; {changed}"

    def _used(self) -> int:
        """Device bytes the budget counts: weights (with the paged experts), staging, KV, workspace."""
        return self.weight_bytes + self.residency.staging_bytes + self.kv_device_bytes + self.workspace_reserved

    def _shrink_experts(self, over: int) -> str | None:
        """Under a plain device budget (the experts sized at load around ``expert_reserve``),
        give ``over`` bytes back from the resident experts (core.runtime.experts.shrink: moved to
        the ring, the results unchanged). When they cannot give enough, they give all only if
        the dense weights' smallest plan then fits what is left (the caller re-plans those);
        else nothing moves and the caller refuses. Returns the reason the plan changed, or None.
        """
        res, budget = self.expert_residency, self.device_budget
        if (budget is None or not self.expert_reserve or res is None or not res.plan.ring_slots
                or not res.plan.resident_bytes):
            return None
        plan = res.plan
        smaller = shrink(plan, over)
        freed = plan.resident_bytes - smaller.resident_bytes
        if freed < over and (budget - self.kv_device_bytes - self.workspace_reserved - smaller.ring_bytes
                             < self._smallest_weight_budget()):
            return None
        res.replan(smaller)
        self.replans += 1
        return (f"expert plan changed: KV of {self.kv_device_bytes:,} bytes and a workspace of "
                f"{self.workspace_reserved:,} bytes grew past what the {budget:,} byte device budget "
                f"reserved for them at load; {freed:,} bytes of resident experts moved to the ring "
                f"({smaller.resident_bytes:,} bytes of experts stay resident)")

"""Expert residency on cuda: experts as pages, the copy list decided on the device (docs/moe.md,
"Expert streaming on cuda").

:func:`use_expert_residency` plans a session's MoE / QMoE experts as cpu_reference's pager does
(core.runtime.experts.plan_experts) and moves them:

- the bank: every expert of a node as one page (its tensors at fixed 256-byte aligned offsets,
  :func:`page_layout`) in pinned host memory, mapped into the device's address space;
- the resident store: the pages of the plan's resident experts, on the device;
- the ring: ``ring_slots`` device slots of the largest page, shared by every layer.

The nodes' own device copies of their expert tensors are dropped (the plan's constants become
zero-stride views of the same shapes, which the launcher checks and never reads), so the device
holds the resident store and the ring. A node call then runs ``moe_route``, ``moe_plan`` (one
block: each routed expert to its resident page or a ring slot, first in first out, the copy
list of each wave, the counters), then per wave ``moe_page_in``, ``moe_up_paged`` and
``moe_down_paged``, then ``moe_mix`` (kernels/moe_paged.cu). The number of waves,
:func:`waves`, depends on the token rows and the plan only, so the launch shapes never depend
on the routing: the copies are inside the captured step. :func:`plan_step` is ``moe_plan`` in
NumPy, the same algorithm (tests/unit/test_cuda_expert_planner.py fuzzes it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from core.runtime.experts import ExpertCounters, ExpertPlan, check_shrunk, moe_layout, plan_experts

#: Entries of a page's pointer table: fc1 (weights, scales, zero points, bias), fc2, fc3.
NT = 12
#: op type -> node input index -> table entry.
TABLE = {"MoE": {2: 0, 3: 3, 4: 4, 5: 7, 6: 8, 7: 11},
         "QMoE": {2: 0, 3: 1, 4: 3, 5: 4, 6: 5, 7: 7, 8: 8, 9: 9, 10: 11, 11: 2, 12: 6, 13: 10}}
#: Byte alignment of each tensor in a page (and of the page).
ALIGN = 256
#: Ring keys: node index * KEY_STRIDE + expert.
KEY_STRIDE = 1 << 16
_THREADS = 256
_WARPS = 4


def waves(pairs: int, cold: int, slots: int) -> int:
    """Waves of a node call of ``pairs`` routed (row, expert) pairs over a node with ``cold``
    non-resident experts and a ring of ``slots``: ceil(min(pairs, cold) / slots), at least 1
    (the resident experts' pairs run in wave 0). Never depends on the routing."""
    if cold == 0 or slots == 0:
        return 1
    return max(1, -(-min(pairs, cold) // slots))


@attrs.frozen
class StepPlan:
    """What ``moe_plan`` decides for one node call (NumPy model, :func:`plan_step`).

    Attributes:
        wave_of: int32 [E]: the wave each routed expert runs in (resident: 0), -1 not routed.
        slot_of: int32 [E]: the ring slot a routed cold expert is read from, -1 otherwise.
        copies: int32 [waves, slots]: the expert each wave pages into each slot, -1 none.
        holds: int32 [slots]: the ring's keys after the call (-1 empty).
        cursor: the ring's first-in-first-out cursor after the call.
        routed, hits, page_ins: distinct experts routed, found resident or in the ring, copied.
    """

    wave_of: np.ndarray
    slot_of: np.ndarray
    copies: np.ndarray
    holds: np.ndarray
    cursor: int
    routed: int
    hits: int
    page_ins: int


def plan_step(experts: np.ndarray, resident_row: np.ndarray, holds: np.ndarray, cursor: int, n_waves: int,
              key_base: int) -> StepPlan:
    """``moe_plan`` of kernels/moe_paged.cu in NumPy: the routed ``experts`` (int [T, k]) of a
    node whose expert e is resident at row ``resident_row[e]`` (-1: cold), with the ring holding
    keys ``holds`` (node base ``key_base`` + expert; -1 empty) and its cursor at ``cursor``.
    Routed experts are taken in ascending index; a cold one is a hit when its key is in the ring,
    else it is paged into the next slot from the cursor that the current wave does not use; a
    new wave starts when the current one uses every slot.

    Raises:
        RuntimeError: more waves than ``n_waves`` (:func:`waves` bounds them; never expected).
    """
    num_experts = len(resident_row)
    slots = len(holds)
    holds = np.array(holds, np.int32)
    routed_mask = np.zeros(num_experts, bool)
    routed_mask[np.asarray(experts, np.int64).reshape(-1)] = True
    wave_of = np.full(num_experts, -1, np.int32)
    slot_of = np.full(num_experts, -1, np.int32)
    copies = np.full((n_waves, slots), -1, np.int32)
    pinned = np.full(slots, -1, np.int32)
    routed = hits = page_ins = wave = used = 0
    for e in np.flatnonzero(routed_mask):
        routed += 1
        if resident_row[e] >= 0:
            hits += 1
            wave_of[e] = 0
            continue
        found = np.flatnonzero(holds == key_base + e)
        s = int(found[-1]) if len(found) else -1
        if s >= 0:
            hits += 1
        else:
            if used == slots:
                wave, used = wave + 1, 0
                if wave >= n_waves:
                    raise RuntimeError(f"wave {wave} past the {n_waves} the launch has")
            for _ in range(slots):
                c, cursor = cursor, (cursor + 1) % slots
                if pinned[c] != wave:
                    s = c
                    break
            holds[s] = key_base + e
            copies[wave, s] = e
            page_ins += 1
        pinned[s] = wave
        used += 1
        wave_of[e] = wave
        slot_of[e] = s
    return StepPlan(wave_of, slot_of, copies, holds, cursor, routed, hits, page_ins)


def page_layout(sizes: Mapping[int, int]) -> tuple[np.ndarray, int]:
    """(offsets int64 [NT], page bytes) of an expert whose tensors take ``sizes`` (table entry ->
    bytes of one expert): each tensor at the next multiple of :data:`ALIGN`, -1 where absent."""
    offsets = np.full(NT, -1, np.int64)
    at = 0
    for t in sorted(sizes):
        offsets[t] = at
        at += -(-sizes[t] // ALIGN) * ALIGN
    return offsets, max(at, ALIGN)


class _Node:
    """One MoE node's pages: the bank (pinned, mapped), the resident store, its counters' rows."""

    def __init__(self, provider, index: int, num_experts: int, arrays: dict[int, Any], resident: frozenset):
        cp = provider.cupy
        self.index, self.num_experts, self.key_base = index, num_experts, index * KEY_STRIDE
        sizes = {t: int(a.nbytes) // num_experts for t, a in arrays.items()}
        offsets, self.page_bytes = page_layout(sizes)
        mem = cp.cuda.alloc_pinned_memory(num_experts * self.page_bytes)
        self.bank = np.frombuffer(mem, np.uint8, num_experts * self.page_bytes).reshape(num_experts, self.page_bytes)
        for t, a in arrays.items():  # the padding between tensors is never read
            host = np.ascontiguousarray(a if isinstance(a, np.ndarray) else provider.download(a))
            self.bank[:, offsets[t]:offsets[t] + sizes[t]] = host.reshape(num_experts, -1).view(np.uint8)
            del host
        self.bank_device = provider.map_host(self.bank)
        self.keep(cp, resident)
        self.offsets = cp.asarray(offsets)

    def keep(self, cp, resident: frozenset) -> None:
        """The resident store of the pages of ``resident`` (from the bank) and their rows."""
        rows = sorted(resident)
        self.cold = self.num_experts - len(rows)
        self.resident = cp.asarray(self.bank[rows]) if rows else cp.zeros(ALIGN, cp.uint8)
        row = np.full(self.num_experts, -1, np.int32)
        row[rows] = np.arange(len(rows), dtype=np.int32)
        self.resident_row = cp.asarray(row)


class _Meter:
    """The handle of :meth:`CudaExpertResidency.meter_async`."""

    def __init__(self, download: Any, page_bytes: list[int]):
        self._download, self._page_bytes = download, page_bytes

    def wait(self) -> tuple[int, int, int, int]:
        """(routed, hits, page-ins, page-in bytes) from the copied counts [nodes, 4]."""
        counts = self._download.wait()
        return (int(counts[:, 0].sum()), int(counts[:, 1].sum()), int(counts[:, 2].sum()),
                sum(int(counts[i, 2]) * b for i, b in enumerate(self._page_bytes)))


class CudaExpertResidency:
    """The plan, the ring and the device counters of a cuda session's experts.

    Attributes:
        plan: the static plan (resident experts per node, ring size).
        slot_bytes: bytes of one ring slot (the largest page).
        nodes: MoE node name -> its pages.
    """

    def __init__(self, provider, plan: ExpertPlan, arrays: Mapping[str, dict[int, Any]]):
        cp = provider.cupy
        self.provider, self.plan = provider, plan
        self.nodes = {name: _Node(provider, i, plan.num_experts[name], arrays[name], plan.resident[name])
                      for i, name in enumerate(plan.num_experts)}
        self.slots = plan.ring_slots
        self.slot_bytes = max((n.page_bytes for n in self.nodes.values()), default=ALIGN)
        self.ring = cp.zeros(max(self.slots * self.slot_bytes, ALIGN), cp.uint8)
        self.holds = cp.full(max(self.slots, 1), -1, cp.int32)
        self.cursor = cp.zeros(1, cp.int32)
        self.pinned = cp.full(max(self.slots, 1), -1, cp.int32)
        self._counts = cp.zeros((len(self.nodes), 4), cp.int64)
        self._routes = cp.zeros((len(self.nodes), max(plan.num_experts.values(), default=1)), cp.uint64)
        self._rows = {name: (self._counts[n.index], self._routes[n.index]) for name, n in self.nodes.items()}

    @property
    def counters(self) -> ExpertCounters:
        """The counters so far (core.runtime.experts.ExpertCounters; read from the device, which
        synchronises): page-in bytes count the experts' stored bytes, as on cpu_reference."""
        counts = self.provider.download(self._counts)
        routes = self.provider.download(self._routes)
        names = list(self.nodes)
        return ExpertCounters(
            routed=int(counts[:, 0].sum()), hits=int(counts[:, 1].sum()), page_ins=int(counts[:, 2].sum()),
            page_in_bytes=sum(int(counts[i, 2]) * self.plan.expert_bytes[n] for i, n in enumerate(names)),
            token_rows=int(counts[:, 3].sum()), moe_nodes=len(names),
            routed_counts={n: routes[i, :self.nodes[n].num_experts].astype(np.int64) for i, n in enumerate(names)})

    def replan(self, plan: ExpertPlan) -> None:
        """Run under ``plan`` from the next call on: the current plan with fewer resident
        experts (core.runtime.experts.shrink), each node's resident store rebuilt from its bank
        (the moved experts are paged like any cold one; the ring is kept). The caller has
        waited for the work that reads the old stores and drops the captured graphs that hold
        their addresses (Runner._reserve returns the reason).

        Raises:
            ValueError: ``plan`` is not the current one with fewer resident experts.
        """
        check_shrunk(self.plan, plan)
        self.provider.stream.synchronize()
        for name, node in self.nodes.items():
            node.keep(self.provider.cupy, plan.resident[name])
        self.plan = plan
        self.provider.stream.synchronize()  # the new stores are in place before any step

    def meter_async(self) -> _Meter:
        """(routed, hits, page-ins, page-in bytes) as the work queued so far leaves the device
        counters, as a handle: the copy of the counts is queued on the provider stream behind
        that work (``provider.download_async``), so only ``wait()`` waits, and for the copy
        alone. The same figures as :attr:`counters`."""
        per_node = [self.plan.expert_bytes[n] for n in self.nodes]
        return _Meter(self.provider.download_async(self._counts), per_node)

    def launch(self, ctx, t: str, bits: tuple[int, int], x, experts, a, y, sizes: tuple[int, int, int, int],
               rows_of: tuple[int, int, int], block: int, tail: tuple) -> None:
        """The expert part of node ``ctx.node``'s call (after ``moe_route``, before ``moe_mix``):
        ``moe_plan``, then per wave the page-ins and the paged up / down projections.
        ``sizes``: (rows T, k, hidden H, inter I); ``bits``: fc1's and fc2's; ``rows_of``: (fc1's
        rows, the table base of SwiGLU's linear rows: 0 fc1, 8 fc3, their count); ``block``: the
        quantization block; ``tail``: moe_up's arguments from g_step to has_limit (ops/_moe.py)."""
        from providers.cuda.module import function, multiprocessors

        node = self.nodes[ctx.node.name]
        counts, routes = self._rows[ctx.node.name]
        rows, k, hidden, inter = sizes
        pairs, slots, e = rows * k, self.slots, node.num_experts
        n_waves = waves(pairs, node.cold, slots)
        ptr = ctx.output("moe_page_ptr", (e * NT,), np.uint64)
        wave_of = ctx.output("moe_wave_of", (e,), np.int32)
        copies = ctx.output("moe_copies", (max(n_waves * slots, 1),), np.int32)
        function("moe_paged", "moe_plan", EXPRS)(
            (1,), (_THREADS,),
            (experts, np.int64(pairs), np.int64(rows), np.int32(e), node.resident_row, node.resident,
             np.int64(node.page_bytes), self.ring, np.int64(self.slot_bytes), np.int32(slots), node.offsets,
             np.int32(node.key_base), np.int32(n_waves), self.holds, self.cursor, self.pinned, ptr, wave_of, copies,
             counts, routes))
        blocks = max(8, 2 * multiprocessors() // max(slots, 1))
        for w in range(n_waves):
            if node.cold and slots:
                function("moe_paged", "moe_page_in", EXPRS)(
                    (blocks, slots), (_THREADS,),
                    (copies, np.int32(w), np.int32(slots), node.bank_device, np.int64(node.page_bytes), self.ring,
                     np.int64(self.slot_bytes)))
            function("moe_paged", f"moe_up_paged<{t}, {bits[0]}>", EXPRS)(
                (pairs, -(-inter // _WARPS)), (32 * _WARPS,),
                (x, experts, wave_of, np.int32(w), ptr, np.int64(k), np.int64(hidden), np.int64(inter),
                 np.int64(rows_of[0]), np.int32(rows_of[1]), np.int64(rows_of[2]), *tail, a))
            function("moe_paged", f"moe_down_paged<{t}, {bits[1]}>", EXPRS)(
                (pairs, -(-hidden // _WARPS)), (32 * _WARPS,),
                (a, experts, wave_of, np.int32(w), ptr, np.int64(hidden), np.int64(inter), np.int32(block), y))


#: Every instantiation kernels/moe_paged.cu is compiled with.
EXPRS = ("moe_plan", "moe_page_in", *(f"moe_{kind}_paged<{t}, {b}>" for kind in ("up", "down")
                                       for t in ("__half", "float") for b in (0, 2, 4, 8)))


def _placeholder(cp, value) -> Any:
    """A zero-stride device view of ``value``'s shape and dtype over 16 bytes of its own."""
    return cp.ndarray(value.shape, value.dtype, cp.empty(16, cp.uint8).data, strides=(0,) * value.ndim)


def use_expert_residency(session, budget_bytes: int | None, ring_slots: int = 2,
                         frequencies: Mapping[str, Sequence[float]] | None = None) -> CudaExpertResidency:
    """Plan the experts of a cuda ``session``'s model under ``budget_bytes`` (as cpu_reference's
    pager: core.runtime.experts.plan_experts) and run its MoE / QMoE nodes from pages from the
    next call on; returns the residency (its ``counters``). Call it before the session's first
    run: it drops the nodes' device copies of their experts (which the load uploaded: a Runner
    with ``expert_budget`` never uploads them). ``budget_bytes=None`` keeps every expert
    resident (in the paged layout, counting routes for calibration).

    Raises:
        ValueError: the model has no MoE node; its runner streams weights (a weight or device
            budget: give the Runner ``expert_budget`` for one budget); expert tensors not per
            expert; residency already on for this runner.
        core.runtime.experts.ExpertBudgetError: the budget cannot hold the ring, or leaves
            experts with no slot.
    """
    runner = session.runner
    if runner.placer is not None or runner.device_budget is not None:
        raise ValueError("use_expert_residency on cuda runs with the other weights resident; for one budget with "
                         "them give the Runner expert_budget, weight_budget or device_budget instead")
    counts, sizes = moe_layout(runner.model.graph, runner.model.initializers)
    if not counts:
        raise ValueError("the model has no MoE / QMoE node")
    residency = page_runner(runner, plan_experts(counts, sizes, budget_bytes, ring_slots, frequencies))
    runner.expert_residency = residency
    return residency


def page_runner(runner, expert_plan: ExpertPlan) -> CudaExpertResidency:
    """Page ``runner``'s experts under ``expert_plan``: the bank from the plan's expert
    constants (device tensors, or host arrays in the kernels' layout when the load kept them off
    the device: core.runtime.expert_budget.ExpertPlacer), the resident store and the ring on the
    device; the constants become placeholders. Returns the residency.

    Raises:
        ValueError: expert tensors not per expert, a MoE node not in the plan, residency
            already on.
    """
    provider, plan = runner.provider, runner.plan
    counts = expert_plan.num_experts
    found = {}
    for i, node in enumerate(plan.nodes):
        if node.name in counts:
            if "expert_pager" in plan.contexts[i].cache:
                raise ValueError(f"expert residency is already on for {node.name!r}")
            found[node.name] = i
    if set(found) != set(counts):
        raise ValueError(f"MoE nodes {sorted(set(counts) - set(found))} are not in the session's plan")
    arrays: dict[str, dict[int, Any]] = {}  # node -> table entry -> the tensor (device or host)
    for name, i in found.items():
        node, e = plan.nodes[i], counts[name]
        arrays[name] = {}
        for index, entry in TABLE[node.op_type].items():
            tensor = node.inputs[index] if index < len(node.inputs) else ""
            if not tensor:
                continue
            value = plan.constants.get(tensor)
            if value is None or int(value.shape[0]) != e:
                raise ValueError(f"{name}: expert input {tensor!r} must be a constant [E={e}, ...]")
            arrays[name][entry] = value  # the bytes the kernels read, prepared or not
    residency = CudaExpertResidency(provider, expert_plan, arrays)
    cp = provider.cupy
    for i in found.values():
        node = plan.nodes[i]
        for index in TABLE[node.op_type]:
            if index < len(node.inputs) and node.inputs[index]:
                plan.constants[node.inputs[index]] = _placeholder(cp, plan.constants[node.inputs[index]])
        plan.contexts[i].cache["expert_pager"] = residency
    del arrays
    provider.stream.synchronize()  # the pages and the ring are in place before any step
    provider.reset_peak()  # the dropped expert copies go back to the device
    return residency

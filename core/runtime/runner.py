"""The Runner: one per model x provider x KV layout, shared by every session on it.

A Runner plans the graph once on its provider (fusion passes, one kernel and context per node),
uploads the weights once, keeps the weight-derived caches the kernels build (packed or
dequantised weights live in the plan's kernel contexts) and pools the per-batch decode states,
so a later session of the same batch reuses the buffers and the captured graph of an earlier
one. A second session on the same Runner uploads no weight.

    >>> runner = Runner("path/to/model", provider="cuda")
    >>> a = Session(runner, batch=8)      # plans nothing, uploads nothing
    >>> b = Session(runner, batch=8)      # a second decode state of batch 8
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from core.counters import Counters, DeviceMemory
from core.executor import Plan
from core.models.model import Model, load_model
from core.plugins import get_provider
from core.runtime import expert_budget as experts
from core.runtime import kv as kvgeo
from core.runtime import placement, residency, ring, rowblocks, streaming
from core.runtime.budget import DeviceBudget

log = logging.getLogger("lockstep")

#: With no budget given, weights that exceed this share of the provider's free memory stream
#: under a weight budget of this share (the rest: KV cache, activations, workspace).
AUTO_SHARE = 0.8


class Runner(DeviceBudget):
    """A model planned on one provider for one KV layout.

    Args:
        model: a model folder or a loaded :class:`~core.models.model.Model`.
        provider: a provider name (``lockstep providers``) or a provider object.
        kv_layout: "head_major" ([B, Nkv, S, H]) or "seq_major" ([B, S, Nkv, H]).
        weight_budget: device bytes for the weights, staging ring included: bytes, a fraction
            of the weight bytes, or a string ("2GiB", "40%"). Weights past it stream from
            host memory every step (core.runtime.residency). Default: everything resident when
            the weights fit the provider's free memory, else 80% of the free memory (logged).
        staging_slots: staging ring slots (default: one layer's streamed pages plus one).
        device_budget: device bytes for weights, staging and KV together (elastic budget): as
            decode states allocate or commit KV, the weight budget shrinks and the residency
            plan changes (more weights stream); graphs captured under the old plan are
            invalidated with the reason, and the request goes on.
        page_bytes: the page size of streamed row blocks (core.runtime.rowblocks): bytes or a
            size ("64MiB"); default ``LOCKSTEP_PAGE_BYTES``, else the largest node that cannot
            be cut, at least 64 MiB. The staging slot is this size, so no single node sets it.
        expert_budget: device bytes for a MoE model's experts (the resident ones and the ring of
            expert slots): bytes, a fraction of the experts' bytes, or a string. With it, or with
            a weight or device budget on a MoE model, the experts are paged
            (core.runtime.expert_budget: one budget with the dense weights, experts streamed
            first) and never uploaded whole.
        expert_slots: the expert ring's slots (default 2).
        reserve_for: (batch, capacity) of the largest decode state the caller will open. With a
            device budget and no expert budget on a MoE model, the experts' share at load leaves
            room for that state's KV cache and workspace (:meth:`reservation`); KV beyond it is
            paid by moving resident experts to the ring (:meth:`_reserve`), which pages more
            per step. Default: a default Session's (batch 1, capacity 256 or the model
            context).

    Thread safety: one Runner may serve sessions on several threads. Every call that runs the
    plan or changes the runner's state (a session's prefill, step, read, discard, rewind,
    close; the pool; the KV accounting) holds :attr:`lock`, so calls from two threads run one
    after the other, never interleaved, and each request gets the bits it gets alone
    (docs/reliability.md). A single owner thread driving the runner takes the same lock
    uncontended.

    Attributes:
        model, provider, kv_layout, plan: what the runner was made of.
        lock: the re-entrant lock that serialises the calls above (``with runner.lock:`` to
            make several calls one atomic unit).
        weight_bytes: bytes of the resident constants (weights and folded values).
        expert_residency: the provider's expert pager (its ``plan`` and ``counters``), or None.
        residency: the :class:`~core.runtime.residency.ResidencyPlan` (what streams).
        weight_upload_bytes: bytes the provider uploaded while the runner planned the graph.

    Raises:
        kv.KVLayoutError: an unknown layout, or one the provider's kernels do not read.
        core.plugins.ProviderError: unknown provider (lists the installed ones).
        core.models.model.ModelError: the model folder is missing or incomplete.
        core.executor.UnsupportedOpError: the provider cannot run some graph node.
        core.runtime.residency.BudgetError: a budget too small for the always-resident weights
            plus the staging ring, or a provider that cannot stream.
    """

    #: Free decode states kept per runner (each holds its KV cache and captured graph).
    POOL_SIZE = 4

    def __init__(self, model: str | Path | Model, provider: Any = "cpu_reference",
                 kv_layout: str = "head_major", weight_budget: int | float | str | None = None,
                 staging_slots: int | None = None, device_budget: int | str | None = None,
                 page_bytes: int | str | None = None, expert_budget: int | float | str | None = None,
                 expert_slots: int = 2, reserve_for: tuple[int, int] | None = None):
        if kv_layout not in kvgeo.LAYOUTS:
            raise kvgeo.KVLayoutError(f"kv_layout must be one of {kvgeo.LAYOUTS}, got {kv_layout!r}")
        self.provider = get_provider(provider)
        if kv_layout not in self.provider.capabilities().kv_layouts:
            raise kvgeo.KVLayoutError(f"provider {self.provider.name!r} does not support KV layout {kv_layout!r}")
        self.model = model if isinstance(model, Model) else load_model(model)
        self.kv_layout = kv_layout
        #: per layer, the window of its ring KV cache or 0 (core.runtime.ring, docs/kv-geometry.md)
        self.kv_windows = ring.layer_windows(self.model.graph, self.model.config)
        #: serialises every call that steps, reads or changes a decode state of this Runner
        #: (docs/reliability.md): threads may share it
        self.lock = threading.RLock()
        self._free: list = []
        #: The decode state whose prefill or step ran the plan last: the plan's output buffers
        #: (the logits among them) hold its values (Session.last_logits checks it).
        self.outputs_owner: Any = None
        self.weight_budget = weight_budget
        self.stream = None
        self._slots = staging_slots
        #: the page size of row-blocked weights (None: core.runtime.rowblocks.default_page_bytes)
        self.page_bytes = rowblocks.page_bytes(page_bytes)
        raw = self.model.weight_bytes()  # the initializers' sizes (memory maps: nothing read)
        self.device_budget = residency.parse_budget(device_budget, raw, fractions=False)
        self.kv_device_bytes = 0  # KV bytes held by this runner's decode states
        #: device bytes reserved for the workspace of the largest decode state opened so far
        #: (core.runtime.workspace; its buffers stay in the plan's contexts after the state)
        self.workspace_reserved = 0
        self._header: Any = None
        budget = residency.parse_budget(weight_budget, raw)
        if self.device_budget is not None:
            budget = min(budget or self.device_budget, self.device_budget)
        self.auto_budget = budget is None and self._too_big(raw)
        if self.auto_budget:
            budget = int(self.provider.free_device_bytes() * AUTO_SHARE)
        layout, self.expert_residency = experts.ExpertLayout.of(self.model), None
        if expert_budget is not None and not layout.counts:
            raise residency.BudgetError("an expert budget needs a model with MoE / QMoE nodes; this one has none")
        paged = bool(layout.counts) and (expert_budget is not None or budget is not None)
        dense_raw = raw - layout.total_bytes if paged else raw
        whole, explicit, expert_bytes = budget, residency.parse_budget(expert_budget, layout.total_bytes), None
        #: bytes a plain device budget leaves aside at load for the KV and workspace of the decode
        #: states (a MoE model's experts sized around them); 0: none
        self.expert_reserve = 0
        if paged and explicit is None and self.device_budget is not None:
            self.expert_reserve = self.reservation(*(reserve_for or (1, min(256, self.model.config.context_length))))
            whole = max(min(budget or self.device_budget, self.device_budget - self.expert_reserve), 1)
        if paged:  # from the initializers' sizes for the load; again below from the loaded dense weights
            budget, expert_bytes = experts.split(whole, explicit, dense_raw, layout, expert_slots)
        #: the load-time placement (core.runtime.placement), or None: every weight uploaded
        self.placer: Any = None
        if budget is not None and budget < dense_raw and self.provider.capabilities().weight_streaming:
            self.placer = placement.BudgetPlacer(budget, staging_slots, mappable=True, page_bytes=self.page_bytes,
                                                 exclude_nodes=frozenset(layout.counts) if paged else frozenset())
        if paged:
            self.placer = experts.ExpertPlacer(layout.counts, self.placer, expert_bytes or 0, self.expert_reserve,
                                               self.device_budget if self.expert_reserve else None)
        before = getattr(self.provider, "uploaded_bytes", 0)
        start = time.perf_counter()
        try:
            self.plan = Plan(self.model.graph, self.model.initializers, self.provider, kv_layout, placer=self.placer)
        except residency.BudgetError as exc:
            raise self._budget_error(exc, weight_budget, paged) from None
        self.weight_upload_bytes = getattr(self.provider, "uploaded_bytes", 0) - before
        self._weights = residency.weights_of(self.plan)
        #: constants of the paged experts (out of the dense plan and its accounting)
        self._expert_names: set[str] = set()
        if paged:
            moe = set(layout.counts)
            self._expert_names = {x for w in self._weights if experts.is_expert(w, moe) for x in (w.name, *w.aliases)}
            self._weights = tuple(w for w in self._weights if not experts.is_expert(w, moe))
        self._splits = rowblocks.plan_splits(self.plan)
        self._other_bytes = self.plan.unread_bytes()  # constants no step reads (folded inputs)
        self.replans = 0
        if paged:
            budget, expert_bytes = experts.split(whole, explicit, sum(w.nbytes for w in self._planned_weights()),
                                                 layout, expert_slots)
        try:
            self.residency = self._plan_residency(budget)
        except residency.BudgetError as exc:
            error = (experts.refusal(self.device_budget or whole, self._smallest_weight_budget(), expert_bytes or 0,
                                     self.expert_reserve) if paged else exc)
            raise self._budget_error(error, weight_budget, paged) from None
        if paged:
            self.expert_residency = experts.page(self, layout, expert_bytes, expert_slots)
        self.provider.reset_peak()  # blocks freed while loading go back
        #: seconds from planning the graph to the weights in place (the model files excluded)
        self.load_seconds = time.perf_counter() - start
        if self.auto_budget:
            log.warning("%s", self.auto_line())

    def _too_big(self, raw: int) -> bool:
        """Whether ``raw`` weight bytes exceed the share of the provider's free memory the
        weights may take when no budget is given (:data:`AUTO_SHARE`)."""
        free = self.provider.free_device_bytes()
        return free is not None and raw > free * AUTO_SHARE and self.provider.capabilities().weight_streaming

    def auto_line(self) -> str:
        """The one line an automatic streaming run prints: the sizes and the expected batch-1
        rate (:func:`core.plan.expected_rate`)."""
        from core.plan import expected_rate

        r = self.residency
        # the copy floor alone: the device-bandwidth probe would need room the model has taken
        rate = expected_rate(r.weight_bytes_streamed_per_step, 0, 1, None, self.provider.host_to_device_bandwidth())
        per_s = f"{rate:.1f} tok/s" if rate is not None else "an unknown rate"
        return (f"the model's {self.model.weight_bytes() / 1e9:.2f} GB of weights do not fit the free memory of "
                f"{self.provider.name}: streaming {r.weight_bytes_streamed_per_step / 1e9:.2f} GB per step under a "
                f"{(r.budget or 0) / 2**30:.2f} GiB weight budget; expect about {per_s} at batch 1")

    @property
    def weight_bytes(self) -> int:
        """Device bytes of resident constants (the staging ring not included)."""
        # the slot views of streamed weights and the host views of mapped tables stand in the
        # plan's constants: not resident bytes
        exclude = set(self.residency.streamed_tensors) | set(self.residency.mapped) | self._expert_names
        return self.plan.weight_bytes(exclude=exclude) + self.expert_device_bytes

    @property
    def expert_device_bytes(self) -> int:
        """Device bytes of the paged experts: the resident ones and the ring (0: not paged)."""
        p = None if self.expert_residency is None else self.expert_residency.plan
        return 0 if p is None else p.resident_bytes + p.ring_bytes

    def _planned_weights(self) -> tuple:
        """The weights a residency plan places, with the constants no step reads (folded inputs,
        host integers), which are resident whatever the plan, as one more."""
        if not self._other_bytes:
            return tuple(self._weights)
        return (*self._weights, residency.unread_weight(self._other_bytes))

    def _smallest_weight_budget(self) -> int:
        """The smallest weight budget :meth:`_plan_residency` finds a plan for."""
        return residency.smallest_budget(self._planned_weights(), self._slots,
                                         bool(self.provider.capabilities().weight_streaming), self._splits,
                                         self.page_bytes)

    def _plan_residency(self, budget: int | None) -> residency.ResidencyPlan:
        """The residency plan for ``budget`` bytes (module core.runtime.residency), applied to
        the plan: streamed weights move to staged host memory and read a staging slot."""
        mappable = bool(self.provider.capabilities().weight_streaming)
        plan = residency.plan_residency(self._planned_weights(), budget, self._slots, mappable, self._splits,
                                        self.page_bytes)
        if plan.streams and not self.provider.capabilities().weight_streaming:
            raise residency.BudgetError(f"provider {self.provider.name!r} cannot stream weights "
                                        "(capabilities().weight_streaming is False)")
        streaming.evict(self.plan, plan)  # device copies of newly streamed weights go first
        if plan.streams or self.stream is not None or plan.mapped or self.plan.staged_weights:
            ring = (plan.slots, plan.slot_bytes)
            if self.stream is None or ring != (len(self.stream.slots), self.stream.slots[0].nbytes):
                self.stream = None
                self.stream = self.provider.weight_stream(*ring) if plan.streams else None
            streaming.apply(self.plan, plan, self.stream, self._splits)
        return plan

    def memory(self, state=None) -> DeviceMemory:
        """Device bytes by what holds them now (:class:`~core.counters.DeviceMemory`): the
        resident weights, the staging ring, the KV of this runner's decode states and the
        workspace (the plan's activation buffers, the provider's shared scratch and, given a
        decode ``state``, its step buffers). Their sum is what the runner holds; a provider's
        ``peak_bytes()`` can exceed it by pool blocks freed and cached since the last
        ``reset_peak()``."""
        workspace = self.plan.activation_bytes(host=False) + int(self.provider.workspace_bytes() or 0)
        if state is not None:
            workspace += state.buffer_bytes()
        return DeviceMemory(self.weight_bytes, self.residency.staging_bytes, self.kv_device_bytes, workspace)

    def workspace_estimate(self, batch: int, capacity: int, prefill: tuple[int, int] | None = None,
                           all_positions: bool = False) -> int:
        """Device bytes of the workspace a decode state of ``batch`` rows over ``capacity`` KV
        positions allocates (:mod:`core.runtime.workspace`): the provider's declared
        activations and scratch (``planned_workspace_bytes``) plus the state's own buffers; with
        ``prefill`` (rows, positions a row), plus what that prefill run allocates on top
        (:func:`core.runtime.workspace.prefill_bytes`; ``all_positions``: it keeps every
        position's logits). From the model's header (shapes only; nothing is read)."""
        from core.plan import header_of
        from core.runtime import workspace

        if self._header is None:
            self._header = header_of(self.model, self.provider)
        plan = getattr(self, "plan", None)  # None while loading (reserve_for): the header's program
        gathered = not all_positions and (plan is None or plan.last_position_steps is not None)
        return workspace.estimate(self.model, self._header, self.provider, batch, capacity, prefill, gathered)

    def reservation(self, batch: int, capacity: int) -> int:
        """Device bytes a decode state of ``batch`` rows over ``capacity`` KV positions reserves
        at most: its KV cache (:func:`core.runtime.kv.cache_bytes`: every layer at full
        capacity, ring layers counted whole) and the workspace at the model context (what a
        Session reserves, :meth:`workspace_estimate`) with a prefill of every row's prompt at
        ``capacity`` positions. From the model's header; nothing is read."""
        cfg = self.model.config
        positions = max(1, min(capacity, cfg.context_length))
        kv = kvgeo.cache_bytes(cfg, batch, positions, np.dtype(self.model.io_dtype).itemsize)
        return kv + self.workspace_estimate(batch, cfg.context_length, (batch, positions))

    def with_layout(self, kv_layout: str) -> Runner:
        """A Runner for another KV layout over the same weights: nothing is planned or uploaded
        again (:meth:`core.executor.Plan.with_layout`); the residency plan and the staging
        ring are shared too.

        Raises:
            kv.KVLayoutError: an unknown layout, or one the provider's kernels do not read.
        """
        if kv_layout not in self.provider.capabilities().kv_layouts or kv_layout not in kvgeo.LAYOUTS:
            raise kvgeo.KVLayoutError(f"provider {self.provider.name!r} does not support KV layout {kv_layout!r}")
        other = copy.copy(self)
        other.kv_layout = kv_layout
        other.plan = self.plan.with_layout(kv_layout)
        other.weight_upload_bytes = 0
        other._free = []
        return other

    def expert_meter(self) -> tuple:
        """(experts routed, hits, page-ins, bytes copied) so far by the paged experts; () when not
        paged. On cuda this reads the device counters (it waits for the queued work: the
        session counters read :meth:`expert_meter_async` instead)."""
        if self.expert_residency is None:
            return ()
        c = self.expert_residency.counters
        return (c.routed, c.hits, c.page_ins, c.page_in_bytes)

    def expert_meter_async(self) -> Any:
        """A handle whose ``wait()`` gives :meth:`expert_meter` as the work queued so far leaves
        it, without waiting for that work here (the residency's ``meter_async``: on cuda a copy
        of the device counters queued behind it); None when not paged."""
        return None if self.expert_residency is None else self.expert_residency.meter_async()

    def stream_meter(self) -> tuple:
        """(weight bytes copied, copies) so far on the staging ring; () when nothing streams."""
        return () if self.stream is None else (self.stream.bytes_copied, self.stream.copies)

    def acquire_state(self, batch: int, capacity: int, max_capacity: int, policy: str,
                      capture: bool | None, counters: Counters):
        """A decode state for ``batch`` rows: a pooled free one with the same shape and policy
        (its buffers and captured graph reused), else a new one.

        Raises:
            kv.KVLayoutError: a policy the layout cannot grow under (see :class:`kv.KVCache`).
        """
        key = (batch, capacity if policy == "fixed" else None, max_capacity, policy, capture)
        with self.lock:
            for i, state in enumerate(self._free):
                if state.pool_key == key:
                    del self._free[i]
                    state.attach(counters)
                    return state
            return self.open_state(batch, capacity, max_capacity, policy, capture, counters, key)

    def open_state(self, batch: int, capacity: int, max_capacity: int, policy: str, capture: bool | None,
                   counters: Counters, key: tuple = (), prefill: list[tuple[int, int]] | None = None) -> Any:
        """A new :class:`~core.runtime.state.DecodeState` (not pooled: :meth:`acquire_state`
        pools; the engine's slots hold theirs) whose workspace (:meth:`workspace_estimate`) is
        reserved with its first KV bytes, so one refusal names both; a state that fails to
        build has given back what it charged. The workspace covers the largest ``prefill`` run,
        (rows, positions a row) pairs (default: ``batch`` prompts of ``capacity`` positions)."""
        from core.runtime.state import DecodeState

        with self.lock:
            before = self.workspace_reserved
            # with its largest prefill runs (a longer prompt reserves its own: reserve_prefill)
            work = max(self.workspace_estimate(batch, max(capacity, max_capacity), run)
                       for run in prefill or [(batch, capacity)])
            pending = [max(0, work - before)]

            def reserve(kv: int) -> str | None:
                work, pending[0] = pending[0], 0
                with self.lock:
                    return self._reserve(kv, work)

            try:
                state = DecodeState(self, batch, capacity, max_capacity, policy, capture, counters, key, reserve)
            except BaseException:
                self.workspace_reserved = before  # nor does the workspace of a state never built
                raise
            state.prefill_covered = max((p for rows, p in prefill or [(batch, capacity)] if rows >= batch), default=0)
            return state

    def reserve_prefill(self, state, rows: int, positions: int, all_positions: bool = False) -> str | None:
        """Reserve, before it runs, what a prefill of ``rows`` prompts of ``positions`` positions
        on decode ``state`` needs beyond the workspace reserved (:meth:`workspace_estimate`;
        ``all_positions``: it keeps every position's logits); the weights give way under a device
        budget. Returns None, or the reason the weight plan changed (its graphs are invalid).

        Raises:
            core.runtime.residency.BudgetError: the device budget cannot hold it (the message
                names the smallest working device budget)."""
        with self.lock:
            need = self.workspace_estimate(state.batch, max(state.kv.capacity, state.kv.max_capacity),
                                           (rows, positions), all_positions)
            return self._reserve(0, max(0, need - self.workspace_reserved))

    def release_states(self) -> None:
        """Drop every pooled free decode state (their KV and buffers go back to the provider),
        e.g. between the points of a sweep, where no later session has the same shape."""
        with self.lock:
            for dropped in self._free:
                self._drop(dropped)
            self._free.clear()
            self.provider.reset_peak()  # a pool would keep their blocks cached (cuda: above the budget)

    def release_state(self, state) -> None:
        """Return a decode state to the pool (the oldest free one is dropped past POOL_SIZE).
        A state a fault left unusable (:attr:`~core.runtime.state.DecodeState.broken`) is
        dropped, never pooled."""
        with self.lock:
            if state in self._free:
                return
            if state.broken:
                self._drop(state)
                return
            self._free.append(state)
            for dropped in self._free[:-self.POOL_SIZE]:
                self._drop(dropped)
            del self._free[:-self.POOL_SIZE]

    def _drop(self, state) -> None:
        """Stop accounting a dropped state's KV; the plan's outputs no longer belong to it."""
        state.kv.release()
        if self.outputs_owner is state:
            self.outputs_owner = None

    def engine_slots(self, slots: int, capacity: int, capture: bool | None,
                     prefill: list[tuple[int, int]] | None = None):
        """The slot state of an :class:`~core.engine.Engine` on this runner: a
        :class:`~core.engine.slots.SlotState` of ``slots`` rows of ``capacity`` positions, with
        fresh :class:`~core.counters.Counters` (``.counters``) holding this runner's residency
        (its expert paging counted from now), the workspace of its largest ``prefill`` runs
        ((rows, positions) pairs) reserved.
        A step runner of another kind answers with its own (tensor parallel:
        :meth:`core.parallel.runner.TensorParallelRunner.engine_slots`).

        Raises:
            core.runtime.kv.KVFullError / core.runtime.residency.BudgetError: the cache does not fit.
        """
        from core.engine.slots import SlotState

        counters = Counters()
        counters.set_residency(self.residency.summary(), self.weight_bytes)
        counters.mark_experts(self)  # the engine's expert paging, not an earlier session's on this runner
        return SlotState(self, slots, capacity, capture, counters, prefill)

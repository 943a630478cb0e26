"""Counters that explain where the bytes and microseconds of a session went."""

from __future__ import annotations

from typing import Any

import attrs

#: The expert counters (properties that read the runner's meter when they are read: :class:`Counters`).
EXPERT_COUNTERS = ("expert_routed", "expert_hits", "expert_page_ins", "expert_bytes_copied", "expert_hit_rate",
                   "expert_page_ins_per_step", "expert_bytes_per_step", "expert_bytes_per_token")

#: Closed spans of expert paging :meth:`Counters.end_decode_span` leaves unread (their meter
#: copies may still be queued behind device work; older ones are read).
SPANS_KEPT = 8


@attrs.define
class Counters:
    """Per-session counters (reported in results, ``--json`` and ``lockstep profile``).

    Attributes:
        prefill_tokens: prompt tokens run (padding excluded).
        prefill_positions: prompt positions the prefill's plan runs computed (rows x padded
            length per run): ``prefill_tokens`` plus the padding computed.
        prefill_runs: plan runs of the prefills (one, or one per length group).
        decode_steps: decode steps run (each advances every row by one token).
        prefill_s, decode_s: wall seconds in prefill and in decode steps (host clock, including
            the per-step read-back of the [B, 2] argmax result; a step queued ahead is charged
            from the later of its queueing and the previous step's read to its own read).
        compile_s: wall seconds the provider spent compiling kernels during the prefills and
            decode steps (first use only; :mod:`core.compiling`), left out of ``prefill_s``
            and ``decode_s``.
        decode_device_s: device seconds of the decode steps read (the provider's node timer
            around each step's work, from the queue reaching it to its last kernel; 0 without
            a timer). ``decode_s - decode_device_s`` is what the host added.
        run_ahead_steps: decode steps queued while an earlier step's tokens were still unread
            (Session ``run_ahead``: the host's work overlaps the device's).
        discarded_steps: queued steps dropped unread (a generation ended before them); their
            device work ran, and the session's state was put back as if they never had.
        captures, replays: graph captures made and replays run.
        fallbacks: reasons a decode step ran eagerly although capture was asked for.
        invalidations: captured graphs dropped (each with a reason in ``invalidation_reasons``).
        growth_events: KV reallocations (growing policy).
        kv_bytes_moved: bytes copied by KV growth (0 with a VMM arena) and by the engine's
            row moves.
        rows_moved: running rows the engine moved to a lower slot so that its decode steps
            run a smaller bucket (:meth:`core.engine.scheduler.Scheduler.compaction`).
        engine_requests: requests the engine admitted into a slot (``core.run`` on the engine:
            one per row that decodes; 0 on a fixed-batch Session).
        prefill_chunks: prompt chunks the engine's chunked prefill ran (each at most the
            engine's ``prefill_chunk`` positions, on the fixed grid of absolute positions).
        kv_bytes: bytes reserved for the KV cache (all layers, K and V).
        kv_committed_bytes: bytes of the current KV buffers backed through ``kv_commit`` (a
            gauge: growth that reallocates starts it again from the copied prefix).
        weight_bytes: bytes of weights resident on the provider (staging not included).
        weight_budget: the weight budget in bytes (None: everything resident).
        weight_bytes_resident: per-step weights kept on the device.
        weight_bytes_streamed_per_step: host-to-device weight bytes one step copies.
        staging_bytes: device bytes of the staging ring.
        page_bytes: the page size large nodes stream in (row blocks; 0: whole nodes only).
        row_block_pages_per_step: pages per step that are row blocks of a node's output rows.
        htod_bytes: weight bytes copied host-to-device so far (prefill and decode).
        htod_bytes_per_token: decode-step weight bytes copied per generated token (per row).
        page_ins, page_ins_per_token: weight copies into staging slots (all; per decode token).
        evictions: copies that overwrote another weight in a staging slot.
        hit_rate, byte_hit_rate: fraction of the per-step weight reads (by tensor; by bytes)
            served by resident weights.
        replans: residency plans changed because KV growth took device memory from the
            weights (elastic device budget); each also invalidates a captured graph, with
            its reason in ``invalidation_reasons``.
        expert_routed, expert_hits, expert_page_ins: paged experts (a MoE model under an expert,
            weight or device budget; docs/moe.md): distinct experts routed per MoE node call,
            those found resident or still in the ring, those copied into a ring slot (misses);
            summed over the session's prefills and steps. The expert counters are properties
            read from the runner's meter when they are read (:meth:`count_experts`: a decode
            step never waits for the device to count them); read them on the thread that
            drives the session or engine.
        expert_bytes_copied: the experts' stored bytes those page-ins copied.
        expert_hit_rate: expert_hits / expert_routed (1.0 before any route).
        expert_page_ins_per_step, expert_bytes_per_step: page-ins and bytes per decode step.
        expert_bytes_per_token: expert bytes copied per generated token (per row).
    """

    prefill_tokens: int = 0
    prefill_positions: int = 0
    prefill_runs: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    compile_s: float = 0.0
    decode_device_s: float = 0.0
    run_ahead_steps: int = 0
    discarded_steps: int = 0
    captures: int = 0
    replays: int = 0
    fallbacks: list = attrs.Factory(list)
    invalidations: int = 0
    invalidation_reasons: list = attrs.Factory(list)
    growth_events: int = 0
    kv_bytes_moved: int = 0
    rows_moved: int = 0
    engine_requests: int = 0
    prefill_chunks: int = 0
    kv_bytes: int = 0
    kv_committed_bytes: int = 0
    weight_bytes: int = 0
    weight_budget: int | None = None
    weight_bytes_resident: int = 0
    weight_bytes_streamed_per_step: int = 0
    staging_bytes: int = 0
    page_bytes: int = 0
    row_block_pages_per_step: int = 0
    htod_bytes: int = 0
    htod_bytes_per_token: float = 0.0
    page_ins: int = 0
    page_ins_per_token: float = 0.0
    evictions: int = 0
    hit_rate: float = 1.0
    byte_hit_rate: float = 1.0
    replans: int = 0
    _expert_sums: tuple = attrs.field(default=(0, 0, 0, 0), repr=False)
    _decode_expert: tuple = attrs.field(default=(0, 0, 0, 0), repr=False)
    _expert_base: Any = attrs.field(default=(0, 0, 0, 0), repr=False, eq=False)
    _expert_spans: list = attrs.field(factory=list, repr=False, eq=False)
    _expert_open: tuple = attrs.field(default=(None, 0, 0), repr=False, eq=False)
    _decode_htod: int = attrs.field(default=0, repr=False)
    _decode_page_ins: int = attrs.field(default=0, repr=False)
    _decode_tokens: int = attrs.field(default=0, repr=False)

    def set_residency(self, summary: dict, weight_bytes: int) -> None:
        """Copy a :meth:`core.runtime.residency.ResidencyPlan.summary` into the counters."""
        self.weight_bytes = weight_bytes
        self.weight_budget = summary["weight_budget"]
        for name in ("weight_bytes_resident", "weight_bytes_streamed_per_step", "staging_bytes", "hit_rate",
                     "byte_hit_rate", "page_bytes", "row_block_pages_per_step"):
            setattr(self, name, summary[name])

    def add_streamed(self, nbytes: int, copies: int, slots: int, decode_tokens: int = 0) -> None:
        """Count one step's weight copies (``decode_tokens``: rows advanced, 0 for a prefill)."""
        self.evictions += max(0, copies - max(0, slots - self.page_ins)) if copies else 0
        self.htod_bytes += nbytes
        self.page_ins += copies
        if decode_tokens:
            self._decode_htod += nbytes
            self._decode_page_ins += copies
            self._decode_tokens += decode_tokens
            self.htod_bytes_per_token = self._decode_htod / self._decode_tokens
            self.page_ins_per_token = self._decode_page_ins / self._decode_tokens

    def mark_experts(self, runner) -> None:
        """Start counting ``runner``'s expert paging from now (its ``expert_meter_async()``; a
        runner without one, or not paged: nothing is counted). Without a mark, counting starts
        where the runner's meter does (its load)."""
        self._expert_open, self._expert_spans[:] = (None, 0, 0), []
        read = getattr(runner, "expert_meter_async", None)
        handle = read() if read is not None else None
        self._expert_base = (0, 0, 0, 0) if handle is None else handle

    def end_decode_span(self) -> None:
        """End the span of decode steps counted since the last span (call it before queueing a
        prefill, so that the prefill's expert paging is told apart from the steps'): the meter
        is copied behind the queued work and read later, never waited for here. All but the
        last :data:`SPANS_KEPT` spans are read now (their copies are long done: a result was
        read since), so a long-running engine keeps a bounded list."""
        owner, steps, tokens = self._expert_open
        if steps:
            self._close_span(owner, steps, tokens)
        self._settle(len(self._expert_spans) - SPANS_KEPT)

    def count_experts(self, runner, decode_tokens: int = 0) -> None:
        """Count the expert paging of the prefill (``decode_tokens`` 0) or decode step
        (``decode_tokens``: rows advanced) just queued on ``runner`` (one whose
        ``expert_residency`` pages experts; others: nothing). A step is only remembered (its
        paging is read with the steps around it, when the counters are read or after the next
        :meth:`end_decode_span`): on cuda the meter lives on the device, and reading it per
        step would wait for the step and cost run-ahead its overlap. A prefill ends a span
        whose meter copy is queued now and read later.

        Raises:
            RuntimeError: a prefill after decode steps with no :meth:`end_decode_span` between.
        """
        owner, steps, tokens = self._expert_open
        if decode_tokens:
            if getattr(runner, "expert_residency", None) is not None:  # paged: its meter moves
                self._expert_open = (runner, steps + 1, tokens + decode_tokens)
            return
        if steps:
            raise RuntimeError("count_experts: a prefill counted after decode steps with no end_decode_span() "
                               "between them (its paging would be charged to the steps)")
        self._close_span(runner, 0, 0)

    def settle_experts(self) -> None:
        """Read the expert paging counted so far into the ``expert_*`` counters (one read of the
        meter: on cuda a wait for the work queued so far). Reading any ``expert_*`` counter or
        :meth:`to_dict` does this first."""
        owner, steps, tokens = self._expert_open
        if steps:
            self._close_span(owner, steps, tokens)
        self._settle(len(self._expert_spans))

    def _close_span(self, runner, steps: int, tokens: int) -> None:
        """Queue a copy of ``runner``'s meter ending a span of ``steps`` decode steps of
        ``tokens`` rows (0: a prefill); nothing when the runner pages no experts."""
        self._expert_open = (None, 0, 0)
        read = getattr(runner, "expert_meter_async", None)
        handle = read() if read is not None else None
        if handle is not None:
            self._expert_spans.append((handle, steps, tokens))

    def _settle(self, n: int) -> None:
        """Read the first ``n`` closed spans' meters and count the paging between them."""
        if n <= 0:
            return
        base = self._expert_base
        prev = base if isinstance(base, tuple) else tuple(int(x) for x in base.wait())
        for handle, steps, tokens in self._expert_spans[:n]:
            meter = tuple(int(x) for x in handle.wait())
            routed, hits, page_ins, nbytes = (b - a for a, b in zip(prev, meter))
            self.add_experts(routed, hits, page_ins, nbytes, tokens, steps)
            prev = meter
        self._expert_base = prev
        del self._expert_spans[:n]

    def add_experts(self, routed: int, hits: int, page_ins: int, nbytes: int, decode_tokens: int = 0,
                    steps: int = 1) -> None:
        """Count the expert paging of one prefill or of ``steps`` decode steps (``decode_tokens``:
        rows they advanced, 0 for a prefill)."""
        r, h, p, b = self._expert_sums
        self._expert_sums = (r + routed, h + hits, p + page_ins, b + nbytes)
        if decode_tokens:
            n, pages, copied, tokens = self._decode_expert
            self._decode_expert = (n + steps, pages + page_ins, copied + nbytes, tokens + decode_tokens)

    def _sums(self) -> tuple:
        self.settle_experts()
        return self._expert_sums

    @property
    def expert_routed(self) -> int:
        """Distinct experts routed per MoE node call, summed (class docstring)."""
        return self._sums()[0]

    @property
    def expert_hits(self) -> int:
        """Routed experts found resident or still in the ring."""
        return self._sums()[1]

    @property
    def expert_page_ins(self) -> int:
        """Routed experts copied into a ring slot."""
        return self._sums()[2]

    @property
    def expert_bytes_copied(self) -> int:
        """The experts' stored bytes the page-ins copied."""
        return self._sums()[3]

    @property
    def expert_hit_rate(self) -> float:
        """expert_hits / expert_routed (1.0 before any route)."""
        routed, hits, _, _ = self._sums()
        return hits / routed if routed else 1.0

    def _per_step(self, i: int, per: int) -> float:
        self.settle_experts()
        d = self._decode_expert
        return d[i] / d[per] if d[per] else 0.0

    @property
    def expert_page_ins_per_step(self) -> float:
        """Expert page-ins per decode step (total / steps; 0.0 before a step)."""
        return self._per_step(1, 0)

    @property
    def expert_bytes_per_step(self) -> float:
        """Expert bytes copied per decode step (total / steps)."""
        return self._per_step(2, 0)

    @property
    def expert_bytes_per_token(self) -> float:
        """Expert bytes copied per generated token (per row; total / tokens)."""
        return self._per_step(2, 3)

    def to_dict(self) -> dict:
        """The counters as plain JSON-ready data (the expert counters read first: :meth:`settle_experts`)."""
        out = attrs.asdict(self, filter=lambda a, _v: not a.name.startswith("_"))
        return {**out, **{name: getattr(self, name) for name in EXPERT_COUNTERS}}


@attrs.frozen
class DeviceMemory:
    """Device bytes by what holds them (:meth:`core.runtime.runner.Runner.memory`, the memory
    columns of ``lockstep profile``).

    Attributes:
        weights: resident weights in the kernels' layout, each storage once (staging excluded).
        staging: the weight-streaming ring (0 when nothing streams).
        kv: KV cache bytes of the runner's decode states (allocated, or committed VMM pages).
        workspace: activation buffers of the plan's kernel contexts, the provider's shared
            kernel scratch (``provider.workspace_bytes()``: the split-KV attention workspace and
            the argmax partials on cuda) and the decode state's own step buffers.
    """

    weights: int
    staging: int
    kv: int
    workspace: int

    @property
    def total(self) -> int:
        """weights + staging + kv + workspace."""
        return self.weights + self.staging + self.kv + self.workspace

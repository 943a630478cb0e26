"""DecodeState: the persistent device buffers of one batch on a Runner.

For a batch of B rows, on the runner's provider:

- ``input_ids`` int64 ``[B, 1]``: the token each row feeds to the next decode step;
- ``attention_mask`` int64 ``[B, stride]``: ones over each row's live length (GroupQueryAttention
  derives seqlens_k and total_sequence_length from it, docs/ops.md 1.4);
- ``result`` int32 ``[B, 2]``: the device argmax (token id, error flag);
- ``positions`` int32 ``[B]``: the sequence index device_argmax reads (0 during decode);
- ``lengths_dev`` int32 ``[B]``: tokens in each row's cache, advanced on the device by
  decode_advance; ``lengths`` int64 ``[B]`` is its host mirror and the one owner of the
  lengths: only :meth:`DecodeState.set_lengths` and :meth:`DecodeState.advanced` change it;
- ``sampling``: the per-row sampling buffers (:class:`~core.protocol.SamplingTensors`) while
  the request has a row that is not plain greedy, else None (``device_argmax`` then chooses);
  written only when a request starts (:meth:`DecodeState.set_sampling`);
- ``kv``: the :class:`~core.runtime.kv.KVCache` (its buffers are bound as both
  ``past_key_values.i.*`` and ``present.i.*``, docs/ops.md 6.2).

The capacity lives in ``kv.capacity`` only; the mask width is ``kv.geometry.capacity``.
"""

from __future__ import annotations

import numpy as np

from core.counters import Counters
from core.protocol import SamplingTensors
from core.runtime import step as steps
from core.runtime.capture import CapturedStep
from core.runtime.kv import KVCache


class DecodeState:
    """Buffers, KV cache and captured step of one batch (made by :meth:`Runner.acquire_state`).

    Args:
        runner: the :class:`~core.runtime.runner.Runner`.
        batch: rows B.
        capacity, max_capacity, policy: see :class:`~core.runtime.kv.KVCache`.
        capture: graph capture for decode steps (None: when the provider supports it).
        counters: the session counters charged until the next :meth:`attach`.
        pool_key: how the runner's pool matches this state to a later request.
        reserve: what the KV cache calls with the device bytes it is about to take (default
            ``runner.reserve_kv``; the runner's reserves the state's workspace with them).
    """

    def __init__(self, runner, batch: int, capacity: int, max_capacity: int, policy: str,
                 capture: bool | None, counters: Counters, pool_key: tuple = (), reserve=None):
        p, cfg = runner.provider, runner.model.config
        self.runner, self.batch, self.pool_key = runner, batch, pool_key
        #: prompt positions a prefill of every row may have with its workspace reserved already
        #: (Runner.open_state sets it; reserve_prefill raises it)
        self.prefill_covered = 0
        self.counters = counters
        #: True once a fault left this state's device buffers in a state the host cannot
        #: describe (a failed recovery): the runner drops it instead of pooling it.
        self.broken = False
        self.kv = KVCache(p, runner.kv_layout, batch, cfg.num_kv_heads, cfg.head_size, cfg.num_layers,
                          runner.model.io_dtype, capacity, max_capacity, policy, counters,
                          reserve_bytes=reserve or runner.reserve_kv, windows=runner.kv_windows)
        try:
            self.input_ids = p.allocate((batch, 1), np.int64, zero=True)
            self.result = p.allocate((batch, 2), np.int32, zero=True)
            self.positions = p.allocate((batch,), np.int32, zero=True)
            self.lengths_dev = p.allocate((batch,), np.int32, zero=True)
            self.lengths = np.zeros(batch, np.int64)
            self.binding = p.io_binding(runner.plan)
            self._bind_kv(p.allocate((batch, self.kv.geometry.capacity), np.int64, zero=True))
        except BaseException:  # the runner must not go on counting a cache nobody holds
            self.kv.release()
            raise
        self.logits = None
        self._prompt_logits = None
        self.started = False
        self.sampling: SamplingTensors | None = None
        self._sampling_buffers: SamplingTensors | None = None
        self.capture = CapturedStep(p, runner.plan, lambda: steps.decode_step(self), self.capture_key,
                                    capture, counters, meter=runner.stream_meter)

    def prompt_logits_buffer(self, shape: tuple[int, ...], dtype) -> object:
        """A persistent device buffer of ``shape`` and ``dtype`` that a grouped prefill
        assembles its ``[B, 1, V]`` logits rows in (core.runtime.prompts); kept while the
        shape and dtype stay the same."""
        buf = self._prompt_logits
        if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            buf = self._prompt_logits = self.runner.provider.allocate(shape, dtype)
        return buf

    def logits_are_own(self) -> bool:
        """Whether :attr:`logits` is this state's own buffer (a grouped prefill's), not one of
        the plan's outputs, which every state of the runner shares."""
        return self.logits is not None and self.logits is self._prompt_logits

    def buffer_bytes(self) -> int:
        """Bytes of this state's own step buffers (ids, mask, result, positions, lengths,
        sampling and prompt-logits buffers; the KV cache not included)."""
        held = [self.input_ids, self.result, self.positions, self.lengths_dev, self.attention_mask,
                self._prompt_logits]
        if self._sampling_buffers is not None:
            held += [self._sampling_buffers.params, self._sampling_buffers.options, self._sampling_buffers.history]
        return sum(int(getattr(b, "nbytes", 0)) for b in held if b is not None)

    def attach(self, counters: Counters) -> None:
        """Charge ``counters`` from now on (a pooled state handed to a new session)."""
        self.counters = self.kv.counters = counters
        counters.kv_bytes = self.kv.nbytes
        self.started = False

    def capture_key(self) -> tuple:
        """What a captured decode step bakes in: batch, KV stride, layout, plan, buffers."""
        buffers = [self.input_ids, self.attention_mask, self.result, self.positions, self.lengths_dev]
        if self.sampling is not None:  # sampling or argmax: a different step, a different graph
            buffers += [self.sampling.params, self.sampling.options, self.sampling.history]
        buffers += self.kv.buffers()
        paged = self.runner.expert_residency  # a re-planned expert set rebuilds the cuda resident store
        return (self.batch, self.kv.geometry.capacity, self.runner.kv_layout, id(self.runner.plan),
                id(self.runner.residency), id(None if paged is None else paged.plan), tuple(id(b) for b in buffers))

    def _new_mask(self, geometry) -> object:
        """A mask of the width of ``geometry`` written from the host lengths (before a switch)."""
        mask = self.runner.provider.allocate((self.batch, geometry.capacity), np.int64, zero=True)
        self._write_mask(mask)
        return mask

    def _bind_kv(self, mask) -> None:
        cfg = self.runner.model.config
        self.attention_mask = mask
        self.bind_persistent()
        for i, (k, v) in enumerate(self.kv.layers):
            self.binding.bind_input(cfg.past_key % i, k)
            self.binding.bind_input(cfg.past_value % i, v)
            self.binding.bind_output(cfg.present_key % i, k)
            self.binding.bind_output(cfg.present_value % i, v)

    def bind_persistent(self) -> None:
        """Bind the persistent ids and mask (prefill binds its own [B, S] ones meanwhile)."""
        self.binding.bind_input("input_ids", self.input_ids)
        self.binding.bind_input("attention_mask", self.attention_mask)

    def reserve(self, needed: int) -> None:
        """Room and backed pages for ``needed`` positions per row (KVCache.reserve_positions);
        when growth reallocated the buffers: a new mask, rebinding, and the graph invalidated.
        Transactional: the new KV buffers and mask are made and filled before the state
        switches to them; a failure on the way leaves the state as it was.

        Raises:
            core.runtime.kv.KVFullError: beyond the cache's limit.
        """
        mask = self.kv.reserve_positions(needed, self.lengths, self._new_mask)  # lengths read only on growth
        for reason in self.kv.replan_reasons:
            self._replanned(reason)
        self.kv.replan_reasons.clear()
        if mask is not None:
            self._bind_kv(mask)
            self.capture.invalidate("KV buffers reallocated by growth", self.counters)

    def reserve_prefill(self, rows: int, positions: int, all_positions: bool = False) -> None:
        """Reserve the workspace of a prefill of ``rows`` prompts of ``positions`` positions
        (:meth:`core.runtime.runner.Runner.reserve_prefill`; ``all_positions``: it keeps every
        position's logits) before it runs; a re-plan of the weights it causes invalidates the
        captured graph, as a KV commit's does.

        Raises:
            core.runtime.residency.BudgetError: the device budget cannot hold it.
        """
        if not all_positions and rows <= self.batch and positions <= self.prefill_covered:
            return  # reserved already (a prefill of every row at that length)
        reason = self.runner.reserve_prefill(self, rows, positions, all_positions)
        if not all_positions and rows >= self.batch:
            self.prefill_covered = max(self.prefill_covered, positions)
        if reason:
            self._replanned(reason)

    def _replanned(self, reason: str) -> None:
        """The weight plan changed (``reason``): count it, drop the captured graph, which held
        the old plan's weights, and give their freed memory back to the device now
        (``reset_peak()``: on cuda the CuPy pool's cached blocks, which would otherwise stay
        held above the device budget)."""
        self.counters.replans += 1
        self.counters.set_residency(self.runner.residency.summary(), self.runner.weight_bytes)
        self.capture.invalidate(reason, self.counters)
        self.runner.provider.reset_peak()

    def write_mask(self) -> None:
        """Write the persistent mask from the host lengths: ones over each row's live prefix."""
        self._write_mask(self.attention_mask)

    def _write_mask(self, mask) -> None:
        width = int(mask.shape[1])
        host = (np.arange(width)[None, :] < self.lengths[:, None]).astype(np.int64)
        self.runner.provider.write(mask, host)

    def set_lengths(self, lengths: np.ndarray) -> None:
        """Set every row's live length (after prefill): host mirror, device copy and mask."""
        self.lengths = np.asarray(lengths, np.int64).copy()
        self.runner.provider.write(self.lengths_dev, self.lengths.astype(np.int32))
        self.write_mask()

    def begin_request(self) -> None:
        """A new request starts: no row holds live positions (the device copies are rewritten
        by the prefill that follows)."""
        self.lengths = np.zeros(self.batch, np.int64)
        self.started = False

    def set_sampling(self, params: np.ndarray | None, options: np.ndarray | None) -> None:
        """Per-row sampling for the next request: float32 ``[B, 4]`` params and int32 ``[B, 4]``
        options (:func:`core.generation.sampling.pack`), or None for plain greedy
        (``device_argmax``). The buffers are made once per decode state and rewritten here only."""
        if params is None or options is None:
            self.sampling = None
            return
        p = self.runner.provider
        if self._sampling_buffers is None:
            self._sampling_buffers = SamplingTensors(
                p.allocate((self.batch, 4), np.float32, zero=True), p.allocate((self.batch, 4), np.int32, zero=True),
                p.allocate((self.batch, self.runner.model.config.vocab_size), np.uint8, zero=True))
        p.write(self._sampling_buffers.params, params)
        p.write(self._sampling_buffers.options, options)
        self.sampling = self._sampling_buffers

    def write_history(self, rows) -> None:
        """Set the token history of every row (the repetition penalty reads it) from token-id
        lists ``rows``; nothing without sampling buffers in use."""
        if self.sampling is None:
            return
        hist = np.zeros((self.batch, self.runner.model.config.vocab_size), np.uint8)
        for b, row in enumerate(rows):
            hist[b, np.asarray(row, np.int64)] = 1
        self.runner.provider.write(self.sampling.history, hist)

    def advanced(self) -> None:
        """Record on the host that a decode step added one token to every row."""
        self.lengths = self.lengths + 1

"""The engine's device side: a KV cache of fixed slots, row prefills and bucketed decode steps.

One :class:`~core.runtime.state.DecodeState` of ``slots`` rows and ``capacity`` positions (fixed
policy, every page committed up front) holds the persistent buffers: KV, ``input_ids``,
``attention_mask``, ``result``, ``positions``, ``lengths_dev`` and the per-row sampling buffers.
Every piece of it is laid out row-major along the batch axis (the KV in both layouts:
``[B, Nkv, C, H]`` and ``[B, C, Nkv, H]``), so rows ``[a, b)`` of each buffer are one contiguous
view (basic slicing of the leading axis, a view on numpy and CuPy alike):

- **a row prefill** runs the plan at batch 1 on the views of row ``s`` (its KV written in place
  in the slot, :func:`core.runtime.prompts.run_prompts`), then chooses the first token into
  ``result[s]`` and sets the row's length and mask; the other rows are not touched;
- **a decode step of bucket b** runs :func:`core.runtime.step.decode_step` on the views of rows
  ``[0, b)`` with its own IO binding and :class:`~core.runtime.capture.CapturedStep` (one graph
  per bucket where the provider captures); sampling is always ``device_sample`` (a greedy row
  is flagged so and gets exactly ``device_argmax``'s token), so no request recaptures.

A row's numbers depend only on its own prompt, options and position: the prefill computes it
alone, and every decode kernel is batch invariant, so its tokens are those of a batch-1 run.

**Run-ahead.** A decode step is queued and its result downloaded asynchronously (the
provider's ``download_async``), so the engine can queue the next step before it reads this
one; every host write here (a prefill, a lane reset) is queued behind the steps already
queued, on the provider's one stream.

**Streamed weights.** Under a weight or device budget the runner's residency plan holds: the
weights past the budget are paged into the staging ring by every prefill and decode step, as on
a Session, and what the ring copied (``Runner.stream_meter``) is counted in the engine's
counters (``htod_bytes``, ``page_ins``, ``evictions``); the per-token figures divide a step's
copies by the rows it advanced (a padded lane or a row mid-prefill takes no token).

**Padded lanes.** A free slot below the bucket steps with the others: it feeds token 0 at its
own length into its own (free) KV slot, positions no live row reads, and its token is
ignored. Its length is reset to 0 before it would reach the capacity (host writes of its
length and mask row), so it never writes outside its slot. So is a running row's whose length
reached the capacity: a request needs prompt plus ``max_tokens`` minus one positions (the last
token's KV is never written, as on a Session), so only a step queued ahead past its last token,
whose token the engine drops, finds it there.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from core.counters import Counters
from core.generation import sampling as sampling_mod
from core.generation.sampling import SamplingParams
from core.protocol import SamplingTensors
from core.runtime import prompts
from core.runtime import step as steps
from core.runtime.capture import CapturedStep
from core.runtime.step import StepOutput


@attrs.define
class _KVRows:
    """The KV views of some rows, as :func:`core.runtime.prompts.run_prompts` reads a cache."""

    layers: list
    dtype: Any
    layers_count: int
    geometry: Any


class _Rows:
    """Rows ``[start, stop)`` of the slot buffers, shaped like a decode state for the step
    functions of :mod:`core.runtime.step` and :mod:`core.runtime.prompts`."""

    def __init__(self, slots: SlotState, start: int, stop: int):
        st, n = slots.state, stop - start
        self.runner, self.counters, self.batch = st.runner, slots.counters, n
        rows = slice(start, stop)
        self.input_ids, self.attention_mask = st.input_ids[rows], st.attention_mask[rows]
        self.result, self.positions, self.lengths_dev = st.result[rows], st.positions[rows], st.lengths_dev[rows]
        s = st.sampling
        self.sampling = None if s is None else SamplingTensors(s.params[rows], s.options[rows], s.history[rows])
        geo = attrs.evolve(st.kv.geometry, batch=n)
        self.kv = _KVRows([(k[rows], v[rows]) for k, v in st.kv.layers], st.kv.dtype, st.kv.layers_count, geo)
        self.logits: Any = None


class _Bucket(_Rows):
    """Rows ``[0, batch)`` with their own decode binding and captured step."""

    def __init__(self, slots: SlotState, batch: int, capture: bool | None):
        super().__init__(slots, 0, batch)
        runner, cfg = self.runner, self.runner.model.config
        p = runner.provider
        self.binding = p.io_binding(runner.plan)
        self.binding.bind_input("input_ids", self.input_ids)
        self.binding.bind_input("attention_mask", self.attention_mask)
        for i, (k, v) in enumerate(self.kv.layers):
            self.binding.bind_input(cfg.past_key % i, k)
            self.binding.bind_input(cfg.past_value % i, v)
            self.binding.bind_output(cfg.present_key % i, k)
            self.binding.bind_output(cfg.present_value % i, v)
        self.capture = CapturedStep(p, runner.plan, lambda: steps.decode_step(self), self.key, capture,
                                    slots.counters, meter=runner.stream_meter)

    def key(self) -> tuple:
        """What the captured graph bakes in (the views are made once, so their ids are stable)."""
        buffers = [self.input_ids, self.attention_mask, self.result, self.positions, self.lengths_dev]
        if self.sampling is not None:
            buffers += [self.sampling.params, self.sampling.options, self.sampling.history]
        buffers += [t for pair in self.kv.layers for t in pair]
        paged = self.runner.expert_residency  # a re-planned expert set rebuilds the cuda resident store
        return (self.batch, self.kv.geometry.capacity, id(self.runner.plan), id(self.runner.residency),
                id(None if paged is None else paged.plan), tuple(id(b) for b in buffers))


class SlotState:
    """``slots`` KV rows of ``capacity`` positions on a Runner, with row prefill and bucketed decode.

    Args:
        runner: the :class:`~core.runtime.runner.Runner` (the engine's owner thread alone drives it).
        slots: rows (the engine's ``max_batch``).
        capacity: KV positions per row.
        capture: graph capture of decode steps (None: where the provider supports it).
        counters: the engine's :class:`~core.counters.Counters`.
        prefill: (rows, positions a row) of the largest prefill runs the engine makes, whose
            workspace is reserved with the KV (:meth:`core.runtime.runner.Runner.open_state`);
            default: every slot's whole prompt at the capacity.

    Raises:
        core.runtime.kv.KVFullError / core.runtime.residency.BudgetError: the cache does not fit.
    """

    def __init__(self, runner, slots: int, capacity: int, capture: bool | None, counters: Counters,
                 prefill: list[tuple[int, int]] | None = None):
        self.runner, self.slots, self.capacity, self.counters = runner, slots, capacity, counters
        self.provider = runner.provider
        # KV and workspace, the largest prefill runs' included: nothing is reserved mid-serve
        self.state = runner.open_state(slots, capacity, capacity, "fixed", False, counters, prefill=prefill)
        self.state.reserve(capacity)  # every page backed now: no commit ever happens mid-step
        self.can_sample = hasattr(self.provider, "device_sample")
        if self.can_sample:
            self.state.set_sampling(*sampling_mod.pack([SamplingParams()] * slots))
        self.lane_len = np.zeros(slots, np.int64)  # host mirror of lengths_dev
        self.capture = capture
        #: slots whose prompt is part-way prefilled (chunked prefill; 0: admitted, no chunk run
        #: yet) -> positions done
        self.filled: dict[int, int] = {}
        self._buckets: dict[int, _Bucket] = {}
        self._rows = [_Rows(self, s, s + 1) for s in range(slots)]

    def close(self) -> None:
        """Give the KV bytes back to the runner's accounting (the buffers go with this object)."""
        self.state.kv.release()  # once: a second close gives back nothing more
        if self.runner.outputs_owner is self:
            self.runner.outputs_owner = None
        self._buckets.clear()

    def prefill(self, slot: int, prompt_ids: list[int], sampling: SamplingParams, start: int = 0,
                stop: int | None = None) -> StepOutput | None:
        """Run prompt positions ``[start, stop)`` (default: the whole prompt) into ``slot`` at
        batch 1; the chunk that ends the prompt also sets the row's sampling options, history,
        length and mask and chooses its first token (returned, ``[1]`` arrays). An earlier chunk
        returns None: the slot's KV holds ``[0, stop)`` and its length is ``stop``, so a decode
        step that runs the slot as a padded lane meanwhile writes only at ``stop`` or later,
        positions the next chunk overwrites before anything reads them.

        Raises:
            ValueError: ``0 <= start < stop <= len(prompt_ids)`` does not hold.
        """
        p, row, n = self.provider, self._rows[slot], len(prompt_ids)
        stop = n if stop is None else stop
        if not 0 <= start < stop <= n:
            raise ValueError(f"prefill chunk [{start}, {stop}) of a prompt of {n} tokens")
        before = self.runner.stream_meter()
        self.counters.end_decode_span()  # the prefill's expert paging apart from the steps'
        if start == 0 and stop == n:
            row.logits, positions = prompts.run_prompts(row, [prompt_ids], False, "off")
        else:
            row.logits, positions = prompts.run_chunk(row, prompt_ids[start:stop], start)
            self.counters.prefill_chunks += 1
        self._count_streamed(before, 0)
        self.runner.outputs_owner = self
        self.counters.prefill_tokens += stop - start
        if stop < n:
            self.filled[slot] = stop
            self._set_length(slot, stop)
            return None
        self.filled.pop(slot, None)
        if row.sampling is not None:
            f, i = sampling_mod.pack([sampling])
            p.write(row.sampling.params, f)
            p.write(row.sampling.options, i)
            hist = np.zeros(row.sampling.history.shape, np.uint8)
            hist[0, np.asarray(prompt_ids, np.int64)] = 1
            p.write(row.sampling.history, hist)
        steps.select(row, positions, p.upload(np.array([n], np.int32)), None)
        self._set_length(slot, n)
        return steps.step_output(p.download(row.result))

    def prefill_rows(self, first: int, prompt_ids: list[list[int]], sampling: list[SamplingParams]) -> StepOutput:
        """Run whole prompts into slots ``[first, first + n)`` in one padded run (as a
        fixed-batch Session's prefill: every op computes each row alone, so each row's bits
        are its batch-1 prefill's) and choose their first tokens; sets each row's sampling
        options, history, length and mask. Returns the tokens (``[n]`` arrays).

        Raises:
            ValueError: the slots run past ``slots``.
        """
        n, p = len(prompt_ids), self.provider
        if not 0 <= first < first + n <= self.slots:
            raise ValueError(f"slots [{first}, {first + n}) of {self.slots}")
        rows = _Rows(self, first, first + n)
        if rows.sampling is not None:
            f, i = sampling_mod.pack(sampling)
            p.write(rows.sampling.params, f)
            p.write(rows.sampling.options, i)
            hist = np.zeros(rows.sampling.history.shape, np.uint8)
            for b, ids in enumerate(prompt_ids):
                hist[b, np.asarray(ids, np.int64)] = 1
            p.write(rows.sampling.history, hist)
        lens = np.array([len(ids) for ids in prompt_ids], np.int32)
        before = self.runner.stream_meter()
        self.counters.end_decode_span()  # the prefill's expert paging apart from the steps'
        rows.logits, positions = prompts.run_prompts(rows, prompt_ids, False, "off")
        self._count_streamed(before, 0)
        steps.select(rows, positions, p.upload(lens), None)
        self.runner.outputs_owner = self
        for b in range(n):
            self.filled.pop(first + b, None)
            self._rows[first + b].logits = rows.logits[b:b + 1]
            self._set_length(first + b, int(lens[b]))
        self.counters.prefill_tokens += int(lens.sum())
        return steps.step_output(p.download(rows.result))

    def decode(self, batch: int, live: set[int]) -> Any:
        """Queue one decode step of rows ``[0, batch)`` (a bucket); ``live`` are the occupied
        slots (the others are padded lanes; a slot part-way through a chunked prefill steps as
        a padded lane whose length is put back to its positions done first, so it writes only
        where its next chunk writes). Returns the download of every lane's result: its
        ``wait()`` gives int32 ``[batch, 2]`` (:func:`core.runtime.step.step_output` reads it)."""
        for s in range(batch):
            if s not in live:
                self.filled.pop(s, None)  # freed part-way through its prefill (an abort)
                if self.lane_len[s] >= self.capacity - 1:
                    self._set_length(s, 0)
            elif s in self.filled and self.lane_len[s] != self.filled[s]:
                self._set_length(s, self.filled[s])  # mid-prefill: its lane writes at the next chunk's start
            elif self.lane_len[s] >= self.capacity:
                self._set_length(s, 0)  # past its last token (a step queued ahead): its token is never read
        bucket = self._buckets.get(batch)
        if bucket is None:
            bucket = self._buckets[batch] = _Bucket(self, batch, self.capture)
        advanced = sum(1 for s in live if s < batch and s not in self.filled)  # rows that take a token
        done = bucket.capture.run(self.counters)
        if done:
            self.counters.add_streamed(done[0], done[1], self.runner.residency.slots, advanced)
        self.counters.count_experts(self.runner, advanced)
        self.runner.outputs_owner = self
        self.lane_len[:batch] += 1
        self.counters.decode_steps += 1
        return steps.start_read(bucket)

    def move(self, old: int, new: int) -> int:
        """Copy the state of row ``old`` into free row ``new``: its KV (every layer, K and V),
        last token, input, length, mask, positions and sampling rows, queued on the provider's
        stream behind the steps already queued (a step in flight still reads and writes row
        ``old``; the copy takes what it leaves). Returns the bytes copied."""
        st, p = self.state, self.provider
        buffers = [st.input_ids, st.attention_mask, st.result, st.positions, st.lengths_dev]
        if st.sampling is not None:
            buffers += [st.sampling.params, st.sampling.options, st.sampling.history]
        buffers += [t for pair in st.kv.layers for t in pair]
        moved = 0
        for buf in buffers:  # every slot buffer is row-major along the batch axis (module docstring)
            row = buf.nbytes // self.slots
            moved += p.copy_bytes(buf, buf, [(old * row, new * row, row)])
        self.lane_len[new] = self.lane_len[old]
        self.filled.pop(new, None)  # what a request freed mid-prefill left there
        if old in self.filled:
            self.filled[new] = self.filled.pop(old)
        self.counters.rows_moved += 1
        self.counters.kv_bytes_moved += moved
        return moved

    def start_logits(self, batch: int) -> Any:
        """Start downloading the logits of the decode step of bucket ``batch`` queued last (call
        it right after :meth:`decode`, before the next step is queued): a handle whose
        ``wait()`` gives ``[batch, 1, V]`` in the model's logits dtype."""
        return self.provider.download_async(self._buckets[batch].logits)

    def row_logits(self, slot: int) -> np.ndarray:
        """The logits of the prefill of ``slot`` that ran last, ``[1, 1, V]`` on the host."""
        return self.provider.download(self._rows[slot].logits)

    def _count_streamed(self, before: tuple, decode_tokens: int) -> None:
        """Count the weights a prefill streamed since the meter read ``before`` (as a Session does)."""
        done = tuple(b - a for a, b in zip(before, self.runner.stream_meter()))
        if done:
            self.counters.add_streamed(done[0], done[1], self.runner.residency.slots, decode_tokens)
        self.counters.count_experts(self.runner, decode_tokens)

    def _set_length(self, slot: int, n: int) -> None:
        row, p = self._rows[slot], self.provider
        p.write(row.lengths_dev, np.array([n], np.int32))
        p.write(row.attention_mask, (np.arange(self.capacity) < n).astype(np.int64)[None, :])
        self.lane_len[slot] = n

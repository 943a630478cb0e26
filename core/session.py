"""Decode state: a batch of N sequences with persistent device buffers, prefill and decode steps.

A :class:`Session` owns, on its provider:

- ``input_ids`` int64 ``[B, 1]`` and ``attention_mask`` int64 ``[B, capacity]`` (ones over each
  row's live length), bound on every decode step so a captured step sees stable pointers;
- one K and one V buffer per layer in the session's layout (:mod:`core.kv`), bound as both
  ``past_key_values.i.*`` and ``present.i.*`` (past_present_share_buffer, OPS.md 6.2);
- ``lengths`` int32 ``[B]`` (tokens in each row's cache), ``result`` int32 ``[B, 2]`` (the
  device argmax: token id, error flag) and ``positions`` int32 ``[B]``.

Prompts are right-padded (GQA semantics, OPS.md 1.4): prefill runs with a mask of width
S = the longest prompt (GQA "first prompt"); every decode step runs S = 1 against the full
``[B, capacity]`` mask, so row b's past is ``seqlens_k[b]`` whatever the other rows hold. The
decode loop never computes an argmax itself: it calls the provider's ``device_argmax`` and
``decode_advance``, and reads back only the ``[B, 2]`` result to report tokens.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import attrs
import numpy as np

from core import kv as kvgeo
from core.capture import CaptureState
from core.counters import Counters
from core.executor import Plan
from core.model import Model, load_model
from core.plugins import ProviderError, get_provider
from core.protocol import ARGMAX_ERROR, ARGMAX_TOKEN, KVRequest


class RequestError(ValueError):
    """A request the session refuses before any kernel runs; the session stays usable."""


@attrs.frozen
class StepOutput:
    """What one prefill or decode step produced.

    Attributes:
        tokens: int64 ``[B]`` chosen token per row (-1 where the row's logits were non-finite).
        errors: bool ``[B]``, True where the row's logits held NaN or infinity (CASES 12).
    """

    tokens: np.ndarray
    errors: np.ndarray


class Session:
    """A batch of ``batch`` sequences decoded in lockstep on one provider.

    Args:
        model: a model folder or a loaded :class:`~core.model.Model`.
        provider: a provider name (see ``lockstep providers``) or provider object.
        batch: number of rows N, fixed for the session's life.
        capacity: KV positions per row (tokens). Default: min(256, max_capacity), growing as needed.
        kv_layout: "head_major" ([B, Nkv, S, H], the builder's BNSH) or "seq_major" ([B, S, Nkv, H]).
        kv_policy: "fixed" (capacity is a hard limit) or "growing" (the buffers are reallocated
            to a larger bucket when a step needs it: prefix copied, suffix zeroed, counted in
            ``counters.kv_bytes_moved``). On a provider with VMM (``capabilities().vmm`` and a
            ``reserve`` method) a growing session reserves the full context once and commits
            pages as rows grow: pointers never move, nothing is copied, captures survive.
            Default: "growing" when capacity is None, else "fixed".
        capture: use graph capture for decode steps when the provider supports it (None = auto).
        max_capacity: the most positions a growing session may reach (default: the model
            context); with VMM this is the reserved stride.

    Raises:
        RequestError: bad batch/capacity/layout/policy values (seq_major + growing at batch > 1
            is refused: growth would relocate every row b > 0).
        core.plugins.ProviderError: unknown provider (lists the available ones).
        core.model.ModelError: the model folder is missing or incomplete.
        core.executor.UnsupportedOpError: the provider cannot run some graph node.
    """

    def __init__(self, model: str | Path | Model, provider: Any = "cpu_reference", batch: int = 1,
                 capacity: int | None = None, kv_layout: str = "head_major",
                 kv_policy: str | None = None, capture: bool | None = None,
                 max_capacity: int | None = None):
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise RequestError(f"batch must be a positive integer, got {batch!r}")
        if kv_layout not in kvgeo.LAYOUTS:
            raise RequestError(f"kv_layout must be one of {kvgeo.LAYOUTS}, got {kv_layout!r}")
        kv_policy = kv_policy or ("growing" if capacity is None else "fixed")
        if kv_policy not in kvgeo.POLICIES:
            raise RequestError(f"kv_policy must be one of {kvgeo.POLICIES}, got {kv_policy!r}")
        if kv_policy == "growing" and kv_layout == "seq_major" and batch > 1:
            raise RequestError(
                "a growing seq_major KV cache at batch > 1 would relocate every sequence b > 0; "
                "use kv_layout='head_major' or kv_policy='fixed'")
        self.provider = get_provider(provider)
        self.model = model if isinstance(model, Model) else load_model(model)
        cfg = self.model.config
        if max_capacity is not None and (isinstance(max_capacity, bool) or not isinstance(
                max_capacity, (int, np.integer)) or max_capacity < 1):
            raise RequestError(f"max_capacity must be a positive integer, got {max_capacity!r}")
        if capacity is None:
            capacity = min(256, int(max_capacity or cfg.context_length), cfg.context_length)
        if not isinstance(capacity, (int, np.integer)) or not 1 <= capacity <= cfg.context_length:
            raise RequestError(f"capacity must be in [1, {cfg.context_length}] (the model context), "
                               f"got {capacity!r}")
        caps = self.provider.capabilities()
        self._page = caps.page_bytes  # granularity of kv_commit requests
        self.vmm = bool(caps.vmm and kv_policy == "growing" and hasattr(self.provider, "reserve"))
        if kv_layout not in caps.kv_layouts:
            raise RequestError(f"provider {self.provider.name!r} does not support KV layout {kv_layout!r}")
        self.batch, self.kv_layout, self.kv_policy = int(batch), kv_layout, kv_policy
        self.max_capacity = min(int(max_capacity or cfg.context_length), cfg.context_length)
        if self.max_capacity < capacity:
            raise RequestError(f"max_capacity ({self.max_capacity}) is below capacity ({capacity})")
        self.counters = Counters()
        self.plan = Plan(self.model.graph, self.model.initializers, self.provider, kv_layout)
        self.counters.weight_bytes = self.plan.weight_bytes()
        self.binding = self.provider.io_binding(self.plan)
        p, B = self.provider, self.batch
        self.input_ids = p.allocate((B, 1), np.int64, zero=True)
        self.result = p.allocate((B, 2), np.int32, zero=True)
        self.positions = p.allocate((B,), np.int32, zero=True)
        self.lengths_dev = p.allocate((B,), np.int32, zero=True)
        self.lengths = np.zeros(B, np.int64)  # host mirror of lengths_dev
        self.binding.bind_input("input_ids", self.input_ids)
        self._allocate_kv(int(capacity))
        self.capture = CaptureState(self, enabled=capture)
        self.logits = None
        self.started = False

    # -- buffers ---------------------------------------------------------------------------

    def _geometry(self, capacity: int) -> kvgeo.KVGeometry:
        cfg = self.model.config
        return kvgeo.KVGeometry(self.kv_layout, self.batch, cfg.num_kv_heads, capacity,
                                cfg.head_size, self.model.io_dtype.itemsize)

    def _allocate_kv(self, capacity: int) -> None:
        """Allocate KV and mask for ``capacity`` positions (with VMM: reserve the full context
        once; ``capacity`` is then only the logical limit and pages are committed per step)."""
        self.capacity = capacity
        self._committed_len = 0  # positions of every row backed by kv_commit (new buffers: none)
        self.counters.kv_committed_bytes = 0  # a gauge of the current buffers
        p, cfg = self.provider, self.model.config
        stride = self.max_capacity if self.vmm else capacity
        self.geometry = self._geometry(stride)
        if self.vmm:
            new = lambda: p.reserve(self.geometry.shape, self.model.io_dtype)  # noqa: E731
        else:
            new = lambda: p.allocate(self.geometry.shape, self.model.io_dtype, zero=True)  # noqa: E731
        self.kv = [(new(), new()) for _ in range(cfg.num_layers)]
        self.attention_mask = p.allocate((self.batch, stride), np.int64, zero=True)
        self.counters.kv_bytes = 2 * cfg.num_layers * self.geometry.nbytes
        self.binding.bind_input("attention_mask", self.attention_mask)
        for i, (k, v) in enumerate(self.kv):
            for name, t in ((cfg.past_key % i, k), (cfg.past_value % i, v)):
                self.binding.bind_input(name, t)
            self.binding.bind_output(cfg.present_key % i, k)
            self.binding.bind_output(cfg.present_value % i, v)

    def _grow(self, needed: int) -> None:
        """Make room for ``needed`` positions (growing policy). With a VMM arena only the
        logical capacity grows (pages are committed per step, nothing moves); otherwise KV and
        mask are reallocated, the live prefixes copied and the captured graph invalidated."""
        new_cap = kvgeo.round_capacity(max(needed, 2 * self.capacity), self.max_capacity, multiple=16)
        self.counters.growth_events += 1
        if self.vmm:
            self.capacity = new_cap
            return
        old_kv, old_mask, old_cap = self.kv, self.attention_mask, self.capacity
        lengths = [int(x) for x in self.lengths]
        copies = kvgeo.growth_copies(self.geometry, new_cap, lengths)
        self._allocate_kv(new_cap)
        for (ok, ov), (nk, nv) in zip(old_kv, self.kv):
            for old, new in ((ok, nk), (ov, nv)):
                if self.kv_layout == "head_major":
                    new[:, :, :old_cap] = old
                else:
                    new[:, :old_cap] = old
        self.attention_mask[:, :old_cap] = old_mask
        self.counters.kv_bytes_moved += 2 * self.model.config.num_layers * sum(c[2] for c in copies)
        self.capture.invalidate("KV buffers reallocated by growth")

    def _ensure_committed(self, upto: int) -> None:
        """Back positions ``[0, upto)`` of every row before a kernel writes them.

        Commits in whole pages' worth of positions past a high-water mark, so a decode step
        costs one comparison unless a row enters a new page (the request list is built then).
        """
        if upto <= self._committed_len:
            return
        g = self.geometry
        per_position = g.head_size * g.itemsize * (g.kv_heads if g.layout == "seq_major" else 1)
        chunk = max(1, self._page // per_position)
        new = min(g.capacity, -(-upto // chunk) * chunk)
        B = self.batch
        reqs = [KVRequest(o, n) for o, n in kvgeo.commit_requests(
            g, [self._committed_len] * B, [new] * B, page=self._page)]
        if reqs:
            self.counters.kv_committed_bytes += sum(
                self.provider.kv_commit(t, reqs) for pair in self.kv for t in pair)
        self._committed_len = new

    # -- requests --------------------------------------------------------------------------

    def check_prompts(self, input_ids: Sequence[Sequence[int]], max_new_tokens: int = 1) -> None:
        """Validate a request without touching device state.

        Raises:
            RequestError: wrong row count, an empty row, a token outside [0, vocab), a negative
                max_new_tokens, or prompt + max_new_tokens - 1 positions beyond the capacity
                (fixed policy) or the model context (growing policy) (CASES 15).
        """
        cfg = self.model.config
        if len(input_ids) != self.batch:
            raise RequestError(f"this session has batch {self.batch}; got {len(input_ids)} prompts")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
        limit = self.capacity if self.kv_policy == "fixed" else self.max_capacity
        for b, row in enumerate(input_ids):
            if len(row) == 0:
                raise RequestError(f"prompt {b} is empty; every row needs at least one token")
            arr = np.asarray(row)
            if arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= cfg.vocab_size:
                raise RequestError(f"prompt {b} has token ids outside [0, {cfg.vocab_size})")
            need = len(row) + max(max_new_tokens - 1, 0)
            if need > limit:
                what = "capacity" if self.kv_policy == "fixed" else "maximum capacity"
                raise RequestError(
                    f"prompt {b} has {len(row)} tokens; with max_new_tokens={max_new_tokens} it needs "
                    f"{need} KV positions but the {what} is {limit}")

    def prefill(self, input_ids: Sequence[Sequence[int]]) -> StepOutput:
        """Run the prompts (right-padded to the longest) and choose each row's first token.

        Args:
            input_ids: ``batch`` lists of token ids (lengths may differ).

        Raises:
            RequestError: see :meth:`check_prompts` (nothing on the device changes then).
        """
        self.check_prompts(input_ids, max_new_tokens=1)
        p, cfg, B = self.provider, self.model.config, self.batch
        lens = np.array([len(r) for r in input_ids], np.int64)
        if int(lens.max()) > self.capacity:
            self._grow(int(lens.max()))
        S = int(lens.max())
        ids = np.full((B, S), cfg.pad_token_id, np.int64)
        mask = np.zeros((B, S), np.int64)
        for b, row in enumerate(input_ids):
            ids[b, : len(row)] = row
            mask[b, : len(row)] = 1
        t0 = time.perf_counter()
        self._ensure_committed(S)  # prefill writes S rows of K/V in every row, padding too
        self.binding.bind_input("input_ids", p.upload(ids))
        self.binding.bind_input("attention_mask", p.upload(mask))
        outs = self.binding.run()
        present = outs.get(cfg.present_key % 0)
        if present is not None and present is not self.kv[0][0]:
            raise ProviderError(
                f"provider {p.name!r} returned a new present KV tensor; it must write the shared "
                "past/present buffer in place (past_present_share_buffer, OPS.md 1.3 step 2)")
        self.logits = outs["logits"]
        p.device_argmax(self.logits, p.upload((lens - 1).astype(np.int32)), self.result)
        full = np.zeros(self.attention_mask.shape, np.int64)
        for b, n in enumerate(lens):
            full[b, :n] = 1
        self.attention_mask[...] = p.upload(full)
        self.lengths_dev[...] = p.upload(lens.astype(np.int32))
        self.lengths = lens
        self.binding.bind_input("input_ids", self.input_ids)
        self.binding.bind_input("attention_mask", self.attention_mask)
        out = self._read_result()
        self.counters.prefill_s += time.perf_counter() - t0
        self.counters.prefill_tokens += int(lens.sum())
        self.started = True
        self.capture.reset_request()
        return out

    def step(self, force_tokens: Sequence[int] | None = None) -> StepOutput:
        """One decode step: feed each row's last token (or ``force_tokens``, teacher forcing)
        and choose the next one.

        Raises:
            RequestError: no prefill yet, wrong number of forced tokens, or the KV cache is
                full (fixed policy) / the model context is reached.
        """
        if not self.started:
            raise RequestError("call prefill() before step()")
        p = self.provider
        if force_tokens is not None:
            forced = np.asarray(force_tokens)
            if forced.shape != (self.batch,) or forced.dtype.kind not in "iu":
                raise RequestError(f"force_tokens must be {self.batch} integer token ids")
            vocab = self.model.config.vocab_size
            if forced.min() < 0 or forced.max() >= vocab:
                raise RequestError(f"force_tokens has ids outside [0, {vocab})")
            res = np.zeros((self.batch, 2), np.int32)
            res[:, ARGMAX_TOKEN] = forced
            self.result[...] = p.upload(res)
        needed = int(self.lengths.max()) + 1
        if needed > self.capacity:
            if self.kv_policy == "fixed" or self.capacity >= self.max_capacity:
                raise RequestError(f"KV cache full: a step needs {needed} positions, capacity is "
                                   f"{self.capacity}")
            self._grow(needed)
        t0 = time.perf_counter()
        self._ensure_committed(int(self.lengths.max()) + 1)
        self.capture.run_step()
        self.lengths = self.lengths + 1
        out = self._read_result()
        self.counters.decode_s += time.perf_counter() - t0
        self.counters.decode_steps += 1
        return out

    def decode_step_device(self) -> None:
        """The device work of one decode step; the function a capture records.

        Feeds the argmax result back (decode_advance), runs the graph with S = 1 and selects
        the next tokens into ``result``. Touches only persistent buffers.
        """
        p = self.provider
        p.decode_advance(self.result, self.input_ids, self.attention_mask, self.lengths_dev)
        outs = self.binding.run()
        self.logits = outs["logits"]
        p.device_argmax(self.logits, self.positions, self.result)

    def _read_result(self) -> StepOutput:
        res = self.provider.download(self.result)
        errors = res[:, ARGMAX_ERROR] != 0
        return StepOutput(res[:, ARGMAX_TOKEN].astype(np.int64), errors)

    def last_logits(self) -> np.ndarray:
        """fp32 ``[B, V]`` logits the last step chose from (the prompt's last real position
        after prefill)."""
        host = self.provider.download(self.logits).astype(np.float32)
        if host.shape[1] == 1:
            return host[:, 0]
        return host[np.arange(self.batch), self.lengths - 1]

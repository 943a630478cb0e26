"""``core.run``, ``core.stream`` and ``lockstep run`` as clients of the engine: one decode path.

:func:`core.generation.generate.start` submits each row of a request to an
:class:`~core.engine.Engine` of one slot per row and collects its events; the caller's thread
is the engine's owner (no engine thread), one iteration (:meth:`~core.engine.Engine.run_once`)
per step of the iterator. Each row is then its solo run (docs/engine.md), which is bitwise the
fixed-batch :class:`~core.session.Session`'s row (tests/unit/test_run_engine.py).

What stays as ``run`` had it: the same validation and messages before any kernel runs, one
:class:`~core.generation.stream.Delta` per row and step, finish reasons "eos" (an EOS id),
"stop" (a stop token id or string), "length", "error", "interrupted" (:meth:`EngineStream.interrupt`,
Ctrl-C), rows of 0 tokens ended at once, and the ``progress`` callback. The counters are the
engine's (``engine_requests`` counts the rows it admitted).

A slot holds what a Session's row does: prompt plus ``max_new_tokens`` minus one positions
(the last token's KV is never written), so every request ``run`` takes runs here;
:func:`check_options` refuses the rest with a Session's messages.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Sequence

import numpy as np

from core.engine import Engine, Event, Request
from core.errors import RequestError
from core.generation import sampling as sampling_mod
from core.generation.stream import Delta, Generation, RowState, _max_new, _per_row, eos_ids, per_row_stop_ids
from core.generation.tokens import token_row
from core.runtime import kv as kvgeo


def check_options(runner, model, kv_layout: Any, capacity: Any, weight_budget: Any, device_budget: Any,
                  tensor_parallel: Any) -> None:
    """Refuse what a :class:`~core.session.Session` refuses of ``run``'s options, with its
    messages, before any Runner or rank starts.

    Raises:
        RequestError: a bad ``tensor_parallel``, ``kv_layout`` or ``capacity``; a Runner given
            with another KV layout, with budgets of its own or with ``tensor_parallel`` > 1.
    """
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, (int, np.integer)) \
            or tensor_parallel < 1:
        raise RequestError(f"tensor_parallel must be a positive integer, got {tensor_parallel!r}")
    if tensor_parallel > 1 and runner is not None:
        raise RequestError("tensor_parallel needs a model folder or a loaded Model; a Runner holds one "
                           "provider's unsharded weights")
    if kv_layout is not None and kv_layout not in kvgeo.LAYOUTS:
        raise RequestError(f"kv_layout must be one of {kvgeo.LAYOUTS}, got {kv_layout!r}")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer))):
        raise RequestError(f"capacity must be an integer, got {capacity!r}")
    if runner is not None:
        if kv_layout not in (None, runner.kv_layout):
            raise RequestError(f"this Runner is planned for KV layout {runner.kv_layout!r}, not {kv_layout!r}")
        if (weight_budget is not None and weight_budget != runner.weight_budget) or device_budget is not None:
            raise RequestError("a Session on a Runner uses the runner's budgets; make a Runner with "
                               "weight_budget= / device_budget= instead")
    context = model.config.context_length
    if capacity is not None and not 1 <= capacity <= context:
        raise RequestError(f"capacity must be in [1, {context}] (the model context), got {capacity!r}")


def engine_capacity(input_ids: Sequence[Sequence[int]], news: Sequence[int]) -> int:
    """KV positions a slot needs for the rows, counted as a Session counts them: prompt plus
    ``max_new_tokens`` minus one (the last token's KV is never written; a step queued ahead
    past it writes at the slot's start instead, :meth:`core.engine.slots.SlotState.decode`)."""
    return max(len(r) + max(n - 1, 0) for r, n in zip(input_ids, news))


def check_fit(input_ids: Sequence[Sequence[int]], news: Sequence[int], limit: int) -> None:
    """Refuse a row that needs more than ``limit`` KV positions (:func:`check_rows`'s message),
    before tensor parallel's ranks start.

    Raises:
        RequestError: prompt + max_new_tokens - 1 > limit for some row.
    """
    for b, (row, m) in enumerate(zip(input_ids, news)):
        need = len(row) + max(m - 1, 0)
        if need > limit:
            raise RequestError(f"prompt {b} has {len(row)} tokens; with max_new_tokens={m} it needs {need} KV "
                               f"positions but the capacity is {limit}")


def check_rows(runner, input_ids: Sequence[Sequence[int]], max_new_tokens: Any, sampling: Any, stop: Any,
               stop_token_ids: Any, limit: int) -> tuple[list[int], list, list, list]:
    """Validate a request as :class:`~core.generation.stream.Generation` and
    :meth:`core.session.Session.check_prompts` do (the same messages), against ``limit`` KV
    positions per row. Returns per row: ``max_new_tokens``, seeded
    :class:`~core.generation.sampling.SamplingParams`, stop strings and stop token ids.

    Raises:
        RequestError: as :class:`~core.generation.stream.Generation` (nothing runs then).
    """
    model, batch = runner.model, len(input_ids)
    news = [_max_new(m) for m in _per_row("max_new_tokens", max_new_tokens, batch, (int, np.integer))]
    vocab = model.config.vocab_size
    for b, (row, m) in enumerate(zip(input_ids, news)):
        arr = token_row(b, row)
        if arr.min() < 0 or arr.max() >= vocab:
            raise RequestError(f"prompt {b} has token ids outside [0, {vocab}): {int(arr.min())}..{int(arr.max())}")
        need = len(arr) + max(m - 1, 0)
        if need > limit:
            raise RequestError(f"prompt {b} has {len(arr)} tokens; with max_new_tokens={m} it needs {need} KV "
                               f"positions but the capacity is {limit}")
    try:
        params = sampling_mod.resolve_rows(sampling, batch, sampling_mod.search_defaults(model.config.search))
    except sampling_mod.SamplingError as exc:
        raise RequestError(str(exc)) from None
    if not all(r.greedy_plain for r in params) and not hasattr(runner.provider, "device_sample"):
        raise RequestError(f"provider {runner.provider.name!r} has no device_sample; it decodes greedily only "
                           "(do_sample=False, repetition_penalty=1)")
    stops = Generation._per_row_stops(stop, batch)
    stop_ids = per_row_stop_ids(stop_token_ids, batch, vocab)
    if model.tokenizer is None and any(stops):
        raise RequestError("stop strings need a tokenizer; this model has no tokenizer.json")
    return news, params, stops, stop_ids


class EngineStream:
    """A request's rows on an engine, iterated as :class:`~core.generation.stream.Delta` objects
    (the interface of :class:`~core.generation.generate.Stream`; ``session`` is None).

    Args:
        runner: the :class:`~core.runtime.runner.Runner` (its lock is held around each engine
            iteration, so threads may share it, as with sessions).
        input_ids: one token-id list per row.
        max_new_tokens, sampling, stop, stop_token_ids: as :func:`core.run` takes them.
        progress: optional ``callable(done, total)``: (0, total) before the first prefill, then
            (the most tokens any row has, total) each time that grows.
        capacity: KV positions per slot (at least :func:`engine_capacity` of the rows).
        capture: graph capture of the decode buckets (None: where the provider captures).

    Raises:
        RequestError: a bad request (:func:`check_rows`), checked before the engine is made.
    """

    session = None

    def __init__(self, runner, input_ids: Sequence[Sequence[int]], max_new_tokens: Any = 64, sampling: Any = None,
                 stop: Any = None, stop_token_ids: Any = None, progress=None, capacity: int = 2,
                 capture: bool | None = None):
        if progress is not None and not callable(progress):
            raise RequestError(f"progress must be a callable (step, total), got {type(progress).__name__}")
        news, self.sampling, stops, stop_ids = check_rows(runner, input_ids, max_new_tokens, sampling, stop,
                                                          stop_token_ids, capacity)
        self.runner, self.progress = runner, progress
        self.rows = [RowState([int(t) for t in ids], n, s, i)
                     for ids, n, s, i in zip(input_ids, news, stops, stop_ids)]
        self.eos = eos_ids(runner.model)
        self._deltas: list[Delta] = [Delta(b, [], "", "length") for b, n in enumerate(news) if n == 0]
        for d in self._deltas:
            self.rows[d.row].finish_reason = "length"
        live = [b for b, n in enumerate(news) if n > 0]
        self.total, self._done, self._shut = max(news), -1, False
        with runner.lock:
            # the rows arrive together and nothing decodes yet: whole prompts, all in the first
            # iteration, in padded runs of alike lengths (core.engine.prefill.Prefills)
            prompt_tokens = sum(len(self.rows[b].prompt_ids) for b in live)
            self.engine = Engine(runner, max_batch=max(len(live), 1), capacity=capacity, max_waiting=max(len(live), 1),
                                 capture=capture, prefill_tokens=max(prompt_tokens, 1), prefill_chunk=None,
                                 reraise=True)
            self.counters = self.engine.counters
            self._requests: dict[int, Request] = {}
            # longest prompt first: alike lengths take consecutive slots, one prefill run each
            for b in sorted(live, key=lambda b: -len(self.rows[b].prompt_ids)):
                req = self.engine.request(self.rows[b].prompt_ids, news[b], self.sampling[b], list(stops[b]) or None,
                                          sorted(stop_ids[b]) or None, sink=functools.partial(self._event, b))
                self._requests[b] = req
                self.engine.add(req)
        if not live:
            self._close()

    def _event(self, b: int, event: Event) -> None:
        """An engine event of row ``b`` as the row's delta (finish reasons as ``run`` names them)."""
        row, req = self.rows[b], self._requests[b]
        row.output_ids.extend(event.token_ids)
        reason = event.finish_reason
        if reason == "stop" and event.token_ids and event.token_ids[-1] in self.eos:
            reason = "eos"  # an EOS id ends a row with "eos" in run (checked before stop token ids)
        elif reason == "abort":
            reason = "interrupted"
        row.text += event.text
        if reason is not None:
            row.finish_reason = reason
            row.stop = None if reason == "eos" else req.stop
        self._deltas.append(Delta(b, list(event.token_ids), event.text, reason))
        done = max(len(r.output_ids) for r in self.rows)
        if self.progress is not None and done > self._done:
            self._done = done
            self.progress(done, self.total)

    def __iter__(self) -> Iterator[Delta]:
        while True:
            while self._deltas:
                yield self._deltas.pop(0)
            if all(r.finish_reason is not None for r in self.rows):
                self._close()
                return
            if self.progress is not None and self._done < 0:
                self._done = 0
                self.progress(0, self.total)
            with self.runner.lock:
                try:
                    self.engine.run_once()
                    self._deltas.sort(key=lambda d: d.row)  # rows in order, as a fixed batch gives them
                except BaseException:  # a failed step raises to the caller, as on a Session
                    self._shut = True  # the engine's state is unknown: its buffers go with it
                    self.engine.slots.close()
                    raise

    def interrupt(self) -> list[Delta]:
        """End every running row now, between steps, keeping what it made (finish reason
        "interrupted"); returns the rows' last deltas. Close the iterator first."""
        with self.runner.lock:
            self._close()
        out, self._deltas = self._deltas, []
        return out

    def _close(self) -> None:
        """Shut the engine down (a row still running ends "interrupted") and give its KV back."""
        if not self._shut:
            self._shut = True
            self.engine.shutdown()

    def run(self) -> list[RowState]:
        """Iterate to the end; returns the rows."""
        for _ in self:
            pass
        return self.rows

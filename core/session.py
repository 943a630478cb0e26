"""Session: a batch of N sequences decoded in lockstep, the public face of the runtime.

A :class:`Session` validates requests and drives one :class:`~core.runtime.state.DecodeState`
on a :class:`~core.runtime.runner.Runner` (made for the session unless one is passed in):

    Session(model) -> Runner (plan, weights; shared) + DecodeState (buffers, KV; per batch)
    prefill(ids)   -> step.prefill(state, ids)               (right-padded to the longest)
    step()         -> state.capture.run(...)                  (step.decode_step, captured)

Prompts are right-padded (GQA semantics, docs/ops.md 1.4): prefill runs with a mask of width
S = the longest prompt; every decode step runs S = 1 against the full ``[B, stride]`` mask, so
row b's past is ``seqlens_k[b]`` whatever the other rows hold. The decode loop never computes
an argmax itself: the provider's ``device_argmax`` and ``decode_advance`` do, and only the
``[B, 2]`` result comes back to the host.
"""

from __future__ import annotations

import functools
import time
import weakref
from pathlib import Path
from typing import Any, Callable, ParamSpec, Sequence, TypeVar

import numpy as np

from core import compiling
from core.counters import Counters
from core.errors import RequestError, StaleGenerationError  # noqa: F401 (re-exported)
from core.generation import sampling as sampling_mod
from core.generation.sampling import SamplingParams
from core.generation.tokens import _short, token_row
from core.models.model import Model
from core.runtime import kv as kvgeo
from core.runtime import step as steps
from core.runtime.prompts import GROUPING
from core.runtime.residency import BudgetError
from core.runtime.runner import Runner
from core.runtime.step import StepOutput

__all__ = ["MAX_UNREAD", "PendingStep", "RequestError", "Session", "StaleGenerationError", "StepOutput",
           "token_row"]


_P = ParamSpec("_P")
_T = TypeVar("_T")


def serialised(method: Callable[_P, _T]) -> Callable[_P, _T]:
    """Run ``method`` holding its session's runner lock (:attr:`core.runtime.runner.Runner.lock`):
    two threads on one Runner run their calls one after the other, never interleaved. (A
    session without a Runner in this process, a tensor-parallel one, has nothing to lock.)"""
    @functools.wraps(method)
    def locked(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        runner = getattr(args[0], "runner", None)
        if runner is None:
            return method(*args, **kwargs)
        with runner.lock:
            return method(*args, **kwargs)
    return locked


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise RequestError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


#: Decode steps a session may have queued and unread at once (:meth:`Session.step_async`):
#: two keep the device busy while the host reads one step and queues the next.
MAX_UNREAD = 2


class PendingStep:
    """A decode step queued on the device whose tokens the host has not read yet
    (:meth:`Session.step_async`).

    Attributes:
        queued_at: host clock (``time.perf_counter``, seconds) when it was queued.
        discarded: True once :meth:`Session.discard` dropped it.
        device_s: once read, the device seconds of its work (the provider's node timer: from
            the queue reaching the step to its last kernel), or None without a timer.
    """

    def __init__(self, session: Session, download: Any, queued_at: float, marks: tuple):
        self._session, self._download, self._marks = session, download, marks
        self.queued_at = queued_at
        self.discarded = False
        self.device_s: float | None = None
        self._out: StepOutput | None = None

    @classmethod
    def finished(cls, session: Session, out: StepOutput) -> PendingStep:
        """A step already run and read (a session that steps synchronously)."""
        step = cls(session, None, time.perf_counter(), (None, None))
        step._out = out
        return step

    @property
    def read(self) -> bool:
        """True once :meth:`result` has returned (or a later step's read read this one)."""
        return self._out is not None

    def result(self) -> StepOutput:
        """The step's tokens; waits for the step's result copy (and reads every step queued
        before it first, in order).

        Raises:
            RequestError: the step was discarded, or its session is closed.
        """
        if self.discarded:
            raise RequestError("this decode step was discarded (Session.discard, or a step(), prefill() or "
                               "rewind() call after it was queued); it has no result")
        if self._out is None:
            self._session._check_open()
            self._session._read(self)
        assert self._out is not None
        return self._out


class Session:
    """A batch of ``batch`` sequences decoded in lockstep on one provider.

    Args:
        model: a model folder, a loaded :class:`~core.models.model.Model`, or a
            :class:`~core.runtime.runner.Runner` (its provider and KV layout are then used:
            the session uploads no weight).
        provider: a provider name (see ``lockstep providers``) or provider object.
        batch: number of rows N, fixed for the session's life.
        capacity: KV positions per row (tokens). Default: min(256, max_capacity), growing as needed.
        kv_layout: "head_major" ([B, Nkv, S, H], the builder's BNSH) or "seq_major" ([B, S, Nkv, H]).
        kv_policy: "fixed" (capacity is a hard limit) or "growing" (see
            :class:`~core.runtime.kv.KVCache`: a larger bucket when a step needs it, or with
            VMM pages committed under a fixed reservation). Default: "growing" when capacity
            is None, else "fixed".
        capture: use graph capture for decode steps when the provider supports it (None = auto).
        max_capacity: the most positions a growing session may reach (default: the model
            context); with VMM this is the reserved stride.
        weight_budget: device bytes for the weights (see :class:`~core.runtime.runner.Runner`);
            with a Runner, it must be None or the runner's own budget.
        device_budget: device bytes for weights and KV together (the elastic budget of
            :class:`~core.runtime.runner.Runner`); with a Runner, None.
        all_logits: prefill keeps the logits of every prompt position (:meth:`prompt_logits`;
            teacher-forced checks of the prompt). Default False: only each row's last prompt
            position is computed (logits [B, 1, V]), and rows of very different lengths are
            prefilled in length groups without computing their padding (core.runtime.prompts).
        prefill_groups: "auto" (length groups when padding would at least double the work),
            "off" (one padded run) or "always" (the groups whatever the lengths).
        tensor_parallel: ranks R; R >= 2 makes a
            :class:`~core.parallel.session.TensorParallelSession` (R rank processes, each
            holding a shard; docs/parallel.md). Default 1: this process, unsharded.
        run_ahead: let the decode loops (:func:`core.generation.loop.decode`,
            :class:`~core.generation.stream.Generation`) queue the next decode step before they
            read this one's tokens (:meth:`step_async`), so the host's work between steps
            overlaps the device's. Default True. A step queued for a generation that then ends
            is discarded (:meth:`discard`): the session's state is as if it never ran.

    Raises:
        RequestError: bad batch/capacity/layout/policy values (seq_major + growing at batch > 1
            is refused: growth would relocate every row b > 0), checked before any upload.
        core.plugins.ProviderError: unknown provider (lists the installed ones).
        core.models.model.ModelError: the model folder is missing or incomplete.
        core.executor.UnsupportedOpError: the provider cannot run some graph node.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        """A :class:`~core.parallel.session.TensorParallelSession` when ``tensor_parallel`` > 1."""
        tp = kwargs.get("tensor_parallel", 1)
        if cls is Session and isinstance(tp, (int, np.integer)) and not isinstance(tp, bool) and tp > 1:
            from core.parallel.session import TensorParallelSession

            return super().__new__(TensorParallelSession)
        return super().__new__(cls)

    def __init__(self, model: str | Path | Model | Runner, provider: Any = "cpu_reference", batch: int = 1,
                 capacity: int | None = None, kv_layout: str = "head_major",
                 kv_policy: str | None = None, capture: bool | None = None,
                 max_capacity: int | None = None, weight_budget: int | float | str | None = None,
                 device_budget: int | str | None = None, all_logits: bool = False,
                 prefill_groups: str = "auto", tensor_parallel: int = 1, run_ahead: bool = True):
        if _positive_int("tensor_parallel", tensor_parallel) != 1:
            raise RequestError("Session(tensor_parallel=R > 1) is a TensorParallelSession; pass it by keyword")
        batch = _positive_int("batch", batch)
        if prefill_groups not in GROUPING:
            raise RequestError(f"prefill_groups must be one of {GROUPING}, got {prefill_groups!r}")
        if not isinstance(run_ahead, bool):
            raise RequestError(f"run_ahead must be True or False, got {run_ahead!r}")
        if capture is not None and not isinstance(capture, bool):  # "no" is truthy: refuse, not guess
            raise RequestError(f"capture must be True, False or None, got {capture!r}")
        if not isinstance(all_logits, bool):
            raise RequestError(f"all_logits must be True or False, got {all_logits!r}")
        self.run_ahead = run_ahead
        self._unread: list[PendingStep] = []  # queued decode steps not read yet, oldest first
        self._last_raw: np.ndarray | None = None  # the [B, 2] result of the last step read
        self._read_at = 0.0  # host clock of the last read
        self._compiled_at = compiling.seconds()  # the process's compile seconds at the last read
        self._logits_stale = False  # a discarded step overwrote the logits of the last one read
        self.all_logits, self.prefill_groups = bool(all_logits), prefill_groups
        self._prefilled_at = -1
        if kv_layout not in kvgeo.LAYOUTS:
            raise RequestError(f"kv_layout must be one of {kvgeo.LAYOUTS}, got {kv_layout!r}")
        kv_policy = kv_policy or ("growing" if capacity is None else "fixed")
        if kv_policy not in kvgeo.POLICIES:
            raise RequestError(f"kv_policy must be one of {kvgeo.POLICIES}, got {kv_policy!r}")
        if kv_policy == "growing" and kv_layout == "seq_major" and batch > 1:
            raise RequestError(
                "a growing seq_major KV cache at batch > 1 would relocate every sequence b > 0; "
                "use kv_layout='head_major' or kv_policy='fixed'")
        if max_capacity is not None:
            max_capacity = _positive_int("max_capacity", max_capacity)
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer))):
            raise RequestError(f"capacity must be an integer, got {capacity!r}")
        if isinstance(model, Runner):
            if kv_layout != model.kv_layout:
                raise RequestError(f"this Runner is planned for KV layout {model.kv_layout!r}, not {kv_layout!r}")
            if (weight_budget is not None and weight_budget != model.weight_budget) or device_budget is not None:
                raise RequestError("a Session on a Runner uses the runner's budgets; make a Runner with "
                                   "weight_budget= / device_budget= instead")
            self.runner = model
        else:
            try:
                self.runner = Runner(model, provider, kv_layout, weight_budget=weight_budget,
                                     device_budget=device_budget, reserve_for=(batch, capacity or 256))
            except (kvgeo.KVLayoutError, BudgetError) as exc:
                raise RequestError(str(exc)) from exc
        cfg = self.model.config
        context = cfg.context_length
        self.max_capacity = min(max_capacity or context, context)
        if capacity is None:
            capacity = min(256, self.max_capacity)
        if not 1 <= capacity <= context:
            raise RequestError(f"capacity must be in [1, {context}] (the model context), got {capacity!r}")
        if self.max_capacity < capacity:
            raise RequestError(f"max_capacity ({self.max_capacity}) is below capacity ({capacity})")
        self.batch, self.kv_layout, self.kv_policy = batch, kv_layout, kv_policy
        self.counters = Counters()
        self.counters.set_residency(self.runner.residency.summary(), self.runner.weight_bytes)
        self.counters.mark_experts(self.runner)  # expert paging counted from here
        self.state = self.runner.acquire_state(batch, int(capacity), self.max_capacity, kv_policy, capture,
                                               self.counters)
        self._release = weakref.finalize(self, self.runner.release_state, self.state)
        self._timer = self.provider.node_timer()
        self._release_marks = getattr(self._timer, "release", None)  # optional: reuse read marks
        #: per-row sampling options of the current request (seeds resolved)
        self.sampling: list[SamplingParams] = []
        #: counts the requests and continuations started here (each prefill() and rewind()): a
        #: :class:`~core.generation.stream.Generation` remembers the one it drives and refuses
        #: to step the session once another began (:class:`StaleGenerationError`)
        self.request_id = 0

    # -- what the session is made of -------------------------------------------------------
    @property
    def model(self) -> Model:
        """The loaded model."""
        return self.runner.model

    @property
    def provider(self):
        """The execution provider."""
        return self.runner.provider

    @property
    def plan(self):
        """The runner's executor plan (shared with every session on the runner)."""
        return self.runner.plan

    @property
    def capacity(self) -> int:
        """KV positions per row the cache holds now."""
        return self.state.kv.capacity

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[B]``: tokens in each row's KV cache (the host mirror of the device lengths)."""
        return self.state.lengths

    @property
    def started(self) -> bool:
        """True once a prefill ran for the current request."""
        return self.state.started

    @serialised
    def close(self) -> None:
        """Give the decode state back to the runner's pool (also done when the session is
        garbage-collected); the session cannot be used afterwards. Steps queued and unread are
        dropped (their results are never read; the state's next user starts a new request)."""
        for q in self._unread:
            q.discarded = True
        self._unread.clear()
        self._release()

    # -- requests --------------------------------------------------------------------------
    def check_prompts(self, input_ids: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 1) -> None:
        """Validate a request without touching device state.

        Args:
            input_ids: ``batch`` token-id lists.
            max_new_tokens: new tokens per row: one int for every row, or one per row (each
                row is checked against its own prompt).

        Raises:
            RequestError: ``input_ids`` not a list of rows, wrong row count, a row that is not a
                flat list of ints (nested, None, float, bool or str ids; the message names the
                token), an empty row, a token outside [0, vocab), a negative max_new_tokens, or
                prompt + max_new_tokens - 1 positions beyond the capacity (fixed policy) or the
                maximum capacity (growing policy) (docs/cases.md 15).
        """
        self._check_open()
        cfg = self.model.config
        if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence | np.ndarray) \
                or (isinstance(input_ids, np.ndarray) and input_ids.ndim == 0):
            raise RequestError(f"input_ids must be a list of {self.batch} token-id lists, got {_short(input_ids)}")
        if len(input_ids) != self.batch:
            raise RequestError(f"this session has batch {self.batch}; got {len(input_ids)} "
                               f"{'prompt' if len(input_ids) == 1 else 'prompts'}")
        per_row = isinstance(max_new_tokens, (list, tuple))
        news: list[Any] = list(max_new_tokens) if per_row else [max_new_tokens] * self.batch  # type: ignore[arg-type]
        if len(news) != self.batch:
            raise RequestError(f"max_new_tokens has {len(news)} values for {self.batch} rows")
        for m in news:
            if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
                raise RequestError(f"max_new_tokens must be a non-negative integer, got {m!r}")
        limit = self.state.kv.limit
        for b, (row, m) in enumerate(zip(input_ids, news)):
            arr = token_row(b, row)
            if arr.min() < 0 or arr.max() >= cfg.vocab_size:
                raise RequestError(f"prompt {b} has token ids outside [0, {cfg.vocab_size}): "
                                   f"{int(arr.min())}..{int(arr.max())}")
            need = len(arr) + max(int(m) - 1, 0)
            if need > limit:
                what = "capacity" if self.kv_policy == "fixed" else "maximum capacity"
                raise RequestError(
                    f"prompt {b} has {len(arr)} tokens; with max_new_tokens={m} it needs "
                    f"{need} KV positions but the {what} is {limit}")

    def check_sampling(self, sampling: Any = None) -> list[SamplingParams]:
        """Validated, seeded sampling options per row (see :func:`core.generation.sampling.resolve_rows`;
        defaults from the model's genai_config.json "search").

        Raises:
            RequestError: an unknown option, a value out of range, a wrong row count, or a
                sampled row on a provider without ``device_sample``.
        """
        try:
            rows = sampling_mod.resolve_rows(sampling, self.batch,
                                             sampling_mod.search_defaults(self.model.config.search))
        except sampling_mod.SamplingError as exc:
            raise RequestError(str(exc)) from None
        if not all(r.greedy_plain for r in rows) and not hasattr(self.provider, "device_sample"):
            raise RequestError(f"provider {self.provider.name!r} has no device_sample; it decodes greedily only "
                               "(do_sample=False, repetition_penalty=1)")
        return rows

    @serialised
    def set_sampling(self, rows: Sequence[SamplingParams], history: Sequence[Sequence[int]] | None = None) -> None:
        """Make ``rows`` (from :meth:`check_sampling`) the sampling of every later step and
        write the token ``history`` of each row (what the repetition penalty reads)."""
        self.sampling = list(rows)
        packed = None if all(r.greedy_plain for r in rows) else sampling_mod.pack(rows)
        was = self.state.sampling is not None
        self.state.set_sampling(*(packed or (None, None)))
        if was != (packed is not None):  # device_sample and device_argmax are different steps
            self.state.capture.invalidate("sampling switched " + ("on" if packed else "off"), self.counters)
        if history is not None:
            self.state.write_history(history)

    @serialised
    def rewind(self, lengths: Sequence[int], history: Sequence[Sequence[int]] | None = None) -> None:
        """Cut rows back to ``lengths`` live positions (a finished row that kept stepping
        with the batch drops the tokens past its end) and rewrite the sampling history; the
        next step then feeds position ``lengths[b]``. Used to continue rows (core.generation.stream).

        Raises:
            RequestError: no prefill yet, a wrong row count, a length beyond the row's own, or a
                row cut back by more positions than a ring KV cache keeps
                (:attr:`core.runtime.kv.KVCache.rewind_limit`, docs/kv-geometry.md).
        """
        self._check_open()
        new = np.asarray(lengths, np.int64)
        if not self.state.started:
            raise RequestError("call prefill() before rewind()")
        if new.shape != (self.batch,) or (new < 1).any() or (new > self.state.lengths - len(self._unread)).any():
            raise RequestError(f"rewind needs {self.batch} lengths in [1, the row's length]")
        limit = self.state.kv.rewind_limit
        if limit is not None and (self.state.lengths - new > limit).any():
            raise RequestError(f"rewind cuts a row back by more than {limit} positions, more than the model's "
                               "sliding-window ring KV cache keeps (docs/kv-geometry.md)")
        self._settle()
        self.request_id += 1
        self.state.set_lengths(new)
        if history is not None:
            self.state.write_history(history)

    @serialised
    def prefill(self, input_ids: Sequence[Sequence[int]], sampling: Any = None) -> StepOutput:
        """Run the prompts (right-padded to the longest) and choose each row's first token.

        Args:
            input_ids: ``batch`` lists of token ids (lengths may differ).
            sampling: per-row sampling options (:meth:`check_sampling`); None: the model's
                defaults (greedy unless its genai_config.json says do_sample).

        Raises:
            RequestError: see :meth:`check_prompts` and :meth:`check_sampling` (nothing on the
                device changes then).
        """
        self.check_prompts(input_ids, max_new_tokens=1)
        rows = self.check_sampling(sampling)
        self._settle()
        state = self.state
        self.request_id += 1
        self.set_sampling(rows, input_ids)
        self._compiled_at = compiling.seconds()  # a compile before the prefill is not the prefill's
        t0 = time.perf_counter()
        before = self.runner.stream_meter()
        self.counters.end_decode_span()  # the prefill's expert paging apart from the steps'
        # a fault here leaves the state not started (begin_request): the next prefill rewrites it all
        steps.prefill(state, input_ids, self.all_logits, self.prefill_groups)
        self.runner.outputs_owner = state
        self._prefilled_at = self.counters.decode_steps
        self._count_streamed(tuple(b - a for a, b in zip(before, self.runner.stream_meter())), 0)
        raw = state.runner.provider.download(state.result)
        out = steps.step_output(raw)
        self._last_raw, self._logits_stale = raw, False
        self._read_at = time.perf_counter()
        self.counters.prefill_s += self._read_at - t0 - self._take_compile_s()
        self.counters.prefill_tokens += int(state.lengths.sum())
        state.capture.check(self.counters, "buffers changed between requests")
        return out

    @serialised
    def step(self, force_tokens: Sequence[int] | None = None) -> StepOutput:
        """One decode step: feed each row's last token (or ``force_tokens``, teacher forcing)
        and choose the next one. Steps queued by :meth:`step_async` and not read are
        discarded first (:meth:`discard`).

        Raises:
            RequestError: no prefill yet, wrong number of forced tokens, or the KV cache is
                full (fixed policy) / the maximum capacity is reached.
        """
        forced = self._check_step(force_tokens, ahead=0)
        self._settle()
        return self._queue(forced).result()

    @serialised
    def step_async(self, force_tokens: Sequence[int] | None = None) -> PendingStep:
        """Queue one decode step on the device and return at once; its tokens come from
        :meth:`PendingStep.result`. The step feeds the tokens of the step queued before it
        (the device's own result, never a host round trip), so the host can queue step t + 1
        before it reads step t and the device runs the two back to back. At most
        :meth:`max_unread` steps may be queued and unread. Host-side state that counts steps
        (:attr:`lengths`) includes the queued ones. A provider without ``download_async``
        runs the step synchronously (``result()`` then returns without waiting).

        Raises:
            RequestError: as :meth:`step`, or :meth:`max_unread` steps already unread.
        """
        forced = self._check_step(force_tokens, ahead=len(self._unread))
        limit = self.max_unread()
        if len(self._unread) >= limit:
            raise RequestError(f"{len(self._unread)} decode step(s) are queued and unread (by step_async(), or "
                               f"by a generation still iterating on this session), and {limit} may be; read "
                               "the oldest (PendingStep.result()) before queueing another")
        return self._queue(forced)

    def max_unread(self) -> int:
        """How many steps may be queued and unread now: :data:`MAX_UNREAD`, or 1 while a row
        samples with a repetition penalty (a second queued step would mark, in the row's
        history, a token the first one chose, which a discard cannot take back)."""
        if self.state.sampling is not None and any(r.repetition_penalty != 1.0 for r in self.sampling):
            return 1
        return MAX_UNREAD

    def can_run_ahead(self) -> bool:
        """Whether one more step could be queued now without a host round trip: fewer than
        :meth:`max_unread` unread, and the step fits the KV positions already allocated and
        backed (a growing cache's reallocation or a new page is left to a step queued alone)."""
        state = self.state
        if not (self.run_ahead and state.started and len(self._unread) < self.max_unread()):
            return False  # a tensor-parallel session (no run-ahead) has no local lengths to look at
        needed = int(state.lengths.max()) + 1
        return needed <= min(state.kv.capacity, state.kv.limit) and not state.kv.commit_needed(needed)

    @serialised
    def discard(self, pending: PendingStep) -> None:
        """Drop a queued step that has not been read, and every step queued after it; the
        session's state (lengths, mask, the next step's fed tokens) is put back as if they had
        not run, and the next step computes the same bits it would have. Their device work
        has run or still runs (counted in ``counters.discarded_steps``); the logits buffer
        then holds theirs, so :meth:`last_logits` refuses until the next step. With a
        repetition penalty, a discarded step's fed token stays marked in the row's history:
        the token the next step feeds anyway, unless the discarded step was forced (so a
        penalised session queues at most one step ahead, :meth:`max_unread`). Nothing
        happens for a step already discarded (or dropped by :meth:`close`).

        Raises:
            RequestError: ``pending`` was already read, or belongs to another session.
        """
        if pending.discarded:
            return
        self._check_open()
        if pending not in self._unread:
            raise RequestError("discard() takes a step of this session that has not been read")
        i = self._unread.index(pending)
        if i > 0:
            self._read(self._unread[i - 1])  # its result is what the next step must feed
        dropped = self._unread[:]
        self._unread.clear()
        for q in dropped:
            q.discarded = True
        state = self.state
        state.set_lengths(state.lengths - len(dropped))
        if self._last_raw is not None:
            self.provider.write(state.result, self._last_raw)
        self.counters.discarded_steps += len(dropped)
        self._logits_stale = True

    def _settle(self) -> None:
        """Discard the queued steps nobody read (before a call that must see a settled state)."""
        if self._unread:
            self.discard(self._unread[0])

    def _check_step(self, force_tokens: Sequence[int] | None, ahead: int) -> np.ndarray | None:
        """Validate one more step, ``ahead`` already queued and unread; returns the forced
        tokens as an array (or None)."""
        self._check_open()
        state = self.state
        if not state.started:
            raise RequestError("call prefill() before step()")
        forced = None
        if force_tokens is not None:
            forced = np.asarray(force_tokens)
            if forced.shape != (self.batch,) or forced.dtype.kind not in "iu":
                raise RequestError(f"force_tokens must be {self.batch} integer token ids")
            vocab = self.model.config.vocab_size
            if forced.min() < 0 or forced.max() >= vocab:
                raise RequestError(f"force_tokens has ids outside [0, {vocab})")
        # a plain step() first discards the unread steps, so it needs the positions of the read ones
        needed = int(state.lengths.max()) + 1 - (len(self._unread) - ahead)
        if needed > state.kv.limit:
            raise RequestError(f"KV cache full: a step needs {needed} positions, the "
                               f"{'capacity' if self.kv_policy == 'fixed' else 'maximum capacity'} "
                               f"is {state.kv.limit}")
        return forced

    def _queue(self, forced: np.ndarray | None) -> PendingStep:
        """Queue one validated decode step and the download of its result. When anything in
        it fails (a kernel, an allocation, a copy, Ctrl-C), the session is put back as it was
        after its last read step (:meth:`_recover`) and the error propagates."""
        try:
            return self._queue_step(forced)
        except BaseException:
            self._recover()
            raise

    def _recover(self) -> None:
        """After a failed step: wait for the device work already queued, drop the unread steps
        and rewrite the device lengths, mask and fed tokens from the host, as :meth:`discard`
        does, so the same step can run again and compute the same bits. The wait lets nothing
        of the failed step outlive the call (a dropped step's staging copy, its events, its
        kernels) and makes an asynchronous device error surface here, in the failed request,
        not in the next one. If that fails too, the state is marked broken: the runner drops it
        at close instead of pooling it, and the session refuses further steps."""
        state = self.state
        try:
            self.provider.synchronize()
            dropped = self._unread[:]
            self._unread.clear()
            for q in dropped:
                q.discarded = True
            state.set_lengths(state.lengths - len(dropped))
            if self._last_raw is not None:
                self.provider.write(state.result, self._last_raw)
            self._logits_stale = True
            state.capture.invalidate("a decode step failed", self.counters)
        except BaseException:
            state.broken = True
            raise

    def _queue_step(self, forced: np.ndarray | None) -> PendingStep:
        state = self.state
        t0 = time.perf_counter()
        needed = int(state.lengths.max()) + 1
        if self._unread and (needed > state.kv.capacity or state.kv.commit_needed(needed)):
            self.provider.synchronize()  # growth or a new page (and the re-plan it may bring) moves buffers in use
        if forced is not None:
            steps.force_tokens(state, forced)
        state.reserve(needed)
        timer = self._timer
        start = timer.mark() if timer is not None else None
        self._count_streamed(state.capture.run(self.counters), self.batch)
        end = timer.mark() if timer is not None else None
        self.runner.outputs_owner = state
        download = steps.start_read(state)
        state.advanced()
        if self._unread:
            self.counters.run_ahead_steps += 1
        pending = PendingStep(self, download, t0, (start, end))
        self._unread.append(pending)
        return pending

    def _take_compile_s(self) -> float:
        """Kernel compile seconds since the last read (:mod:`core.compiling`), now counted in
        ``compile_s``: a one-off compile is kept out of ``prefill_s`` and ``decode_s``."""
        now = compiling.seconds()
        spent, self._compiled_at = now - self._compiled_at, now
        self.counters.compile_s += spent
        return spent

    @serialised
    def _read(self, pending: PendingStep) -> None:
        """Read ``pending`` and every unread step queued before it, in order."""
        while self._unread:
            q = self._unread[0]
            try:
                raw = q._download.wait()
            except BaseException:  # a failed read: the session goes back to its last read step
                self._recover()
                raise
            self._unread.pop(0)
            now = time.perf_counter()
            q._out = steps.step_output(raw)
            self._last_raw = raw
            self._logits_stale = False
            c = self.counters
            c.decode_s += max(now - max(q.queued_at, self._read_at) - self._take_compile_s(), 0.0)
            self._read_at = now
            c.decode_steps += 1
            start, end = q._marks
            if self._timer is not None and start is not None and end is not None:
                q.device_s = self._timer.seconds(start, end)
                c.decode_device_s += q.device_s
                if self._release_marks is not None:
                    self._release_marks(start, end)
            if q is pending:
                return
        raise RequestError("this step was not queued by this session, or was already read")

    def stream(self, input_ids: Sequence[Sequence[int]], max_new_tokens: Any = 64, **kwargs):
        """A :class:`~core.generation.stream.Generation` of ``input_ids`` on this session:
        iterate it for per-row :class:`~core.generation.stream.Delta` objects; ``extend()`` it to
        continue rows. Keyword arguments: ``sampling``, ``stop``, ``stop_token_ids``, ``progress``.

        Raises:
            RequestError: a bad request (validated before any kernel runs).
        """
        from core.generation.stream import Generation

        return Generation(self, input_ids, max_new_tokens, **kwargs)

    @serialised
    def last_logits(self) -> np.ndarray:
        """fp32 ``[B, V]`` logits the last step chose from (the prompt's last real position
        after prefill).

        Raises:
            RequestError: no prefill yet, or another Session on the same Runner ran since this
                one's last step (the plan's logits buffer then holds that session's values).
        """
        self._check_logits_owner("last_logits()")
        host = self.provider.download(self.state.logits).astype(np.float32)
        if host.shape[1] == 1:
            return host[:, 0]
        return host[np.arange(self.batch), self.state.lengths - 1]

    @serialised
    def prompt_logits(self) -> np.ndarray:
        """fp32 ``[B, S, V]``: the last prefill's logits at every prompt position (S the
        longest prompt; a row's positions past its length are padding).

        Raises:
            RequestError: the session was made without ``all_logits=True``, or no prefill ran
                since the last decode step.
        """
        self._check_open()
        if not self.all_logits:
            raise RequestError("prompt_logits() needs a Session made with all_logits=True")
        if not self.started or self._prefilled_at != self.counters.decode_steps:
            raise RequestError("prompt_logits() reads the last prefill; call it before step()")
        self._check_logits_owner("prompt_logits()")
        return self.provider.download(self.state.logits).astype(np.float32)

    def _check_logits_owner(self, what: str) -> None:
        if self._unread or self._logits_stale:
            raise RequestError(f"{what}: a decode step queued ahead (run_ahead) has run or is running, and the "
                               "logits buffer holds its values, not those of the last step read; make the "
                               "Session with run_ahead=False to read logits while decoding")
        if self.state.logits is None:
            raise RequestError(f"{what} reads the last prefill or step; call prefill() first")
        if self.runner.outputs_owner is not self.state and not self.state.logits_are_own():
            raise RequestError(f"{what}: another Session on the same Runner ran since this one's last "
                               "prefill or step, and the Runner's logits buffer now holds its values; call "
                               f"{what} right after this session's step(), or give each session its own Runner")

    def _count_streamed(self, done: tuple, decode_tokens: int) -> None:
        self.counters.count_experts(self.runner, decode_tokens)  # read lazily (Counters.count_experts)
        if done:
            self.counters.add_streamed(done[0], done[1], self.runner.residency.slots, decode_tokens)

    def _check_open(self) -> None:
        if not self._release.alive:
            raise RequestError("this session is closed")
        if getattr(self.state, "broken", False):
            raise RequestError("this session's decode state was left unusable by a failed step whose "
                               "recovery failed too; close it and make a new Session")

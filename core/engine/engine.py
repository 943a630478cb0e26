"""The engine: continuous batching over one Runner, with one owner of the step loop.

Requests arrive and leave at any time. One owner (the engine's thread, :meth:`Engine.start`, or
the caller of :meth:`Engine.run_once`) drives the Runner; everyone else talks to it through a
command queue (add, abort, shutdown). Each iteration of the loop:

1. drains the commands (queue new requests, abort requests: a waiting one leaves the queue,
   a running one frees its slot now, before the next step);
2. admits waiting requests into free slots (:class:`~core.engine.scheduler.Scheduler`) and
   prefills each alone into its slot (:meth:`~core.engine.slots.SlotState.prefill`), in
   chunks of ``prefill_chunk`` positions on a fixed grid of absolute positions (a long prompt
   over several iterations, the running rows decoding between them); the last chunk chooses
   its first token;
3. runs one decode step of the smallest bucket covering the running rows and feeds each
   request its token (:meth:`~core.engine.request.Request.feed`); a request that ends frees
   its slot at once, so the next iteration can admit into it. Running ahead (the default), the
   next step is queued before this one is read, so the device never waits for the host; a
   step's tokens go only to rows that still run, each read from the slot it held when the step
   was queued. Before a step is queued, rows left above the smallest bucket that holds them
   move down into free slots (compaction: a copy of each row's state on the device);
4. publishes the events to each request's sink (a prefill's first token before the decode
   step, so the time to first token does not include it).

**Solo equivalence.** A request's tokens equal the same request run alone (a batch-1
:class:`~core.session.Session` with the same capacity, options and seed), whatever else runs:
its prompt is prefilled alone, every decode kernel computes each row alone (Lockstep's batch
invariance), sampling draws from ``(seed, position)`` only, and a padded lane writes only into
its own free slot (tests/unit/test_engine_fuzz.py checks it on random arrivals).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Iterator, Protocol

from core import compiling
from core.engine.logprobs import chosen
from core.engine.prefill import Prefills
from core.engine.request import Event, Request, Sink, make_request
from core.engine.scheduler import Scheduler
from core.errors import RequestError
from core.runtime.kv import round_capacity
from core.runtime.step import step_output

log = logging.getLogger("lockstep")

#: Default KV positions per slot (prompt plus max_tokens), capped by the model's context.
DEFAULT_CAPACITY = 2048
#: Default prompt positions per chunk of a chunked prefill (:class:`Engine` ``prefill_chunk``).
DEFAULT_PREFILL_CHUNK = 256


class StepRunner(Protocol):
    """What an :class:`Engine` reads of its runner: the :class:`~core.runtime.runner.Runner`
    and :class:`~core.parallel.runner.TensorParallelRunner` both are one (no member is probed).

    Attributes:
        model: the (unsharded) :class:`~core.models.model.Model`: config, tokenizer.
        provider: its ``capabilities()`` say whether decode steps may be captured.
        kv_windows: per layer, the sliding window of a ring KV cache (0: a full cache).
        lock: serialises the engine iterations of threads sharing the runner.
    """

    model: Any
    provider: Any
    kv_windows: Any
    lock: Any

    def engine_slots(self, slots: int, capacity: int, capture: bool | None,
                     prefill: list[tuple[int, int]] | None = None) -> Any:
        """The engine's slot state: :class:`~core.engine.slots.SlotState`'s interface (``prefill``,
        ``prefill_rows``, ``decode``, ``move``, ``start_logits``, ``row_logits``, ``close``,
        ``filled``, ``can_sample``, ``capture``) and the :class:`~core.counters.Counters` it
        fills (``counters``), for ``slots`` rows of ``capacity`` positions, with the device
        workspace of its largest ``prefill`` runs ((rows, positions) pairs) reserved."""


class QueueFullError(RequestError):
    """The engine's waiting queue is full (a server answers 429); nothing was queued."""


class EngineClosedError(RequestError):
    """The engine was shut down; it takes no more requests."""


class Handle:
    """A request's events as an iterator (:meth:`Engine.submit`): iteration blocks for the next
    event and stops after the finishing one. With an engine that has no thread, run
    :meth:`Engine.run_until_idle` before iterating."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.request: Request | None = None

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.events.get()
            yield event
            if event.finish_reason is not None:
                return


class Engine:
    """Continuous batching of requests on one Runner (module docstring).

    Args:
        runner: a :class:`StepRunner`: the :class:`~core.runtime.runner.Runner`, or
            :class:`~core.parallel.runner.TensorParallelRunner`; only this engine may drive it.
            Its ``engine_slots(max_batch, capacity, capture)`` makes the engine's slot state.
        max_batch: slots (rows of the KV cache), the largest decode bucket.
        capacity: KV positions per slot (default :data:`DEFAULT_CAPACITY`, at most the model's
            context, rounded up to 64).
        max_waiting: requests that may wait for a slot; :meth:`add` refuses more.
        prefill_tokens: prompt tokens admitted, and prompt positions prefilled, per iteration
            (at least one request, and one chunk).
        prefill_chunk: prompt positions per chunk of a chunked prefill (default
            :data:`DEFAULT_PREFILL_CHUNK`): a prompt runs in chunks ``[kC, (k + 1)C)`` of
            absolute positions, one or more per iteration, with the running rows' decode steps
            between them. None: each prompt in one run. Models with a sliding-window ring KV
            cache prefill whole prompts (cuda runs no chunk into a ring).
        decode_prefill_tokens: prompt positions prefilled per iteration while some row decodes
            (None: ``prefill_tokens``; at least one chunk). One ``prefill_chunk`` gives the
            decoding rows a step after every chunk instead of after ``prefill_tokens`` positions
            (lower inter-token latency, a long prompt's first token later). Where the chunks
            fall never changes, so no bit does.
        capture: graph capture of the decode buckets (None: where the provider supports it).
        run_ahead: queue the next decode step before reading the last one's tokens, so the
            device runs while the host feeds the requests (a row that ended meanwhile computes
            one more step, whose token is dropped).
        compact: move running rows down into slots freed below them, so decode steps run the
            smallest bucket that holds them (:meth:`~core.engine.scheduler.Scheduler.compaction`).
        reraise: a failed prefill or decode step, or a sink that raises, raises out of
            :meth:`run_once` (a batch client such as ``core.run``, whose caller sees the error)
            instead of ending its requests with "error" while the engine serves on (a server).

    Raises:
        RequestError: a bad ``max_batch``, ``capacity``, ``max_waiting``, ``prefill_tokens``,
            ``decode_prefill_tokens`` or ``prefill_chunk``.
    """

    def __init__(self, runner: StepRunner, max_batch: int = 8, capacity: int | None = None, max_waiting: int = 256,
                 prefill_tokens: int = 2048, capture: bool | None = None, run_ahead: bool = True,
                 compact: bool = True, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, reraise: bool = False,
                 decode_prefill_tokens: int | None = None):
        context = runner.model.config.context_length
        checked = [("max_batch", max_batch), ("max_waiting", max_waiting), ("prefill_tokens", prefill_tokens)]
        optional = [(n, v) for n, v in (("prefill_chunk", prefill_chunk), ("decode_prefill_tokens",
                                                                           decode_prefill_tokens)) if v is not None]
        for name, value in checked + optional:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RequestError(f"{name} must be a positive integer, got {value!r}")
        if capacity is None:
            capacity = round_capacity(min(DEFAULT_CAPACITY, context), context)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= context:
            raise RequestError(f"capacity must be an integer in [1, {context}] (the model context), got {capacity!r}")
        self.runner, self.capacity, self.max_batch = runner, capacity, max_batch
        #: positions per prefill chunk (None: whole prompts; always None on a ring KV cache)
        self.prefill_chunk = None if any(runner.kv_windows) else prefill_chunk
        # the step runner makes the slot state (SlotState's interface) and the counters it fills
        # its largest prefill runs: one row's chunk (or whole prompt), and whole prompts of one
        # chunk at most, within an iteration's positions, in every slot (core.engine.prefill)
        chunk = min(capacity, self.prefill_chunk or capacity)
        largest = [(1, chunk), (max_batch, min(chunk, max(prefill_tokens, decode_prefill_tokens or 0)))]
        self.slots = runner.engine_slots(max_batch, capacity, capture, largest)
        self.counters = self.slots.counters
        self.scheduler = Scheduler(max_batch, prefill_tokens, max_waiting)
        self.decode_prefill_tokens = decode_prefill_tokens
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._queued = 0  # added and not yet admitted or aborted (read by add() on any thread)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._next: tuple | None = None  # a command the idle loop woke up on
        self.run_ahead = bool(run_ahead)
        self.compact = bool(compact)
        self.reraise = bool(reraise)
        # (rows at queue time, the result's download, the logits' download or None)
        self._queued_steps: list[tuple[dict[int, Request], Any, Any]] = []
        #: admitted requests whose prompt is not wholly prefilled yet, and their chunks
        self._prefilling = Prefills(self)
        self._compiled_at = compiling.seconds()

    # -- any thread ---------------------------------------------------------------------------
    @property
    def model(self):
        """The runner's model."""
        return self.runner.model

    def request(self, prompt_ids: Any, max_tokens: Any = 16, sampling: Any = None, stop: Any = None,
                stop_token_ids: Any = None, sink: Sink | None = None, request_id: str | None = None,
                logprobs: Any = False) -> Request:
        """A validated request (:func:`core.engine.request.make_request`); :meth:`add` queues it.
        With ``logprobs`` True its events carry each token's log-probability
        (:func:`core.engine.logprobs.chosen`, from the step's logits).

        Raises:
            RequestError: a bad option (named in the message).
        """
        return make_request(self.model, prompt_ids, max_tokens, sampling, stop, stop_token_ids, self.capacity,
                            sink, request_id, self.slots.can_sample, logprobs)

    def add(self, request: Request) -> None:
        """Queue ``request``; its events go to ``request.sink`` from the owner's thread.

        Raises:
            QueueFullError: ``max_waiting`` requests are already waiting.
            EngineClosedError: the engine was shut down.
        """
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is shut down")
            if self._queued >= self.scheduler.max_waiting:
                raise QueueFullError(f"{self._queued} requests are waiting, the most the engine queues")
            self._queued += 1
        self._commands.put(("add", request))

    def abort(self, request_id: str) -> None:
        """End request ``request_id`` (finish_reason "abort"); its slot is free before the next
        step. Nothing happens for an unknown or finished request."""
        self._commands.put(("abort", request_id))

    @property
    def waiting(self) -> int:
        """Requests queued and not yet admitted."""
        return self._queued

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return len(self.scheduler.running)

    def start(self, warm_up: bool = True) -> Engine:
        """Capture the decode buckets (:meth:`warm_up`, unless ``warm_up`` is False), then run
        the loop on the engine's own thread (its owner from now on); returns self."""
        if warm_up:
            self.warm_up()
        self._thread = threading.Thread(target=self._loop, name="lockstep-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, prompt_ids: Any, **options: Any) -> Handle:
        """Make, queue and return a request whose events are read by iterating the returned
        :class:`Handle` (options as :meth:`request` takes them, but ``sink``).

        Raises:
            RequestError: a bad option; QueueFullError / EngineClosedError as :meth:`add`.
        """
        handle = Handle()
        handle.request = self.request(prompt_ids, sink=handle.events.put, **options)
        self.add(handle.request)
        return handle

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop taking requests, abort every queued and running one, stop the owner thread and
        give the KV back to the runner."""
        with self._lock:
            self._closed = True
        self._commands.put(("shutdown", None))
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self.run_once()

    # -- the owner ----------------------------------------------------------------------------
    def busy(self) -> bool:
        """Whether a request is waiting or running (the owner's view)."""
        return bool(self.scheduler.running or self.scheduler.waiting)

    def _loop(self) -> None:
        while True:
            if not self.busy():
                self._next = self._commands.get()  # sleep until a command comes
            try:
                if not self.run_once():
                    return
            except Exception as exc:  # noqa: BLE001 - a bug fails the requests in flight, not the server
                log.exception("engine iteration failed")
                self._fail_all(f"engine error: {exc}")

    def _fail_all(self, reason: str) -> None:
        """End every running request with "error" (events published) and drop the queued steps."""
        events = []
        self._queued_steps.clear()
        for slot, req in dict(self.scheduler.running).items():
            self.scheduler.release(slot)
            events.append((req, req.finish("error", error=reason)))
        self._publish(events)

    def warm_up(self) -> None:
        """Capture every decode bucket now (where the provider captures), so no request waits
        for a capture: two steps per bucket with every lane padded. Call it before
        :meth:`start`, or on the owner's thread."""
        p = self.runner.provider
        if not p.capabilities().graph_capture or self.slots.capture is False:
            return
        for batch in self.scheduler.buckets:
            for _ in range(2):  # a warm-up step, then the capture (and its replay)
                self.slots.decode(batch, set()).wait()

    def run_once(self) -> bool:
        """One iteration (module docstring): commands, admission and prefills, one decode step,
        events. Returns False once the engine has shut down."""
        events: list[tuple[Request, Event]] = []
        if not self._drain(events):
            self._publish(events)
            return False
        for req, _slot in self.scheduler.admit():
            with self._lock:
                self._queued -= 1
            self.counters.engine_requests += 1
            self._prefilling.add(req)
        self._prefilling.run(events)
        self._publish(events)  # first tokens out now, not a decode step later
        events = []
        if self._queued_steps or any(r not in self._prefilling for r in self.scheduler.running.values()):
            t0 = time.perf_counter()
            self._decode(events)
            self.counters.decode_s += max(time.perf_counter() - t0 - self._take_compile_s(), 0.0)
        self._publish(events)
        return True

    def prefill_budget(self) -> int:
        """Prompt positions to prefill this iteration: ``decode_prefill_tokens`` while some
        admitted row decodes (where set), else ``prefill_tokens`` (the owner's view)."""
        decoding = any(r not in self._prefilling for r in self.scheduler.running.values())
        if decoding and self.decode_prefill_tokens is not None:
            return self.decode_prefill_tokens
        return self.scheduler.prefill_tokens

    def _take_compile_s(self) -> float:
        """Kernel compile seconds since the last call, counted in ``compile_s`` (kept out of
        ``prefill_s`` and ``decode_s``, as a Session does)."""
        now = compiling.seconds()
        spent, self._compiled_at = now - self._compiled_at, now
        self.counters.compile_s += spent
        return spent

    def run_until_idle(self, max_iterations: int = 1_000_000) -> None:
        """Run iterations until nothing waits or runs (tests and batch clients without a thread)."""
        for _ in range(max_iterations):
            self.run_once()
            if not self.busy() and self._commands.empty():
                return
        raise RuntimeError(f"the engine was still busy after {max_iterations} iterations")

    def _drain(self, events: list) -> bool:
        while True:
            if self._next is not None:
                (kind, arg), self._next = self._next, None
            else:
                try:
                    kind, arg = self._commands.get_nowait()
                except queue.Empty:
                    return True
            if kind == "add":
                self.scheduler.submit(arg)
            elif kind == "abort":
                self._abort(arg, events)
            else:
                self._stop(events)
                return False

    def _abort(self, request_id: str, events: list) -> None:
        where = self.scheduler.find(request_id)
        if where is None:
            return
        state, req, slot = where
        if state == "waiting":
            self.scheduler.remove_waiting(req)
            with self._lock:
                self._queued -= 1
        else:
            assert slot is not None
            self.scheduler.release(slot)
        events.append((req, req.finish("abort")))

    def _stop(self, events: list) -> None:
        for req in list(self.scheduler.waiting):
            events.append((req, req.finish("abort", error="the engine shut down")))
        for slot in list(self.scheduler.running):
            req = self.scheduler.release(slot)
            events.append((req, req.finish("abort", error="the engine shut down")))
        self.scheduler.waiting.clear()
        self._prefilling.clear()
        with self._lock:
            self._queued = 0
        for _, download, logits in self._queued_steps:  # their device work runs anyway; read to free the copies
            download.wait()
            if logits is not None:
                logits.wait()
        self._queued_steps.clear()
        self.slots.close()

    def _decode(self, events: list) -> None:
        """Queue a step (and, running ahead, the next one), read the oldest queued step and feed
        the rows it ran that still run (each its token from the slot it held when the step was
        queued; it may have moved since)."""
        try:
            if not self._queued_steps:
                self._queue_step()
            if self.run_ahead and len(self._queued_steps) < 2 and self._ahead_needed():
                self._queue_step()
            if not self._queued_steps:
                return
            rows, download, logits_download = self._queued_steps.pop(0)
            out = step_output(download.wait())
            logits = logits_download.wait() if logits_download is not None else None
        except Exception as exc:  # noqa: BLE001 - the rows fail, the engine serves on
            if self.reraise:
                raise
            log.exception("decode step failed")
            self._queued_steps.clear()
            for slot, failed in dict(self.scheduler.running).items():
                self.scheduler.release(slot)
                events.append((failed, failed.finish("error", error=f"decode step failed: {exc}")))
            return
        for slot, req in rows.items():  # the slot each row held when the step was queued
            if req.finish_reason is not None:
                continue  # ended (or aborted) after this step was queued: the slot's token is dropped
            slot_now = self.scheduler.slot_of(req)
            token, error = int(out.tokens[slot]), bool(out.errors[slot])
            lp = chosen(logits[slot], token) if req.logprobs and logits is not None and not error else None
            self._feed(req, slot_now, token, error, events, lp)

    def _ahead_needed(self) -> bool:
        """Whether a step queued behind the ones queued now could give some running row a token
        it may still need (not past its ``max_tokens``): a batch whose rows all reach their
        length limit with the steps queued runs no wasted step."""
        queued = len(self._queued_steps)
        return any(len(r.output_ids) + queued < r.max_tokens
                   for r in self.scheduler.running.values() if r not in self._prefilling)

    def _queue_step(self) -> None:
        if self.compact:
            for old, new in self.scheduler.compaction():
                self.slots.move(old, new)
        occupied = set(self.scheduler.running)  # rows mid-prefill step as padded lanes (SlotState.decode)
        running = {s: r for s, r in self.scheduler.running.items() if r not in self._prefilling}
        if not running:
            return
        if self._queued_steps:
            self.counters.run_ahead_steps += 1
        bucket = self.scheduler.bucket()
        download = self.slots.decode(bucket, occupied)
        logits = self.slots.start_logits(bucket) if any(r.logprobs for r in running.values()) else None
        self._queued_steps.append((running, download, logits))

    def _feed(self, req: Request, slot: int, token: int, error: bool, events: list, logprob: Any = None) -> None:
        event = req.feed(token, error, logprob)
        if event.finish_reason is not None:
            self.scheduler.release(slot)
        events.append((req, event))

    def _publish(self, events: list) -> None:
        for req, event in events:
            if req.sink is None:
                continue
            try:
                req.sink(event)
            except Exception:  # noqa: BLE001 - a consumer's bug must not stop the other requests
                if self.reraise:
                    raise
                log.exception("the event sink of %s raised; the request is aborted", req.id)
                if event.finish_reason is None:
                    self.abort(req.id)

"""TensorParallelSession: a Session whose model runs as R rank processes.

``Session(model, ..., tensor_parallel=R)`` (R >= 2) makes one. It plans the shards first
(:func:`~core.parallel.shard.plan_shards`: a KV-head count R does not divide is a
``ModelError`` before any process starts), then spawns R processes
(``multiprocessing`` "spawn"), each running :func:`~core.parallel.worker.rank_main`: its
shard in an ordinary :class:`~core.session.Session`, the ranks joined by a
:class:`~core.parallel.comm.HostCommunicator`. ``prefill`` and ``step`` are sent to every
rank; the ranks must agree on every token (they read the same all-reduced values), and rank
0's answer is returned. :class:`~core.generation.stream.Generation` (``core.run``,
``core.stream``) drives it like any session; the tokenizer and stop rules run here.

Failure: a rank waits at most :data:`RANK_TIMEOUT_S` seconds for a peer in a collective
(``$LOCKSTEP_RANK_TIMEOUT`` overrides it) and the coordinator at most that plus
:data:`CALL_GRACE_S` for a whole call (the start: :data:`START_TIMEOUT_S`). A rank that
exits, crashes or stays silent past it ends the request with a :class:`RankError`; every rank is then killed
and joined, and the session is closed. :meth:`close` (also run when the session is collected
and at interpreter exit, the ranks being daemon processes) stops the ranks and joins them.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import sys
import threading
import time
import types
import weakref
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Sequence, cast

import attrs
import numpy as np

from core.counters import Counters
from core.generation import sampling as sampling_mod
from core.models.model import Model, load_model
from core.parallel.shard import ShardPlan, plan_shards
from core.runtime.runner import Runner
from core.runtime.step import StepOutput
from core.session import PendingStep, RequestError, Session

#: Seconds a call to the ranks (and a receive between ranks) may take before it is a failure.
RANK_TIMEOUT_S = 300.0
#: Seconds the ranks get to start (import, load and shard the model), at least the call timeout.
START_TIMEOUT_S = 180.0
#: Seconds a call waits beyond the ranks' receive timeout.
CALL_GRACE_S = 5.0
#: Seconds a rank gets to exit after ``close`` before it is killed.
CLOSE_GRACE_S = 10.0


class RankError(RuntimeError):
    """A rank process died, failed or hung; the tensor-parallel session is closed and every
    rank is stopped."""


@attrs.define
class TensorParallelCounters(Counters):
    """Rank 0's :class:`~core.counters.Counters` plus the tensor-parallel ones.

    Attributes:
        tensor_parallel: the rank count R.
        all_reduces: all-reduce calls rank 0 made (1 + 2 x layers per graph run).
        all_reduce_bytes: bytes rank 0 contributed to them.
    """

    tensor_parallel: int = 1
    all_reduces: int = 0
    all_reduce_bytes: int = 0


def rank_timeout() -> float:
    """:data:`RANK_TIMEOUT_S`, or ``$LOCKSTEP_RANK_TIMEOUT`` (seconds) when set.

    Raises:
        RequestError: the variable is not a positive number.
    """
    text = os.environ.get("LOCKSTEP_RANK_TIMEOUT")
    if text is None:
        return RANK_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise RequestError(f"LOCKSTEP_RANK_TIMEOUT must be a positive number of seconds, got {text!r}")
    return value


#: Why a sampled request is refused with tensor_parallel > 1.
GREEDY_ONLY = ("tensor_parallel decodes greedily only (no sampler over vocab-sharded logits yet): it needs "
               "do_sample=False and repetition_penalty=1")


def check_greedy(sampling: Any, batch: int, model: Model) -> list:
    """The per-row sampling options (:func:`core.generation.sampling.resolve_rows`, defaults
    from the model's "search" section) when every row is plain greedy.

    Raises:
        RequestError: a bad option, or a sampled row (do_sample or a repetition penalty):
            tensor-parallel decoding is greedy only.
    """
    try:
        rows = sampling_mod.resolve_rows(sampling, batch, sampling_mod.search_defaults(model.config.search))
    except sampling_mod.SamplingError as exc:
        raise RequestError(str(exc)) from None
    if not all(r.greedy_plain for r in rows):
        raise RequestError(GREEDY_ONLY)
    return rows


def _stop(procs: list, ctrls: list, graceful: bool) -> None:
    """Stop every rank: ask it to close (graceful), wait, then kill what is left; join all."""
    if graceful:
        for conn in ctrls:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("close",))
        deadline = time.monotonic() + CLOSE_GRACE_S
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.0))
    for p in procs:
        if p.is_alive():
            p.kill()  # SIGKILL also ends a stopped (SIGSTOP) rank
    for p in procs:
        p.join()
    for conn in ctrls:
        conn.close()


_MAIN_SWAP = threading.Lock()


@contextlib.contextmanager
def _own_main() -> Iterator[None]:
    """While a rank process starts, ``__main__`` is a bare module: "spawn" re-runs the parent's
    main module in the child (by path or name), which fails for ``<stdin>`` and is never wanted
    here (the rank's target lives in core.parallel.worker, and a caller's script must not run
    twice). The swap covers only ``Process.start`` (the preparation data is read there)."""
    with _MAIN_SWAP:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            sys.modules["__main__"] = main


class TensorParallelSession(Session):
    """A :class:`~core.session.Session` sharded over ``tensor_parallel`` rank processes
    (module docstring). Arguments as :class:`~core.session.Session`, plus:

    Args:
        tensor_parallel: the rank count R >= 2.

    Differences: greedy decoding only (sampling over vocab-sharded logits is not built);
    ``all_logits`` and a :class:`~core.runtime.runner.Runner` are refused; graph capture is
    off (the host all-reduce runs eagerly), and so is ``run_ahead`` (each step is a round trip to
    the ranks). :meth:`last_logits` gathers every rank's vocab
    shard. ``counters`` is a :class:`TensorParallelCounters`.

    Raises:
        RequestError: R < 2, a Runner, ``all_logits=True``, a bad ``$LOCKSTEP_RANK_TIMEOUT``,
            or any refusal of :class:`~core.session.Session` (reported by the ranks).
        core.models.model.ModelError: the model cannot be sharded for R (KV heads not divisible,
            an unknown pattern), before any rank starts.
        RankError: a rank failed to start or did not answer within the timeout.
    """

    def __init__(self, model: str | Path | Model | Runner, provider: Any = "cpu_reference", batch: int = 1,
                 capacity: int | None = None, kv_layout: str = "head_major",
                 kv_policy: str | None = None, capture: bool | None = None,
                 max_capacity: int | None = None, weight_budget: int | float | str | None = None,
                 device_budget: int | str | None = None, all_logits: bool = False,
                 prefill_groups: str = "auto", tensor_parallel: int = 2, run_ahead: bool = True):
        if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, (int, np.integer)) \
                or tensor_parallel < 2:
            raise RequestError(f"tensor_parallel must be an integer >= 2 here, got {tensor_parallel!r}")
        if isinstance(model, Runner):
            raise RequestError("tensor_parallel needs a model folder or a loaded Model; a Runner holds one "
                               "provider's unsharded weights")
        if all_logits:
            raise RequestError("tensor_parallel does not keep the prompt logits (all_logits=True)")
        self.ranks = int(tensor_parallel)
        self.run_ahead = False  # every step is a round trip to the ranks (their host all-reduce)
        self._unread, self._logits_stale = [], False
        self.timeout = rank_timeout()
        self._model = model if isinstance(model, Model) else load_model(model)
        self.shard_plan: ShardPlan = plan_shards(self._model, self.ranks)  # ModelError before any process
        name = provider if isinstance(provider, str) else getattr(provider, "name", None)
        if not isinstance(name, str):
            raise RequestError(f"tensor_parallel needs a provider name, got {provider!r}")
        self._provider = SimpleNamespace(name=name)
        self.batch, self.kv_layout = int(batch), kv_layout
        self.all_logits, self.prefill_groups = False, prefill_groups
        self.kv_policy = kv_policy or ("growing" if capacity is None else "fixed")
        self.sampling = []
        self.request_id = 0  # as Session.request_id
        self.counters = TensorParallelCounters(tensor_parallel=self.ranks)
        kwargs = dict(batch=batch, capacity=capacity, kv_layout=kv_layout, kv_policy=kv_policy, capture=capture,
                      max_capacity=max_capacity, weight_budget=weight_budget, device_budget=device_budget,
                      prefill_groups=prefill_groups)
        self._procs, self._ctrls = self._spawn(str(self._model.folder), name, kwargs)
        # Session types _release by its own finalizer (release_state(state)); this one takes no argument
        self._release = weakref.finalize(self, functools.partial(_stop, self._procs, self._ctrls, True))  # type: ignore[call-arg]
        try:
            ready = self._call("start", send=False, timeout=max(START_TIMEOUT_S, self.timeout))
        except BaseException:
            self._release()
            raise
        info = ready[0]
        self.state = SimpleNamespace(kv=SimpleNamespace(limit=info["limit"]))
        self.vocab_ranges = [r["vocab"] for r in ready]
        self.all_reduces_per_run = info["all_reduces_per_run"]
        self._stats: dict = {"lengths": np.zeros(self.batch, np.int64), "capacity": None, "started": False}

    def _spawn(self, folder: str, provider: str, kwargs: dict) -> tuple[list, list[Connection]]:
        """Start the ranks. They run :func:`~core.parallel.worker.rank_main` and import nothing
        of the caller's main module (:func:`_own_main`), so a script read from standard input,
        ``python -c`` or a notebook starts them like any file."""
        ctx = multiprocessing.get_context("spawn")
        size = self.ranks
        peers: list[dict[int, Connection]] = [{} for _ in range(size)]
        for r in range(1, size):
            a, b = ctx.Pipe(duplex=True)
            peers[0][r], peers[r][0] = a, b
        procs, ctrls, child_ends = [], [], []
        from core.parallel.worker import rank_main

        for r in range(size):
            mine, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(target=rank_main, name=f"lockstep-tp-rank{r}", daemon=True,
                            args=(r, size, folder, provider, kwargs, theirs, peers[r], self.timeout))
            with _own_main():
                p.start()
            procs.append(p)
            ctrls.append(mine)
            child_ends.append(theirs)
        for conn in child_ends:  # only the ranks hold these now: a dead rank's pipes close
            conn.close()
        for group in peers:
            for conn in group.values():
                conn.close()
        return procs, ctrls

    # -- rank calls ------------------------------------------------------------------------
    def _fail(self, message: str) -> RankError:
        self._release.detach()
        _stop(self._procs, self._ctrls, graceful=False)
        return RankError(f"tensor parallel: {message}; every rank was stopped and the session is closed")

    def _call(self, op: str, *args: Any, targets: Sequence[int] | None = None, send: bool = True,
              timeout: float | None = None) -> list:
        """Send ``(op, args)`` to ``targets`` (default every rank) and return their values in
        rank order. A user error every rank raised is re-raised (the ranks stay usable); a
        dead, failed or silent rank is a :class:`RankError` after every rank is stopped."""
        ranks = list(range(self.ranks)) if targets is None else list(targets)
        if send:
            self._check_open()
            for r in ranks:
                try:
                    self._ctrls[r].send((op, args))
                except (OSError, ValueError):
                    self._procs[r].join(1.0)  # a closed pipe: the rank is exiting, reap it
                    if self._procs[r].is_alive():
                        raise self._fail(f"rank {r} is gone (its pipe is closed) before {op}") from None
                    raise self._fail(f"rank {r} died (exit code {self._procs[r].exitcode}) "
                                     f"before {op}") from None
        replies: dict[int, tuple] = {}
        # a call outlasts the ranks' own receive timeout, so that a rank waiting on a silent
        # peer reports it (naming the peer) before the coordinator gives up on both
        limit = self.timeout + CALL_GRACE_S if timeout is None else timeout
        deadline = time.monotonic() + limit
        by_conn = {id(self._ctrls[r]): r for r in ranks}
        while len(replies) < len(ranks):
            waiting = [self._ctrls[r] for r in ranks if r not in replies]
            left = deadline - time.monotonic()
            ready = wait(waiting + [p.sentinel for p in self._procs], timeout=max(left, 0.0)) if left > 0 else []
            for obj in ready:
                who = by_conn.get(id(obj))
                if who is None:
                    continue
                try:
                    replies[who] = cast(Connection, obj).recv()
                except (EOFError, OSError):
                    self._procs[who].join(1.0)  # its pipe closed: it is exiting
                    replies[who] = ("dead", f"rank {who} closed its pipe during {op}")
            dead = [f"rank {r} died (exit code {p.exitcode}) during {op}" for r, p in enumerate(self._procs)
                    if not p.is_alive() and (r not in replies or replies[r][0] == "dead")]
            dead += [msg for r, (kind, msg) in sorted(replies.items()) if kind == "dead" and self._procs[r].is_alive()]
            fatal = [f"{msg}" for r, (kind, msg) in sorted(replies.items()) if kind == "fatal"]
            if fatal and not dead:  # a rank saw a peer vanish: name the peer once it is reaped
                wait([p.sentinel for p in self._procs], timeout=0.5)
                dead = [f"rank {r} died (exit code {p.exitcode}) during {op}" for r, p in enumerate(self._procs)
                        if not p.is_alive() and r not in replies]
            if dead or fatal:
                raise self._fail(f"{op} failed: " + "; ".join(dead + fatal))
            if not ready:
                silent = [r for r in ranks if r not in replies]
                raise self._fail(f"rank {', '.join(map(str, silent))} did not answer {op} within "
                                 f"{limit:g} s (hung?)")
        errors = [msg for _, (kind, msg) in sorted(replies.items()) if kind == "error"]
        if errors:
            if len(errors) != len(ranks):
                raise self._fail(f"the ranks disagree on {op}: some refused it ({errors[0]})")
            raise errors[0]
        return [replies[r][1] for r in ranks]

    def _stepped(self, outs: list) -> StepOutput:
        first = outs[0][0]
        for r, (out, _) in enumerate(outs[1:], 1):
            if not (np.array_equal(out.tokens, first.tokens) and np.array_equal(out.errors, first.errors)):
                raise self._fail(f"rank {r} chose tokens {out.tokens.tolist()}, rank 0 {first.tokens.tolist()}")
        self._take_stats(outs[0][1])
        return first

    def _take_stats(self, stats: dict) -> None:
        for a in attrs.fields(Counters):
            setattr(self.counters, a.name, getattr(stats["counters"], a.name))
        counters = cast(TensorParallelCounters, self.counters)
        counters.all_reduces = stats["all_reduces"]
        counters.all_reduce_bytes = stats["all_reduce_bytes"]
        self._stats = stats

    # -- the Session surface ---------------------------------------------------------------
    @property
    def model(self) -> Model:
        """The full (unsharded) model: its config and tokenizer."""
        return self._model

    @property
    def provider(self):
        """An object naming each rank's provider (``.name``)."""
        return self._provider

    @property
    def plan(self):
        raise RequestError("a tensor-parallel session has one plan per rank, in the rank processes")

    @property
    def capacity(self) -> int:
        """KV positions per row each rank's cache holds now (after the last call)."""
        return int(self._stats["capacity"] or self._call("stats", targets=[0])[0]["capacity"])

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[B]``: tokens in each row's KV cache (as of the last prefill or step)."""
        return self._stats["lengths"]

    @property
    def started(self) -> bool:
        """True once a prefill ran for the current request."""
        return bool(self._stats["started"])

    def close(self) -> None:
        """Stop every rank (asked to exit, killed after :data:`CLOSE_GRACE_S`) and join them."""
        self._release()

    def alive_ranks(self) -> list[int]:
        """Process ids of the rank processes still running (empty once closed)."""
        return [p.pid for p in self._procs if p.is_alive()]

    @property
    def rank_pids(self) -> list[int]:
        """Process id of every rank, in rank order."""
        return [int(p.pid) for p in self._procs]

    def check_prompts(self, input_ids: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 1) -> None:
        """As :meth:`core.session.Session.check_prompts` (rank 0 checks)."""
        self._call("check_prompts", input_ids, max_new_tokens, targets=[0])

    def check_sampling(self, sampling: Any = None) -> list:
        """As :meth:`core.session.Session.check_sampling`, greedy rows only.

        Raises:
            RequestError: a bad option, or a sampled row (do_sample or a repetition penalty).
        """
        self._check_open()
        return check_greedy(sampling, self.batch, self._model)

    def set_sampling(self, rows: Sequence[Any], history: Sequence[Sequence[int]] | None = None) -> None:
        """As :meth:`core.session.Session.set_sampling`, on every rank."""
        self._call("set_sampling", list(rows), history)
        self.sampling = list(rows)

    def rewind(self, lengths: Sequence[int], history: Sequence[Sequence[int]] | None = None) -> None:
        """As :meth:`core.session.Session.rewind`, on every rank."""
        self._call("rewind", list(lengths), history)
        self.request_id += 1
        self._stats = {**self._stats, "lengths": np.asarray(lengths, np.int64)}

    def prefill(self, input_ids: Sequence[Sequence[int]], sampling: Any = None) -> StepOutput:
        """As :meth:`core.session.Session.prefill`, every rank on its shard; greedy only."""
        self.check_sampling(sampling)
        self.request_id += 1
        return self._stepped(self._call("prefill", input_ids, sampling))

    def step(self, force_tokens: Sequence[int] | None = None) -> StepOutput:
        """As :meth:`core.session.Session.step`, every rank on its shard."""
        return self._stepped(self._call("step", force_tokens))

    def step_async(self, force_tokens: Sequence[int] | None = None) -> PendingStep:
        """As :meth:`step` (the ranks step synchronously), returned as a finished
        :class:`~core.session.PendingStep`."""
        return PendingStep.finished(self, self.step(force_tokens))

    def last_logits(self) -> np.ndarray:
        """fp32 ``[B, V]``: every rank's vocab shard of the logits the last step chose from,
        concatenated in rank (= vocab) order."""
        return np.concatenate(self._call("shard_logits"), axis=-1)

    def prompt_logits(self) -> np.ndarray:
        raise RequestError("tensor_parallel does not keep the prompt logits (all_logits)")

"""The coordinator's side of the rank processes: start them, call them, stop them.

:class:`RankCalls` is the mixin both coordinators use: the fixed-batch
:class:`~core.parallel.session.TensorParallelSession` and the engine's step runner
:class:`~core.parallel.runner.TensorParallelRunner`. It spawns R processes (``multiprocessing``
"spawn"), each running :func:`~core.parallel.worker.rank_main` on its shard, the ranks joined
by a :class:`~core.parallel.comm.HostCommunicator`, sends every call to every rank and checks
the replies.

Failure: a rank waits at most :data:`RANK_TIMEOUT_S` seconds for a peer in a collective
(``$LOCKSTEP_RANK_TIMEOUT`` overrides it) and the coordinator at most that plus
:data:`CALL_GRACE_S` for a whole call (the start: :data:`START_TIMEOUT_S`). A rank that
exits, crashes or stays silent past it ends the call with a :class:`RankError`; every rank is
then killed and joined, and the coordinator is closed. ``close`` (also run when the
coordinator is collected and at interpreter exit, the ranks being daemon processes) stops the
ranks and joins them.
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
from typing import Any, Iterator, Sequence, cast

from core.errors import RequestError

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


class RankCalls:
    """Rank processes and the calls to them (module docstring). A subclass sets ``ranks`` (R)
    and ``timeout`` (:func:`rank_timeout`), then calls :meth:`_start_ranks`.

    Attributes:
        closed_noun: what a :class:`RankError` says was closed ("session", "runner").
    """

    ranks: int
    timeout: float
    closed_noun = "session"
    _procs: list
    _ctrls: list[Connection]
    _release: Any

    def _start_ranks(self, folder: str, provider: str, kwargs: dict, mode: str) -> list:
        """Start ``self.ranks`` rank processes (:func:`~core.parallel.worker.rank_main` in
        ``mode``: "session" or "runner", with ``kwargs``) and wait until each has loaded its
        shard; returns their start replies in rank order. ``close`` (and garbage collection)
        stops them from then on.

        Raises:
            RankError: a rank failed to start or did not answer in time (every rank stopped).
            RequestError: the ranks refused the arguments (every rank stopped).
        """
        self._procs, self._ctrls = self._spawn(folder, provider, kwargs, mode)
        self._release = weakref.finalize(self, functools.partial(_stop, self._procs, self._ctrls, True))
        try:
            return self._call("start", send=False, timeout=max(START_TIMEOUT_S, self.timeout))
        except BaseException:
            self._release()
            raise

    def _spawn(self, folder: str, provider: str, kwargs: dict, mode: str) -> tuple[list, list[Connection]]:
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
                            args=(r, size, folder, provider, kwargs, theirs, peers[r], self.timeout, mode))
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
        return RankError(f"tensor parallel: {message}; every rank was stopped and the {self.closed_noun} is closed")

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

    def _check_open(self) -> None:
        if not self._release.alive:
            raise RequestError(f"this tensor-parallel {self.closed_noun} is closed")

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

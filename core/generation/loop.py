"""The decode loop: prefill, then decode steps, with an observer per step.

Every caller that decodes (``core.run``, the parity kit, ``lockstep profile``, the benchmarks
and the tests) goes through :func:`decode`, so what is measured and checked is the loop users run.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import attrs
import numpy as np

from core.runtime.step import StepOutput

#: ``observer(t, out, seconds) -> stop?``: t = 0 for the prefill, t >= 1 for decode step t;
#: ``seconds`` is the host wall time the loop waited for that step (it includes the [B, 2]
#: read-back; with ``Session.run_ahead`` the next steps are already queued then).
Observer = Callable[[int, StepOutput, float], "bool | None"]


@attrs.define
class Trace:
    """What :func:`decode` ran.

    Attributes:
        tokens: int64 ``[T + 1, B]``: the prefill's tokens, then each decode step's.
        errors: bool ``[T + 1, B]``: rows whose logits were non-finite at that step.
        seconds: wall seconds of the prefill (entry 0) and of each decode step: from the end
            of the previous entry's bookkeeping (observer excluded) to the step's read, so the
            queueing of steps run ahead is counted where it happens.
        logits: fp32 ``[T + 1, B, V]``, the logits each step chose from (``keep_logits``), or None.
        device_seconds: each decode step's device time (:attr:`core.session.PendingStep.device_s`;
            None entries when the provider has no node timer).
    """

    tokens: np.ndarray
    errors: np.ndarray
    seconds: list[float]
    logits: np.ndarray | None = None
    device_seconds: list = attrs.Factory(list)

    @property
    def steps(self) -> int:
        """Decode steps run (the prefill not counted)."""
        return len(self.seconds) - 1


def decode(session, input_ids: Sequence[Sequence[int]], steps: int,
           force: Sequence[Sequence[int]] | None = None, observer: Observer | None = None,
           keep_logits: bool = False) -> Trace:
    """Prefill ``input_ids`` on ``session``, then run up to ``steps`` decode steps.

    Args:
        session: a :class:`core.session.Session` of ``len(input_ids)`` rows.
        input_ids: one token-id list per row.
        steps: decode steps to run after the prefill (>= 0).
        force: teacher forcing: ``force[b][t]`` is fed to row b at decode step t + 1 instead of
            the row's own previous token (each row needs ``steps`` entries).
        observer: called after the prefill and after every step; returning True stops the loop.
        keep_logits: download every step's logits into ``Trace.logits`` (outside the timing).

    Raises:
        core.session.RequestError: the request is refused (before any kernel runs), or
            ``force`` rows are shorter than ``steps``.
    """
    from core.session import MAX_UNREAD, RequestError

    if force is not None and any(len(row) < steps for row in force):
        raise RequestError(f"force needs {steps} tokens per row")
    tokens, errors, seconds, logits = [], [], [], []
    device: list[float | None] = []

    def record(t: int, out: StepOutput, t0: float) -> bool:
        seconds.append(time.perf_counter() - t0)
        tokens.append(out.tokens)
        errors.append(out.errors)
        if keep_logits:
            logits.append(session.last_logits())
        return bool(observer(t, out, seconds[-1])) if observer is not None else False

    t0 = time.perf_counter()
    stop = record(0, session.prefill(input_ids), t0)
    # the host queues step t + 1 (and t + 2) before it reads step t, so the device never waits
    # for it; not with an observer or kept logits, which may read device state between steps
    ahead = session.run_ahead and observer is None and not keep_logits
    queued: list = []  # steps queued and unread, oldest first
    t = 0
    while t < steps and not stop:
        t0 = time.perf_counter()  # a step's time: its queueing (or the next ones') and the wait for it
        while len(queued) < (MAX_UNREAD if ahead else 1) and t + len(queued) < steps \
                and (not queued or session.can_run_ahead()):  # can_run_ahead: max_unread, KV growth
            i = t + len(queued)
            queued.append(session.step_async(force_tokens=None if force is None else [row[i] for row in force]))
        pending = queued.pop(0)
        out = pending.result()
        device.append(pending.device_s)
        t += 1
        stop = record(t, out, t0)
    if queued:  # the loop stopped before reading them
        session.discard(queued[0])
    return Trace(np.array(tokens, np.int64), np.array(errors, bool), seconds,
                 np.stack(logits) if keep_logits else None, device)

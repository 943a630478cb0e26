"""Graph-capture policy: eager -> warm-up -> capture -> replay, around one step function.

:class:`CapturedStep` wraps a zero-argument device function (the decode step of
:mod:`core.runtime.step`, bound to one runner and one decode state) and a key function. It
knows nothing of sessions: the caller passes the :class:`~core.counters.Counters` to charge on
each call, so one graph per batch can serve every later session that reuses the same decode
state on the Runner.

The key is (batch, KV stride, KV layout, plan identity, identities of every buffer the step
touches); node buffers a capture used are pinned in their kernel contexts, so they cannot
move. A key change invalidates the graph (counted, with its reason) and the next step warms up
and recaptures. While capturing, every kernel context is frozen, so a kernel that would
allocate raises and the step falls back to eager with the reason recorded (docs/cases.md 10).
Capture records without executing, so it never advances decode state; the replay that follows
runs the step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from core.counters import Counters

EAGER, WARM, CAPTURED = "eager", "warm", "captured"


class CapturedStep:
    """The capture state machine of one decode step function.

    Args:
        provider: the execution provider (``begin_capture`` / ``end_capture`` / ``replay``).
        plan: the executor plan whose kernel contexts are frozen while capturing.
        step: the device work of one step; touches only persistent buffers.
        key: returns the tuple that must stay equal for a captured graph to stay valid.
        enabled: True to ask for capture, False never, None when the provider supports it.
        counters: where a fallback for a provider without capture is recorded.
        meter: returns cumulative work counts the step adds to (e.g. weight bytes and copies
            streamed); :meth:`run` returns what one step did by it: measured around an eager
            step, and for a replay the counts measured while the graph was recorded.
    """

    def __init__(self, provider: Any, plan: Any, step: Callable[[], None], key: Callable[[], tuple],
                 enabled: bool | None, counters: Counters, meter: Callable[[], tuple] = tuple):
        supported = provider.capabilities().graph_capture
        if enabled and not supported:
            counters.fallbacks.append(f"provider {provider.name!r} has no graph capture")
        self.provider, self.plan, self.step, self.key, self.meter = provider, plan, step, key, meter
        self.recorded: tuple = ()
        self.enabled = bool(supported if enabled is None else enabled and supported)
        self.state = EAGER
        self.graph: Any = None
        self._key: tuple | None = None

    def invalidate(self, reason: str, counters: Counters) -> None:
        """Drop the captured graph (counted with its reason); the next step warms up again."""
        if self.graph is not None:
            counters.invalidations += 1
            counters.invalidation_reasons.append(reason)
        self.graph, self._key, self.state = None, None, EAGER

    def check(self, counters: Counters, reason: str = "a buffer pointer or shape changed") -> None:
        """Invalidate the graph if its key no longer matches."""
        if self.graph is not None and self.key() != self._key:
            self.invalidate(reason, counters)

    def run(self, counters: Counters) -> tuple:
        """Run one step on the device: eagerly, or by capturing then replaying. Returns the
        meter's counts of the work this step did (see the class docstring)."""
        if not self.enabled:
            return self._measured(self.step)
        self.check(counters)
        if self.graph is None:
            if self.state == EAGER:  # warm-up: a real eager step that allocates every buffer
                self.state = WARM
                return self._measured(self.step)
            if not self._capture(counters):
                return self._measured(self.step)
        self.provider.replay(self.graph)
        counters.replays += 1
        return self.recorded

    def _measured(self, fn: Callable[[], None]) -> tuple:
        before = self.meter()
        fn()
        return tuple(b - a for a, b in zip(before, self.meter()))

    def _capture(self, counters: Counters) -> bool:
        self.plan.set_frozen(True)
        try:
            self.provider.begin_capture()
            try:
                self.recorded = self._measured(self.step)
            except Exception as exc:  # the step's own error is the reason, not end_capture's
                with contextlib.suppress(Exception):  # the capture is void either way
                    self.provider.end_capture()
                raise exc
            graph = self.provider.end_capture()
        except Exception as exc:  # noqa: BLE001 - any failure means: run eagerly, say why
            counters.fallbacks.append(f"capture failed: {exc}")
            self.enabled = False
            return False
        finally:
            self.plan.set_frozen(False)
        self.graph, self._key, self.state = graph, self.key(), CAPTURED
        counters.captures += 1
        return True

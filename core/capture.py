"""Graph-capture policy: eager -> warm-up -> capture -> replay, per session.

The captured region is exactly one function, :meth:`core.session.Session.decode_step_device`
(decode_advance + graph + device_argmax). It is keyed by (batch, KV stride, KV layout, weight
plan, buffer identities); node buffers a capture used are pinned in their kernel contexts, so
they cannot move. Any key change invalidates the graph and the next step
recaptures. While capturing, every kernel context is frozen, so a kernel that would allocate
raises and the step falls back to eager with the reason recorded (CASES 10). Capture itself
records without executing, so it never advances decode state; the replay that follows runs
the step.
"""

from __future__ import annotations

EAGER, WARM, CAPTURED = "eager", "warm", "captured"


class CaptureState:
    """The capture state machine of one session.

    Args:
        session: the owning :class:`core.session.Session`.
        enabled: True to ask for capture, False to never capture, None for "when the provider
            supports it". Asking on a provider without capture records a fallback.
    """

    def __init__(self, session, enabled: bool | None):
        self.session = session
        supported = session.provider.capabilities().graph_capture
        if enabled and not supported:
            session.counters.fallbacks.append(f"provider {session.provider.name!r} has no graph capture")
        self.enabled = bool(supported if enabled is None else enabled and supported)
        self.state = EAGER
        self.graph = None
        self.key = None

    def _key(self) -> tuple:
        s = self.session
        buffers = [s.input_ids, s.attention_mask, s.result, s.positions, s.lengths_dev]
        buffers += [t for pair in s.kv for t in pair]
        # geometry.capacity is the stride baked into the graph (with VMM the logical capacity
        # grows under a fixed stride, which needs no recapture)
        return (s.batch, s.geometry.capacity, s.kv_layout, id(s.plan),
                tuple(id(b) for b in buffers))

    def invalidate(self, reason: str) -> None:
        """Drop the captured graph (counted with its reason); the next step warms up again."""
        if self.graph is not None:
            self.session.counters.invalidations += 1
            self.session.counters.invalidation_reasons.append(reason)
        self.graph, self.key = None, None
        self.state = EAGER

    def reset_request(self) -> None:
        """A new prefill ran: the graph stays valid if its key still matches."""
        if self.graph is not None and self._key() != self.key:
            self.invalidate("buffers changed between requests")

    def run_step(self) -> None:
        """Run one decode step on the device: eagerly, or by capturing then replaying."""
        s = self.session
        if not self.enabled:
            s.decode_step_device()
            return
        if self.graph is not None and self._key() != self.key:
            self.invalidate("a buffer pointer or shape changed")
        if self.graph is None:
            if self.state == EAGER:  # warm-up: a real eager step that allocates every buffer
                s.decode_step_device()
                self.state = WARM
                return
            if not self._capture():
                s.decode_step_device()
                return
        s.provider.replay(self.graph)
        s.counters.replays += 1

    def _capture(self) -> bool:
        s = self.session
        s.plan.set_frozen(True)
        try:
            s.provider.begin_capture()
            try:
                s.decode_step_device()
            finally:
                graph = s.provider.end_capture()
        except Exception as exc:  # noqa: BLE001 - any failure means: run eagerly, say why
            s.counters.fallbacks.append(f"capture failed: {exc}")
            self.enabled = False
            return False
        finally:
            s.plan.set_frozen(False)
        self.graph, self.key, self.state = graph, self._key(), CAPTURED
        s.counters.captures += 1
        return True

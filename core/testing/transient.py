"""Test helper: force the transient prefill of :meth:`core.executor.Plan.run` on or off.

    runs = force_prefill_transient(monkeypatch, False)   # prefills keep every buffer
    ...                                                   # runs: the value each prefill got
"""

from __future__ import annotations

from typing import Any

from core.executor import Plan
from core.fusion import LAST_INDEX


def force_prefill_transient(monkeypatch: Any, transient: bool) -> list[bool]:
    """Patch ``Plan.run`` (with pytest's ``monkeypatch``) so every prefill (a run fed
    :data:`core.fusion.LAST_INDEX`) gets ``transient``; decode steps run as by default (never
    transient). Returns the list that records the value each prefill ran with."""
    real = Plan.run
    seen: list[bool] = []

    def run(self, feeds, transient_=None):
        if feeds.get(LAST_INDEX) is None:
            return real(self, feeds)
        seen.append(transient)
        return real(self, feeds, transient)

    monkeypatch.setattr(Plan, "run", run)
    return seen

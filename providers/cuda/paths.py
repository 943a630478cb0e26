"""The cuda provider's path counters in one object: how often each launcher took each of its
paths, so a test can assert that the path it checks ran (the house rule for optional paths).

Each launcher module declares its group and its paths once (:meth:`PathCounters.declare`) and
counts with :meth:`PathCounters.add`; its ``stats()`` returns :meth:`PathCounters.stats` of its
group. The counts are process-wide, like the kernels' compiled modules: eager launch replay and
captured graphs fire recorded launches without passing the launchers, so they are not counted
there (the ``replay`` group counts node calls).
"""

from __future__ import annotations

from collections.abc import Iterable


class PathCounters:
    """Counts per (group, path) since import.

    Raises:
        KeyError: :meth:`add` or :meth:`stats` of a group or path never declared (a misspelt
            path is named, not silently counted).
    """

    def __init__(self) -> None:
        self._groups: dict[str, dict[str, int]] = {}

    def declare(self, group: str, paths: Iterable[str]) -> None:
        """Make ``group`` with ``paths`` at 0 (a path declared again keeps its count)."""
        counts = self._groups.setdefault(group, {})
        for path in paths:
            counts.setdefault(path, 0)

    def add(self, group: str, path: str, n: int = 1) -> None:
        """Count ``n`` runs of ``path`` of ``group``."""
        counts = self._groups[group]
        if path not in counts:
            raise KeyError(f"path counter {group}.{path} was never declared")
        counts[path] += n

    def stats(self, group: str) -> dict[str, int]:
        """A copy of ``group``'s counts: path -> runs."""
        return dict(self._groups[group])

    def all(self) -> dict[str, dict[str, int]]:
        """A copy of every group's counts."""
        return {g: dict(c) for g, c in self._groups.items()}


#: The one path-counter object of the process.
PATHS = PathCounters()

"""The driver's device-memory figure, polled: the high-water mark of what the device really
held (the CUDA context, every allocator's pools, the pinned mappings' device side), not what
an allocator counts.

    >>> meter = DriverMeter(provider)       # polls provider.device_used_bytes() every 2 ms
    >>> with meter: ...                     # meter.peak_bytes: the most seen inside the block
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from typing import Any


class DriverMeter:
    """A thread polling ``provider.device_used_bytes()`` (bytes in use on the device by the
    driver's count; None when the provider cannot tell, and then the meter reads None).

    Attributes:
        baseline_bytes: the figure when the meter was made (before the measured work).
        peak_bytes: the highest figure seen since the last :meth:`reset` (None: unknown).
    """

    def __init__(self, provider: Any, interval_s: float = 0.002):
        self._read = provider.device_used_bytes
        self._interval = interval_s
        self.baseline_bytes: int | None = self._read()
        self.peak_bytes: int | None = self.baseline_bytes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def reset(self) -> None:
        """Start a new high-water mark from the figure now."""
        self.peak_bytes = self._read()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self._interval)

    def _sample(self) -> None:
        now = self._read()
        if now is not None:
            self.peak_bytes = now if self.peak_bytes is None else max(self.peak_bytes, now)

    def __enter__(self) -> DriverMeter:
        if self.baseline_bytes is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll, name="driver-meter", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._sample()


def host_rss_peak_bytes() -> int:
    """The process's peak resident set size in bytes (``getrusage``; kilobytes on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def host_anon_bytes() -> int | None:
    """The process's anonymous resident bytes now (``RssAnon`` of /proc/self/status: heap and
    pinned staging, not the page-cache pages of memory-mapped weight files), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

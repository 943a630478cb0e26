"""How many BLAS threads a command uses, chosen per provider and workload (threadpoolctl).

NumPy's BLAS (OpenBLAS) starts one thread per core and spins them while it waits. On a quiet
machine that helps cpu_reference (a prefill of SmolLM2-135M fp32 on 2 cores: 56 tok/s on one
thread, 94 on two); on a machine whose cores are busy with other work it hurts badly (the same
prefill under two busy loops: 42 tok/s on one thread, 33 on two; batch-1 decode 12.0 against
6.2 tok/s). So the choice, in order:

1. ``--threads N`` on the command line, else ``LOCKSTEP_CPU_THREADS``: used as given.
2. A provider whose math runs on a device (anything but ``cpu_reference``): 1 thread; the host
   only launches kernels, and spinning BLAS threads would take cores from that launch thread.
3. ``parity`` (thousands of small ops on tiny and real models): 1 thread, where a BLAS thread's
   hand-off costs more than the product.
4. ``run``, ``chat`` and ``profile`` on cpu_reference: the cores no other work is using,
   at least 1: the usable cores (``os.sched_getaffinity``) less the cores busy now
   (:func:`load`), rounded (a quiet 2-core machine: 2; one busy loop: 1).

The load is read once, as the command starts: work started later on the machine does not
change the choice (set ``--threads 1`` for a machine known to be shared).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

#: The environment variable that sets the BLAS threads when ``--threads`` is not given.
ENV = "LOCKSTEP_CPU_THREADS"
#: The commands the choice knows; others are told apart from them by a ValueError.
WORKLOADS = ("run", "chat", "profile", "parity")
#: The provider whose math is NumPy on the host; every other provider's runs on a device.
HOST_PROVIDER = "cpu_reference"


class ThreadsError(ValueError):
    """A thread count that is not a positive integer (``--threads`` or :data:`ENV`)."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


#: Seconds :func:`load` watches the CPU counters (Linux) before a command starts.
SAMPLE_S = 0.1


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat, or None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def load() -> float:
    """Cores busy with other work now: on Linux, the busy share of every CPU over
    :data:`SAMPLE_S` seconds (this process sleeps meanwhile) times the usable cores; elsewhere
    the 1-minute load average (which lags a change by tens of seconds); 0.0 where neither exists."""
    import time

    first = _cpu_times()
    if first is not None:
        time.sleep(SAMPLE_S)
        second = _cpu_times()
        if second is not None and second[1] > first[1]:
            return (second[0] - first[0]) / (second[1] - first[1]) * (os.cpu_count() or 1)
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def requested(flag: int | None, environ: dict[str, str] | None = None) -> int | None:
    """The thread count asked for: ``flag`` (``--threads``), else :data:`ENV`, else None.

    Raises:
        ThreadsError: ``flag`` or the variable is not a positive integer.
    """
    if flag is not None:
        if flag < 1:
            raise ThreadsError(f"--threads must be a positive integer, got {flag}")
        return flag
    text = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ThreadsError(f"{ENV} must be a positive integer, got {text!r}")
    return int(text)


def choose(provider: str, workload: str, asked: int | None = None, cores: int | None = None,
           busy: float | None = None) -> int:
    """The BLAS threads for ``workload`` on ``provider`` (rules in the module docstring).

    Args:
        provider: the provider's name ("cpu_reference", "cuda", ...).
        workload: one of :data:`WORKLOADS`.
        asked: the count from :func:`requested`, which wins when not None.
        cores: usable cores (default :func:`usable_cores`).
        busy: the load of other work, in cores (default :func:`load`).

    Returns:
        A thread count >= 1.

    Raises:
        ValueError: an unknown workload.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if asked is not None:
        return asked
    if provider != HOST_PROVIDER or workload == "parity":
        return 1
    cores = usable_cores() if cores is None else cores
    busy = load() if busy is None else busy
    return max(1, min(cores, round(cores - busy)))


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[int]:
    """Limit every BLAS library loaded in this process to ``n`` threads inside the block (the
    previous limits come back after it). Yields ``n``."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=n, user_api="blas"):
        yield n

"""Kernel compiles a provider does on first use, timed apart from the work they delay.

A provider that compiles device code while a step runs (the CUDA provider builds each
``kernels/*.cu`` the first time a launcher needs it; later runs load it from CuPy's disk cache
in milliseconds) wraps each compile in :func:`compiling`. The session takes those seconds out
of ``prefill_s`` and ``decode_s`` and counts them as ``compile_s`` (``core.counters``), so no
rate includes a one-off compile; :func:`listen` lets a front end show the compile as its own
step while it runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

#: Called as a compile starts: (what is compiled, e.g. "linear.cu"; where its result is cached).
Listener = Callable[[str, str], None]

_seconds = 0.0
_listeners: list[Listener] = []


def seconds() -> float:
    """Wall seconds spent in :func:`compiling` blocks by this process so far (monotonic)."""
    return _seconds


@contextlib.contextmanager
def compiling(what: str, cache: str) -> Iterator[None]:
    """Time a compile of ``what`` (its result cached under the folder ``cache``), telling the
    listeners first. Nested blocks count once (the outer one)."""
    global _seconds
    for listener in list(_listeners):
        listener(what, cache)
    t0 = time.perf_counter()
    before = _seconds
    try:
        yield
    finally:
        _seconds = before + (time.perf_counter() - t0)


def warm(model_dir, provider) -> float:
    """Compile ahead the kernels ``provider`` runs the model in ``model_dir`` with: a batch-1
    request of three prompt tokens and two new ones (the prefill's and the decode step's
    kernels; other batch sizes mostly reuse the same compiled files). Returns the compile
    seconds it took (about 0 when the provider's cache already held them)."""
    from core.generation.generate import run

    before = seconds()
    run(model_dir, provider=provider, input_ids=[[1, 2, 3]], max_new_tokens=2)
    return seconds() - before


@contextlib.contextmanager
def listen(listener: Listener) -> Iterator[None]:
    """Call ``listener`` as each compile starts, inside the block."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)

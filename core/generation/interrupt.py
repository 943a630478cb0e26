"""Ctrl-C as a request to stop between decode steps, so the work done so far is kept.

Inside :class:`CtrlC`, the first SIGINT only sets :attr:`CtrlC.pressed`; the caller reads it
after each delta and stops the generation there (:meth:`Generation.interrupt
<core.generation.stream.Generation.interrupt>`): a step is never cut in half, so the session
stays right for the next request. A second SIGINT raises KeyboardInterrupt at once (a user
who presses twice wants out, even mid-prefill).
"""

from __future__ import annotations

import signal
import threading
from types import TracebackType
from typing import Any


class CtrlC:
    """A context manager that turns the first SIGINT into a flag (main thread only; elsewhere
    it changes nothing and :attr:`pressed` stays False).

    Attributes:
        pressed: True once SIGINT arrived inside the block.
    """

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __enter__(self) -> CtrlC:
        self.pressed = False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

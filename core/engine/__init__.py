"""Continuous batching: requests join and leave a running batch, each equal to its solo run.

    >>> from core.engine import Engine
    >>> engine = Engine(Runner("path/to/model"), max_batch=8).start()
    >>> handle = engine.submit([1, 2, 3], max_tokens=16)
    >>> for event in handle: print(event.text, end="")

See :mod:`core.engine.engine` (the loop), :mod:`core.engine.scheduler` (the policy),
:mod:`core.engine.slots` (the device side) and :mod:`core.engine.request` (one request).
"""

from core.engine.engine import Engine, EngineClosedError, Handle, QueueFullError, StepRunner
from core.engine.request import FINISH_REASONS, Event, Request, Usage

__all__ = ["Engine", "StepRunner", "Handle", "EngineClosedError", "QueueFullError", "Event", "Request", "Usage",
           "FINISH_REASONS"]

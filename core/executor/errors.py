"""The executor's errors (defined in the leaf :mod:`core.errors`, re-exported here): the graph
cannot be planned on a provider, or a kernel returned something other than its node's declared
outputs."""

from __future__ import annotations

from core.errors import KernelOutputError, UnsupportedOpError

__all__ = ["KernelOutputError", "UnsupportedOpError"]

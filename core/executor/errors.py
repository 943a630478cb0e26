"""The executor's errors: the graph cannot be planned on a provider, or a kernel returned
something other than its node's declared outputs."""

from __future__ import annotations


class UnsupportedOpError(ValueError):
    """The provider cannot run some nodes of the graph; the message lists op types and nodes."""


class KernelOutputError(RuntimeError):
    """A kernel returned something other than its node's declared outputs (not a tuple, a
    wrong count, None for a used output, or a dtype / rank the graph does not declare); the
    message names the node, its op type and the kernel."""

"""Output checks: every kernel result is its node's declared outputs.

Output checks. Every kernel result must be a tuple (or list) with one entry per declared node
output (entries past the declared count are tolerated only when None: some kernels return
their op's full output list), and a named output must be a tensor of the dtype and rank the
graph declares (value_info and graph outputs, where given); otherwise
:class:`KernelOutputError`. A result object identical to the node's previous result (eager
launch replay returns the recorded tuple) was checked already and is skipped; another result
object has its type and length checked, and its dtypes and ranks too unless every entry is the
same object as last time (persistent output buffers). So each node is fully checked on its
first call and whenever its buffers change (a new shape), and a replayed node costs one
identity test.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from core.executor.errors import KernelOutputError
from core.executor.hooks import NodeHooks
from core.protocol import Kernel, KernelContext, NodeInfo


def kernel_name(kernel: Any) -> str:
    """``module.qualname`` of a kernel; for a wrapper object (the cuda provider's ReplayKernel)
    the function it wraps (its ``run``) and the wrapper's class."""
    inner = None if hasattr(kernel, "__qualname__") else getattr(kernel, "run", None)
    target = kernel if inner is None else inner
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__qualname__)}"
    return name if inner is None else f"{name} (wrapped by {type(kernel).__qualname__})"


class Step:
    """One node of a run program: the kernel chosen for it, the hooks run around it
    (:class:`core.executor.hooks.NodeHooks`, or None) and its last (checked) result."""

    __slots__ = ("ctx", "hooks", "host", "index", "inputs", "kernel", "last", "outputs")

    def __init__(self, index: int, kernel: Kernel, ctx: KernelContext, node: NodeInfo, host: bool,
                 hooks: NodeHooks | None = None):
        self.index, self.kernel, self.ctx, self.host, self.hooks = index, kernel, ctx, host, hooks
        self.inputs, self.outputs = node.inputs, node.outputs
        self.last = None


def check_outputs(node: NodeInfo, types: dict[str, tuple[np.dtype | None, int | None]], step: Step,
                  results: Any) -> None:
    """Check a result of ``node``'s kernel that is not ``step.last`` (module docstring) against
    ``types`` (value name -> declared dtype and rank, :func:`core.executor.graph.declared_types`).

    Raises:
        KernelOutputError: not a tuple/list, too few entries or a non-None entry past the
            declared outputs, or a named output that is None or of another dtype / rank
            than declared.
    """

    def fail(what: str):
        where = "host kernel" if step.host else "kernel"
        domain = f"{node.domain}." if node.domain else ""
        raise KernelOutputError(f"node {node.name!r} ({domain}{node.op_type}): {where} "
                                f"{kernel_name(step.kernel)} {what}")

    if not isinstance(results, (tuple, list)):
        fail(f"returned a {type(results).__name__}, not a tuple of {len(node.outputs)} output(s)")
    if len(results) != len(node.outputs) and (
            len(results) < len(node.outputs) or any(r is not None for r in results[len(node.outputs):])):
        fail(f"returned {len(results)} entries for {len(node.outputs)} declared output(s)")
    last = step.last
    if last is None or len(last) != len(results) or not all(map(operator.is_, results, last)):
        for name, value in zip(node.outputs, results):
            if not name:
                continue
            if value is None:
                fail(f"returned None for output {name!r}")
            dtype, rank = types.get(name, (None, None))
            got = getattr(value, "dtype", None)
            if dtype is not None and got != dtype:
                fail(f"returned {got} for output {name!r}, declared {dtype}")
            if rank is not None and getattr(value, "ndim", None) != rank:
                fail(f"returned rank {getattr(value, 'ndim', None)} for output {name!r}, declared {rank}")
    step.last = results

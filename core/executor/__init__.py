"""Graph executor: plan an ONNX graph once, then dispatch its nodes to a provider's kernels.

One job per module:

- :mod:`core.executor.graph`: the graph read as node records, declared types, the support check.
- :mod:`core.executor.plan`: :class:`Plan` (construction, memory accounting) and
  :class:`PlanBinding`.
- :mod:`core.executor.folding`: constant folding and the last-position program.
- :mod:`core.executor.prepare`: the providers' plan-time weight hooks and weight memory.
- :mod:`core.executor.weights`: host constants, storages, weight reads, the placer interface.
- :mod:`core.executor.dispatch`: running the per-step program, activation memory, the observer.
- :mod:`core.executor.host`: the injected host fallback of a device provider.
- :mod:`core.executor.checks`: the checks of every kernel result.
- :mod:`core.executor.errors`: the executor's errors.

The names other code imports are re-exported here.
"""

from core.executor.checks import kernel_name
from core.executor.errors import KernelOutputError, UnsupportedOpError
from core.executor.graph import check_supported, constant_branches, node_infos, unsupported_nodes
from core.executor.host import HostFallback, default_host_fallback
from core.executor.plan import Plan, PlanBinding
from core.executor.weights import GATHER_OPS, HOST_CONSTANT_MAX, Placer, WeightRead, is_host_constant, storage

__all__ = [
    "GATHER_OPS", "HOST_CONSTANT_MAX", "HostFallback", "KernelOutputError", "Placer", "Plan", "PlanBinding",
    "UnsupportedOpError", "WeightRead", "check_supported", "constant_branches", "default_host_fallback",
    "is_host_constant", "kernel_name", "node_infos", "storage", "unsupported_nodes",
]

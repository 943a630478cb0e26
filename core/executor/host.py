"""The host fallback: the kernels and memory that run a device provider's host nodes.

Small signed-integer initializers (at most :data:`~core.executor.weights.HOST_CONSTANT_MAX`
elements: axes, shapes, gather indices; :func:`~core.executor.weights.is_host_constant`) stay
host numpy arrays on every provider, as do Constant node values and the shape arithmetic
computed from them. On a device provider (one whose ``allocate`` does not return a host
array), a node whose inputs are all host values (:func:`core.opdefs.is_host`) runs on a host
kernel of its op: the :class:`HostFallback` the plan is given (its ``ops``), or by default the
built-in ``cpu_reference`` provider's, taken from the provider registry
(:func:`default_host_fallback`), so neither the core nor a device provider imports another
provider. The host kernels run on host contexts of their own, whose buffers come from the
fallback's ``memory`` provider: ``ctx.output`` gives a host kernel persistent numpy buffers,
never device tensors. The device provider still answers ``supports`` for every node (it
declares its host-only ops such as Shape or Constant) and its own kernel runs whenever an
input is on the device. The choice is made on the first run for each combination of
graph-input types and kept for later runs with the same combination (a kernel's output types
depend only on its input types; :mod:`core.executor.dispatch`).
"""

from __future__ import annotations

import functools

import attrs

from core.ops import OpTable
from core.protocol import ExecutionProvider
from core.provider import ProviderBase

#: The registry name of the provider whose kernels and memory the default fallback uses.
HOST_PROVIDER = "cpu_reference"


@attrs.frozen
class HostFallback:
    """What runs the host nodes of a device provider (module docstring).

    Attributes:
        ops: the op table whose kernels run nodes whose inputs are all host values.
        memory: the provider whose ``allocate`` gives those kernels' buffers; it must return
            host (numpy) arrays. Shared by every plan given this fallback: allocation keeps no
            state.
    """

    ops: OpTable
    memory: ExecutionProvider

    @classmethod
    def of(cls, provider: ProviderBase) -> HostFallback:
        """The fallback of a host provider that owns an op table (``provider.ops``,
        :attr:`core.provider.ProviderBase.ops`).

        Raises:
            ValueError: ``provider`` has no op table.
        """
        ops = provider.ops
        if ops is None:
            raise ValueError(f"provider {provider.name!r} has no op table to run host nodes with")
        return cls(ops, provider)


@functools.lru_cache(maxsize=1)
def default_host_fallback() -> HostFallback:
    """The fallback over the built-in :data:`HOST_PROVIDER` provider, created once through the
    provider registry (:func:`core.plugins.registry`).

    Raises:
        core.plugins.ProviderError: that provider cannot be created.
    """
    from core.plugins import registry

    return HostFallback.of(registry().create(HOST_PROVIDER))

"""A rank's provider: any provider plus the all-reduce op and the cross-rank argmax.

:class:`TensorParallelProvider` wraps the rank's own provider object. It adds one kernel, the
``lockstep.AllReduce`` node of the sharding plan (:mod:`core.parallel.shard`), which hands
the partial sum to the communicator, and replaces ``device_argmax``: the local logits hold
only this rank's vocab range, so each rank finds its own maximum and the communicator picks
the global one. Everything else (allocation, kernels of the other ops, the IO binding,
``decode_advance``) is the wrapped provider's. ``device_sample`` is absent: sampling over
vocab-sharded logits is not built, so a rank decodes greedily.

On cpu_reference the all-reduce reads the partial back to the host and writes the sum into
the node's output buffer; a GPU backend would instead call NCCL on the device buffers inside
the captured step (docs/parallel.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.parallel.comm import HostCommunicator
from core.parallel.shard import ALL_REDUCE
from core.protocol import Capabilities, NodeInfo


class TensorParallelProvider:
    """``base`` with the all-reduce op and the cross-rank argmax (module docstring).

    Args:
        base: the rank's provider object.
        comm: the rank's :class:`~core.parallel.comm.HostCommunicator`.
        vocab_start: the first token id of this rank's vocab shard (logits column 0).
    """

    def __init__(self, base: Any, comm: HostCommunicator, vocab_start: int):
        self.base, self.comm, self.vocab_start = base, comm, int(vocab_start)
        self.name = base.name

    def __getattr__(self, name: str) -> Any:
        if name in ("device_sample", "begin_capture", "end_capture", "replay") or name.startswith("__"):
            raise AttributeError(name)  # greedy only; eager steps (the all-reduce is a host call)
        return getattr(self.base, name)

    def capabilities(self) -> Capabilities:
        """The base provider's, without graph capture (the host all-reduce cannot be captured)."""
        import attrs

        return attrs.evolve(self.base.capabilities(), graph_capture=False)

    def supports(self, node: NodeInfo) -> bool:
        """The base provider's answer, and True for ``lockstep.AllReduce``."""
        return (node.domain, node.op_type) == ALL_REDUCE or self.base.supports(node)

    def support_reason(self, node: NodeInfo) -> str | None:
        """None for the all-reduce, else the base provider's reason (if it gives one)."""
        if (node.domain, node.op_type) == ALL_REDUCE:
            return None
        return self.base.support_reason(node)

    def prepare(self, node: NodeInfo):
        """The base provider's plan-time hook for ``node`` (none for the all-reduce)."""
        if (node.domain, node.op_type) == ALL_REDUCE:
            return None
        return self.base.prepare(node)

    def kernel(self, node: NodeInfo):
        """The all-reduce kernel for ``lockstep.AllReduce``, else the base provider's kernel."""
        if (node.domain, node.op_type) == ALL_REDUCE:
            return self._all_reduce
        return self.base.kernel(node)

    def _all_reduce(self, ctx, x) -> tuple:
        """Kernel of ``lockstep.AllReduce``: the sum of ``x`` over the ranks into the node's
        output buffer (same shape and dtype as ``x``)."""
        total = self.comm.all_reduce(self.base.download(x))
        out = ctx.output(0, total.shape, total.dtype)
        self.base.write(out, total)
        return (out,)

    def device_argmax(self, logits: Any, positions: Any, result: Any) -> None:
        """Per row ``[token, error]`` over the whole vocabulary: this rank's maximum of its
        shard (fp32, lowest index on ties), then the communicator's pick across ranks
        (max value, lowest token id on ties; a non-finite row on any rank is ``[-1, 1]``).

        Args:
            logits: ``[B, S, V_r]`` this rank's logits; positions: int ``[B]`` the position
                each row reads; result: int32 ``[B, 2]`` written on every rank.
        """
        host = self.base.download(logits)
        pos = np.asarray(self.base.download(positions) if not isinstance(positions, np.ndarray) else positions,
                         np.int64)
        rows = host[np.arange(host.shape[0]), pos].astype(np.float32)
        bad = ~np.isfinite(rows).all(axis=-1)
        local = np.argmax(rows, axis=-1)
        values = rows[np.arange(rows.shape[0]), local]
        out = self.comm.argmax(values, local.astype(np.int64) + self.vocab_start, bad)
        self.base.write(result, out)

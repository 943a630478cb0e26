"""Constant folding and the last-position program of a plan.

After fusion, the nodes whose inputs are all constants (Constant nodes, the int4 tied
embedding's Reshape) run once at load, their weight inputs uploaded first; the others are
the per-step nodes. Initializers stay host arrays until a node needs them on the provider
(:mod:`core.executor.prepare`, "Weight memory").

Last-position program. When the ``logits`` output comes from a projection (MatMul or
MatMulNBits, possibly through a Cast; :func:`core.fusion.logits_projection`) whose K is known,
the plan also holds :attr:`Plan.last_position_steps`: the per-step program with
``Reshape -> Gather(LAST_INDEX) -> Reshape`` before that projection
(:func:`core.fusion.last_position_nodes`), so logits are ``[B, 1, V]`` at the positions named by
the optional feed :data:`core.fusion.LAST_INDEX` (int64 ``[B]``, flat indices into the
``[B * S]`` positions). :meth:`Plan.run` runs it when that feed is given and not None, and the
plain program otherwise (decode steps). The three nodes are appended to ``nodes`` with their
own contexts; the projection keeps its kernel and context. A provider that refuses one of them
gets no such program (prefill then computes every position).

"""

from __future__ import annotations

from typing import Any

import numpy as np

from core import fusion
from core.executor.dispatch import Dispatch
from core.executor.host import HostFallback
from core.executor.weights import Placer, is_host_constant
from core.opdefs import is_host
from core.protocol import KernelContext, NodeInfo


class Folding(Dispatch):
    """Constant folding and constant bookkeeping of :class:`~core.executor.plan.Plan` (module
    docstring)."""

    placer: Placer | None
    _pending: set[str]
    _placed: set[str]
    host_fallback: HostFallback | None

    def _last_position_program(self, lm: int | None, hidden: int | None) -> list[tuple[int, NodeInfo]] | None:
        """The per-step program with the last-position gather before node ``lm`` (module
        docstring); None when there is no such projection, its K is unknown, or the provider
        refuses a new node. The new nodes are appended to ``nodes`` (with their contexts and
        kernels); the projection keeps its index, so its kernel and context are shared."""
        if lm is None or hidden is None or lm not in self.steps:
            return None
        node = self.nodes[lm]
        new, rewired, consts = fusion.last_position_nodes(node, hidden, node.input_dtypes[0] if node.input_dtypes
                                                          else None)
        if not all(self.provider.supports(n) for n in new):
            return None
        fallback = self.host_fallback
        table = None if fallback is None else fallback.ops
        host = self.provider if fallback is None else fallback.memory
        added = []
        for n in new:
            self.nodes.append(n)
            self.contexts.append(KernelContext(n, self.provider, self.kv_layout))
            self.kernels.append(self.provider.kernel(n))
            ref = table.kernel(n) if table is not None and table.supports(n) else None
            self.host_kernels.append(ref)
            self._host_contexts.append(None if ref is None else KernelContext(n, host, self.kv_layout))
            added.append((len(self.nodes) - 1, n))
        self.last_position_constants.update(consts)
        pos = self.steps.index(lm)
        before = [(i, self.nodes[i]) for i in self.steps[:pos]]
        return before + added + [(lm, rewired)] + [(i, self.nodes[i]) for i in self.steps[pos + 1:]]

    def _fold_constants(self) -> list[int]:
        """Run once every node whose inputs are all constants (Constant nodes, the int4 tied
        embedding's Reshape), uploading their weight inputs first, and drop the inputs nothing
        else reads; returns the indices of the nodes left to run per step."""
        steps: list[int] = []
        consumed: set[str] = set()
        for i, node in enumerate(self.nodes):
            if all((not x) or x in self.constants for x in node.inputs):
                # under a placer a node with a host kernel folds on the host arrays: its output
                # (the int4 embedding's reshaped codes) waits on the host for its placement
                on_host = self.placer is not None and (self.host_kernels[i] is not None or not self.host_dispatch)
                args = [(self.constants[x] if on_host else self._value(x)) if x else None for x in node.inputs]
                step = self._step(i, args)
                outs = step.kernel(step.ctx, *args)
                self._check_outputs(step, outs)
                self.constants.update((n, v) for n, v in zip(node.outputs, outs) if n)
                if on_host and self.host_dispatch:
                    self._pending.update(n for n, v in zip(node.outputs, outs)
                                         if n and isinstance(v, np.ndarray) and not is_host_constant(v))
                consumed.update(x for x in node.inputs if x)
                # a folded node never runs again: what its context kept (a replay memo of its
                # inputs, output buffers) must not keep a weight alive once hooks replace it
                step.ctx.cache.clear()
                step.ctx.release()
            else:
                steps.append(i)
        read = {x for i in steps for x in self.nodes[i].inputs} | set(self.output_names)
        for name in consumed - read:  # a folded node's input nothing else reads
            self._drop(name)
        return steps

    def _value(self, name: str) -> Any:
        """Constant ``name``, uploaded first when it is an initializer still on the host."""
        if name in self._pending:
            self._pending.discard(name)
            self.constants[name] = self.provider.upload(self.constants[name])
        return self.constants[name]

    def _weight(self, name: str) -> bool:
        """Whether constant ``name`` is a weight a placer places: an initializer not uploaded yet,
        or a provider tensor; not a host value of a device provider (shapes, axes: they stay
        host arrays)."""
        return name in self._pending or not (self.host_dispatch and is_host(self.constants[name]))

    def _place(self, name: str, node: str, source: str | None = None) -> None:
        """Constant ``name`` is final (no later hook replaces or shares it): uploaded, or where
        the placer puts it. ``node``: its first per-step reader; ``source``: the initializer a
        prepared constant was made from."""
        if self.placer is None:
            self._value(name)
            return
        # popped into the call: the placer holds the last reference to a device copy it stages
        self.constants[name] = self.placer.place(self.as_plan(), name, self.constants.pop(name), node, source or name)
        self._pending.discard(name)
        self._placed.add(name)

    def _drop(self, name: str) -> None:
        """Forget constant ``name`` (its device memory goes back to the provider)."""
        self._pending.discard(name)
        self.constants.pop(name, None)

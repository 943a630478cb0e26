"""The plan: one ONNX graph planned once on one provider, ready to run step after step.

Planning checks every node with ``provider.supports`` (:mod:`core.executor.graph`), applies the
fusion passes of :mod:`core.fusion` the provider supports, asks the provider for one kernel per
node, makes one :class:`~core.protocol.KernelContext` per node and uploads the weights once.
Then it folds the nodes whose inputs are all constants (:mod:`core.executor.folding`) and
prepares weights (:mod:`core.executor.prepare`), placing each one where the placer says
(:mod:`core.executor.weights`). Running is :mod:`core.executor.dispatch`; the host nodes of a
device provider run on an injected fallback (:mod:`core.executor.host`); every kernel result is
checked (:mod:`core.executor.checks`). This module holds the plan's construction, its memory
accounting and :class:`PlanBinding`.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import onnx

from core import fusion
from core.executor.checks import Step
from core.executor.graph import check_supported, constant_branches, declared_types, node_infos, select_branch
from core.executor.hooks import NodeHooks
from core.executor.host import HostFallback, default_host_fallback
from core.executor.prepare import Preparing
from core.executor.weights import Placer, WeightRead, collect_reads, is_host_constant, storage, unread_bytes
from core.opdefs import is_host
from core.protocol import ExecutionProvider, KernelContext


class Plan(Preparing):
    """An executable plan of one graph on one provider (module docstring).

    Args:
        graph: the ONNX graph (initializers loaded).
        initializers: name -> numpy array.
        provider: the execution provider.
        kv_layout: "head_major" or "seq_major", passed to every kernel context.
        host_dispatch: run host nodes on host kernels (:mod:`core.executor.host`); None
            (default): when the provider's tensors are not host arrays.
        logits: the graph output whose last prompt positions prefill reads ("Last-position
            program" in :mod:`core.executor.folding`).
        placer: where each weight goes as it becomes final (:class:`Placer`; "Placement" in
            :mod:`core.executor.weights`), or None: every weight is uploaded.
        host_fallback: the kernels and memory of the host nodes under host dispatch
            (:class:`~core.executor.host.HostFallback`); None (default): the built-in
            cpu_reference provider's (:func:`~core.executor.host.default_host_fallback`).

    Attributes:
        nodes, contexts, kernels: per node (after fusion): its NodeInfo, context, kernel.
        host_kernels: per node, the cpu_reference kernel used when all its inputs are host
            values (None: never; always None without host dispatch).
        hooks: node index -> the :class:`~core.executor.hooks.NodeHooks` run around its kernel
            (:meth:`set_hooks`; weight streaming's copy schedule).
        constants: name -> value (initializers, folded values, prepared weights).
        steps: indices into ``nodes`` of the nodes run per step, in execution order.
        last_position_steps: the last-position program, ``(node index, node)`` pairs in
            execution order, or None when the plan has none (:mod:`core.executor.folding`).
        prepared: names of the constants made by prepare hooks.
        staged_weights: name -> the host copy (:meth:`ProviderBase.stage`) of every constant
            kept in host memory (streamed or mapped), made once for the plan's life.

    Raises:
        UnsupportedOpError: some nodes are not supported by the provider (all are listed).
        KernelOutputError: a kernel run while folding constants returned bad outputs.
    """

    def __init__(self, graph: onnx.GraphProto, initializers: dict[str, np.ndarray],
                 provider: ExecutionProvider, kv_layout: str = "head_major",
                 host_dispatch: bool | None = None, logits: str = "logits", placer: Placer | None = None,
                 host_fallback: HostFallback | None = None):
        self.provider = provider
        self.kv_layout = kv_layout
        #: node index -> the hooks run around its kernel (:mod:`core.executor.hooks`; set with
        #: :meth:`set_hooks`, by weight streaming)
        self.hooks: dict[int, NodeHooks] = {}
        self.nodes = fusion.apply(node_infos(graph), {o.name for o in graph.output}, provider.supports,
                                  set(initializers))
        branches = {i: constant_branches(n) for i, n in enumerate(self.nodes) if n.op_type == "If" and not n.domain}
        self.branches = {i: b for i, b in branches.items() if b is not None}
        check_supported(provider, [n for i, n in enumerate(self.nodes) if i not in self.branches])
        self.contexts = [KernelContext(n, provider, kv_layout) for n in self.nodes]
        self.kernels = [select_branch if i in self.branches else provider.kernel(n)
                        for i, n in enumerate(self.nodes)]
        if host_dispatch is None:
            host_dispatch = not is_host(provider.allocate((1,), np.float32))
        self.host_dispatch = bool(host_dispatch)
        self.host_fallback = (host_fallback or default_host_fallback()) if self.host_dispatch else None
        table = None if self.host_fallback is None else self.host_fallback.ops
        self.host_kernels = [table.kernel(n) if table is not None and table.supports(n) and i not in self.branches
                             else None for i, n in enumerate(self.nodes)]
        host = provider if self.host_fallback is None else self.host_fallback.memory
        self._host_contexts = [None if k is None else KernelContext(n, host, kv_layout)
                               for n, k in zip(self.nodes, self.host_kernels)]
        self._types = declared_types(graph)
        self.input_names = [i.name for i in graph.input]
        self.output_names = [o.name for o in graph.output]
        provider.reset_peak()  # cached pool blocks of earlier work: not this load's peak
        base = provider.peak_bytes()
        #: initializers are uploaded when first needed (:mod:`core.executor.prepare`, "Weight memory")
        self.constants: dict[str, Any] = dict(initializers)
        self._pending: set[str] = {name for name, a in initializers.items() if not is_host_constant(a)}
        for i, (then_values, else_values) in self.branches.items():
            node = self.nodes[i]
            for kind, values in (("then", then_values), ("else", else_values)):
                names = [f"{node.name}:{kind}:{k}" for k in range(len(values))]
                for name, array in zip(names, values):
                    self.constants[name] = array if is_host_constant(array) else provider.upload(array)
                self.contexts[i].cache[kind] = tuple(names)
            self.contexts[i].cache["constants"] = self.constants
        #: host shape constants only the last-position program reads (not weights: kept
        #: out of ``constants``, so weight and residency accounting do not see them)
        self.last_position_constants: dict[str, np.ndarray] = {}
        lm = fusion.logits_projection(self.nodes, logits, set(initializers)) if logits in self.output_names else None
        hidden = None if lm is None else fusion.projection_k(
            self.nodes[lm], {k: tuple(v.shape) for k, v in initializers.items()})
        self.placer = placer
        self.staged_weights: dict[str, Any] = {}
        self._placed: set[str] = set()
        self.steps = self._fold_constants()
        if placer is not None:
            placer.start(self)
        self.prepared = self._prepare()
        for name in sorted(self._pending):  # what no node placed (no per-step node reads it)
            self._place(name, "")
        self.last_position_steps = self._last_position_program(lm, hidden)
        #: device bytes the provider held at the high-water mark of this plan's load above what
        #: it held before (``peak_bytes()``), or None when the provider cannot tell
        peak = None if base is None else provider.peak_bytes()
        self.load_peak_bytes: int | None = None if base is None or peak is None else int(peak) - int(base)
        provider.reset_peak()  # give the blocks freed while packing back to the device
        for value in [*self.constants.values(), *self.last_position_constants.values()]:
            if isinstance(value, np.ndarray):
                value.flags.writeable = False  # constants are shared by every step: never written
        self._programs: dict[tuple, list[Step]] = {}  # (last-position?, feed types or None)
        self._deaths_of: dict[tuple, list] = {}  # the same keys: activation lifetimes (_deaths)
        #: the provider's bytes the last transient run's node buffers held at once, at most (its
        #: live activations: outputs and scratch from ``ctx.output``; a kernel's own temporaries
        #: and the host nodes' buffers are not counted); 0 before any transient run
        self.transient_peak_bytes = 0
        self._live = 0
        self._frozen = False
        self._program: list[Step] = []
        #: an optional node observer (core.kernel_profile): when set, runs every cached program
        self.observer: Any = None

    def with_layout(self, kv_layout: str) -> Plan:
        """This plan for another KV layout, sharing its nodes, kernels and constants (uploaded,
        folded and prepared once): new kernel contexts that read ``kv_layout``, keeping each
        context's static plan-time metadata (what ``prepare`` hooks stored) and none of its
        buffers. The two plans share their constants, so they must not run concurrently on
        different streams (they do not: a provider runs on one stream).
        """
        other = copy.copy(self)
        other.kv_layout = kv_layout

        def fresh(ctx: KernelContext) -> KernelContext:
            new = KernelContext(ctx.node, ctx.provider, kv_layout)
            new.cache = {k: v for k, v in ctx.cache.items() if not str(k).startswith("_")}
            return new

        other.contexts = [fresh(c) for c in self.contexts]
        other._host_contexts = [None if c is None else fresh(c) for c in self._host_contexts]
        other.kernels = list(self.kernels)
        other.host_kernels = list(self.host_kernels)
        other._programs, other._program, other._deaths_of = {}, [], {}
        return other

    def activation_bytes(self, host: bool = True) -> int:
        """Bytes held in the per-node persistent buffers (activations and scratch); with
        ``host`` False only the provider's contexts (on a device provider: device memory),
        else the host contexts' numpy buffers too."""
        return sum(ctx.buffer_bytes() for ctx in (self._every_context() if host else self.contexts))

    def _weight_nbytes(self, name: str, value: Any) -> int:
        """Bytes constant ``name`` takes where the plan puts it: an initializer not yet placed
        and a weight kept in host memory count their bytes (the device may hold them: the
        placer and the residency plan decide), any other value its device bytes."""
        if name in self._pending or name in self.staged_weights:
            return int(getattr(self.staged_weights.get(name, value), "nbytes", 0))
        return self._device_nbytes(value)

    def _device_nbytes(self, value: Any) -> int:
        """Bytes ``value`` takes on the provider: 0 for a host value of a device provider (small
        integer constants stay host arrays there)."""
        if self.host_dispatch and is_host(value):
            return 0
        return int(getattr(value, "nbytes", 0))

    def weight_reads(self) -> list[WeightRead]:
        """The constants the per-step nodes read, in execution order, each listed once at its
        first reader (:class:`WeightRead`); small host constants (axes, shapes) included, with
        0 bytes on a device provider. Prepared weights appear under their own names; a dropped
        original does not. Constants over one storage (a view of another, e.g. the reshaped
        int4 codes of a tied embedding) are one entry, named by the first read, the others in
        its ``aliases``; it is gathered only when every reader of every name gathers."""
        constants = self.constants
        return collect_reads(self.nodes, self.steps,
                             lambda x: id(storage(constants[x])) if x in constants else None,
                             lambda x: self._weight_nbytes(x, constants[x]))

    def unread_bytes(self) -> int:
        """Device bytes of the constants no per-step node reads (a folded node's input another
        constant still views, a constant graph output): resident whatever the residency plan
        (:func:`~core.executor.weights.unread_bytes`; a constant kept in host memory: 0)."""
        read = {x for i in self.steps for x in self.nodes[i].inputs if x}
        return unread_bytes(self.constants, read,
                            lambda name, root: 0 if name in self.staged_weights else self._device_nbytes(root))

    def step_weight_bytes(self) -> int:
        """Bytes of constants one decode step reads in full: each constant input of a per-step
        node, counted once; gather tables are left out (a step reads B rows of them)."""
        return sum(r.nbytes for r in self.weight_reads() if not r.gathered)

    def weight_bytes(self, exclude: Any = ()) -> int:
        """Bytes of the resident constants (initializers, folded values and prepared weights)
        on the provider: each storage counted once (a view of another constant adds nothing),
        host values of a device provider not at all. ``exclude``: names left out (streamed
        weights, which are views of a staging slot)."""
        seen: set[int] = set()
        total = 0
        for name, value in self.constants.items():
            if name in exclude:
                continue
            root = storage(value)
            if id(root) not in seen:
                seen.add(id(root))
                total += self._device_nbytes(root)
        return total


class PlanBinding:
    """A :class:`~core.protocol.DeviceIoBinding` over a :class:`Plan`: bound tensors are fed on
    every :meth:`run` (the same objects each step, so a captured step sees stable pointers).
    :meth:`bind_output` is accepted and ignored: the outputs bound are the KV buffers the
    kernels write in place (the shared KV cache), and the plan returns them as graph outputs."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.inputs: dict[str, Any] = {}

    def bind_input(self, name: str, tensor: Any) -> None:
        self.inputs[name] = tensor

    def bind_output(self, name: str, tensor: Any) -> None:
        """Nothing to do (class docstring): the protocol's method, kept for it."""

    def run(self) -> dict[str, Any]:
        return self.plan.run(self.inputs)

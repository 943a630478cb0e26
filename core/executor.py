"""Graph executor: plan an ONNX graph once, then dispatch its nodes to a provider's kernels.

Planning checks every node with ``provider.supports`` (an unsupported op is reported at load
time, naming each op and node, docs/cases.md 15), applies the fusion passes of :mod:`core.fusion`
the provider supports, asks the provider for one kernel per node, makes one
:class:`~core.protocol.KernelContext` per node and uploads the weights once. Then it folds
the nodes whose inputs are all constants (run once) and prepares weights (below). Running
walks the remaining nodes, :attr:`Plan.steps`, in graph order (the builder writes them
topologically sorted).

Host nodes. Small signed-integer initializers (at most :data:`HOST_CONSTANT_MAX` elements:
axes, shapes, gather indices; :func:`is_host_constant`) stay host numpy arrays on every
provider, as do Constant node values and the shape arithmetic computed from them. On a device
provider (one whose ``allocate`` does not return a host array), a node whose inputs are all host values
(:func:`core.opdefs.is_host`) runs on the cpu_reference kernel of its op, chosen here: the
core imports ``providers.cpu_reference.ops`` lazily for that, so no device provider imports
another provider. The host kernels run on host contexts of their own, whose buffers come from
a cpu_reference provider (:func:`host_memory`, imported lazily too): ``ctx.output`` gives a
host kernel persistent numpy buffers, never device tensors. The provider still answers
``supports`` for every node (it declares its host-only ops such as Shape or Constant) and its
own kernel runs whenever an input is on the device. The choice is made on the first run for
each combination of graph-input types and kept for later runs with the same combination (a
kernel's output types depend only on its input types).

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

Prepared weights. A provider may offer ``prepare(node) -> hook | None`` (an optional member;
:meth:`core.ops.OpTable.prepare` returns the op module's ``prepare``, see :mod:`core.ops`).
After folding, the hook of every per-step node with constant inputs is called once with the
node's context and its inputs (constants, else None); the replacements it returns become new
constants named ``f"{node.name}:prepared:{i}"`` that the node reads instead, an input it
drops becomes absent, and a replaced constant that no per-step node still reads is dropped
(:meth:`Plan.weight_bytes` counts what stays). Kernels also run unprepared (a direct call or
a fed weight); a prepared node never runs on a host kernel.

Weight memory. Initializers stay host arrays until a node needs them on the provider: a
folded node's inputs are uploaded before it runs, a prepared node's constant inputs just
before its hook (nodes that read one weight are prepared one after the other, so a weight
several hooks replace, the tied embedding, is on the device for those hooks only), and every
other weight after the prepare pass. A replaced weight is dropped as soon as its last
per-step reader has been prepared, and a folded node's input nothing else reads after
folding; ``reset_peak()`` at the end returns the freed blocks. So the device holds one copy
of each weight in the form its kernels read, and the load's peak is those weights plus one
node's raw inputs and its hook's transient (:attr:`Plan.load_peak_bytes` measures it).
During the pass every hook's ``ctx.cache[core.ops.PREPARE_SHARED]`` is one dict, where hooks
that derive the same form of one constant share it; a prepared object several hooks return
becomes one constant. :meth:`Plan.weight_bytes` counts each storage once (a constant that
is a view of another adds nothing) and :meth:`Plan.weight_reads` reports such views as
aliases of one weight.

Placement. With a placer (:class:`Placer`, given by the Runner under a weight budget), each
constant is handed to it once it is final, in execution order: an initializer when its last
per-step reader has been prepared, a prepared form right after its hook. The placer keeps it
on the device (uploading it if still on the host), or in pinned host memory (staged or mapped,
recorded in :attr:`Plan.staged_weights`); it also says whether a hook runs on device copies of
its node's weights or on the host arrays. So the device holds only what the placer keeps plus
one node's scratch, never the whole model (:mod:`core.runtime.placement`).

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

Activation memory. A decode step keeps every node's output buffers from step to step (stable
pointers for capture and eager replay; a few rows each). A prefill does not need to: its buffers
are [B * S, ...] and the next decode step uses other shapes. So a *transient* run (by default
every run of the last-position program, the prefills; ``Plan.run(..., transient=...)`` chooses)
marks every kernel context ``transient`` and, right after the last node that reads a node's
outputs, drops that node's buffers of this run (:meth:`KernelContext.release_transient`; a buffer
a captured graph holds is never dropped) and the run's references to them. The provider's
allocator then hands the same memory to later nodes, so the run's peak is its live activations
(a layer or two) rather than one buffer per node of every layer: for 8,192 prompt tokens of a
16-layer model, hundreds of MB instead of several GB. Dropping a buffer only drops the context's
reference, so a graph output the run returns (the logits) keeps its memory; after the run every
buffer of it is dropped from the contexts (also when a kernel raised). The lifetimes are
computed once per program (:meth:`Plan._deaths`), and :attr:`Plan.transient_peak_bytes` says
how many bytes the run's node buffers held at once.

Observer. :attr:`Plan.observer`, when set, is told about every node of a run (``begin(node)``,
``end(node, args, results)``; :class:`core.kernel_profile.NodeObserver` counts and times them).
"""

from __future__ import annotations

import copy
import functools
import importlib
import operator
from typing import Any, NamedTuple, Protocol

import attrs
import numpy as np
import onnx
from onnx import helper, numpy_helper

from core import fusion
from core.errors import KernelOutputError, UnsupportedOpError  # noqa: F401 (re-exported)
from core.opdefs import constant_supports, constant_value, is_host
from core.ops import PREPARE_SHARED, STORAGE_NAMES, OpTable
from core.protocol import ExecutionProvider, Kernel, KernelContext, NodeInfo

HOST_CONSTANT_MAX = 64
GATHER_OPS = ("Gather", "GatherBlockQuantized", "GatherColumns")
#: The op package whose kernels run the host nodes of a device provider.
REFERENCE_OPS = "providers.cpu_reference.ops"
#: The module of the provider whose host buffers those kernels write into.
REFERENCE_PROVIDER = "providers.cpu_reference.provider"


class Placer(Protocol):
    """Where each weight goes as a plan loads (module docstring, "Placement";
    :class:`core.runtime.placement.BudgetPlacer`)."""

    def start(self, plan: Plan) -> None:
        """The graph is fused and folded; no weight is prepared yet."""

    def prepare_on_device(self, plan: Plan, node: NodeInfo) -> bool:
        """Whether ``node``'s prepare hook runs on device copies of its weights (else on the
        host arrays)."""

    def place(self, plan: Plan, name: str, value: Any, node: str, source: str) -> Any:
        """What constant ``name`` becomes now that it is final (first read by ``node``, made
        from initializer ``source``)."""


def storage(value: Any) -> Any:
    """The array that owns ``value``'s memory: ``value``'s ``.base`` chain followed while it
    holds arrays (numpy and CuPy views; a buffer object such as ``bytes`` ends it)."""
    root = value
    while True:
        base = getattr(root, "base", None)
        if base is None or not hasattr(base, "shape") or not hasattr(base, "nbytes"):
            return root
        root = base


def _bytes_key(value: Any) -> tuple:
    """What identifies the bytes ``value`` shows, in order: its storage, its offset there, its
    size and, unless C-contiguous, its shape and strides (two C-contiguous views of one range
    show the same bytes in the same order, whatever their shapes)."""
    root = storage(value)

    def address(a: Any) -> int:
        ptr = getattr(getattr(a, "data", None), "ptr", None)  # CuPy
        if ptr is None:
            ptr = getattr(a, "__array_interface__", {}).get("data", (0,))[0]  # NumPy
        return int(ptr)

    flags = getattr(value, "flags", None)
    contiguous = bool(getattr(flags, "c_contiguous", True))
    key: tuple = (id(root), address(value) - address(root), int(getattr(value, "nbytes", 0)), contiguous)
    return key if contiguous else (*key, tuple(getattr(value, "shape", ())), tuple(getattr(value, "strides", ())))


class WeightRead(NamedTuple):
    """A constant read by a per-step node (:meth:`Plan.weight_reads`).

    Attributes:
        step: position in execution order (the node is ``plan.nodes[plan.steps[step]]``).
        node: name of the first per-step node that reads the constant.
        constant: key in :attr:`Plan.constants`.
        nbytes: bytes of the constant.
        gathered: True when every per-step reader gathers rows of it (a Gather,
            GatherBlockQuantized or GatherColumns table: a step reads B rows, not the whole
            tensor).
        aliases: other constants over the same storage (views of it), read by later nodes.
    """

    step: int
    node: str
    constant: str
    nbytes: int
    gathered: bool
    aliases: tuple[str, ...] = ()


def _attr_value(attr: onnx.AttributeProto) -> Any:
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode() for v in value]
    return value


def _declared_dtypes(graph: onnx.GraphProto) -> dict[str, np.dtype]:
    out = {}
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        et = vi.type.tensor_type.elem_type
        if et:
            out[vi.name] = np.dtype(helper.tensor_dtype_to_np_dtype(et))
    for init in graph.initializer:
        out[init.name] = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type))
    return out


def node_infos(graph: onnx.GraphProto) -> list[NodeInfo]:
    """The graph's nodes as :class:`NodeInfo` (attributes decoded, declared input dtypes)."""
    dtypes = _declared_dtypes(graph)
    infos = []
    for i, n in enumerate(graph.node):
        infos.append(NodeInfo(
            name=n.name or f"{n.op_type}_{i}", op_type=n.op_type, domain=n.domain or "",
            attrs={a.name: _attr_value(a) for a in n.attribute},
            inputs=tuple(n.input), outputs=tuple(n.output),
            input_dtypes=tuple(dtypes.get(x) for x in n.input)))
    return infos


def constant_branches(node: NodeInfo) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """The output values of an ONNX ``If`` node's two branches when each branch computes its
    outputs from Constant nodes and its own initializers alone (the LongRoPE rope caches);
    None otherwise (a branch that reads outer values or runs other ops).

    Returns:
        (then values, else values), each in the branch's output order.
    """
    out = []
    for key in ("then_branch", "else_branch"):
        branch = node.attrs.get(key)
        if not isinstance(branch, onnx.GraphProto):
            return None
        values = {t.name: numpy_helper.to_array(t) for t in branch.initializer}
        for n in branch.node:
            info = NodeInfo(name=n.name, op_type=n.op_type, domain=n.domain or "",
                            attrs={a.name: _attr_value(a) for a in n.attribute}, inputs=tuple(n.input),
                            outputs=tuple(n.output), input_dtypes=())
            if n.op_type != "Constant" or n.domain or len(n.output) != 1 or not constant_supports(info):
                return None
            values[n.output[0]] = constant_value(info)
        if any(o.name not in values for o in branch.output):
            return None
        out.append([values[o.name] for o in branch.output])
    if len(out[0]) != len(out[1]) or len(out[0]) != len(node.outputs):
        return None
    return out[0], out[1]


def _select_branch(ctx: KernelContext, cond: Any) -> tuple:
    """The kernel of an ``If`` node with constant branches (:func:`constant_branches`): the
    plan constants of the branch a host boolean scalar ``cond`` selects (no copy, no launch).

    Raises:
        ValueError: ``cond`` is not a host value of one element.
    """
    if not is_host(cond) or np.asarray(cond).size != 1:
        raise ValueError(f"If node {ctx.node.name!r}: the condition must be a host boolean of one element "
                         f"(a shape comparison), got {type(cond).__name__}")
    names = ctx.cache["then" if bool(np.asarray(cond).reshape(-1)[0]) else "else"]
    constants = ctx.cache["constants"]
    return tuple(constants[name] for name in names)


def unsupported_nodes(provider: ExecutionProvider, nodes: list[NodeInfo]) -> list[str]:
    """One line per node ``provider`` does not support: its domain, op type, name and why
    (the provider's ``support_reason`` when it has one, else its input dtypes and
    attributes); graph-valued attributes are named, not printed."""
    explain = getattr(provider, "support_reason", None)
    lines = []
    for n in nodes:
        if provider.supports(n):
            continue
        reason = explain(n) if explain is not None else None
        if not reason:
            dtypes = ", ".join("-" if d is None else np.dtype(d).name for d in n.input_dtypes)
            attributes = ", ".join(f"{k}=<graph>" if isinstance(v, onnx.GraphProto) else f"{k}={v!r}"
                                   for k, v in sorted(n.attrs.items()))
            reason = f"dtypes [{dtypes}] attrs {{{attributes}}}"
        lines.append(f"{n.domain or 'ai.onnx'}.{n.op_type} at node {n.name!r}: {reason}")
    return lines


def check_supported(provider: ExecutionProvider, nodes: list[NodeInfo]) -> None:
    """Raise one :class:`UnsupportedOpError` listing every node of ``nodes`` the provider does
    not support (:func:`unsupported_nodes`; no truncation), before anything is uploaded."""
    lines = unsupported_nodes(provider, nodes)
    if lines:
        kinds = sorted({line.split(" at node ")[0] for line in lines})
        raise UnsupportedOpError(
            f"provider {provider.name!r} does not support {len(lines)} node(s) of {len(kinds)} kind(s) "
            f"({', '.join(kinds)}): " + "; ".join(lines))


def is_host_constant(array: np.ndarray) -> bool:
    """True for initializers kept on the host: signed integer or bool tensors (shapes, axes,
    indices) of at most HOST_CONSTANT_MAX elements. Unsigned ones are quantized data (uint8
    codes and zero points) that device kernels read, so they are uploaded whatever their size."""
    return array.dtype.kind in "ib" and array.size <= HOST_CONSTANT_MAX


def _declared_types(graph: onnx.GraphProto) -> dict[str, tuple[np.dtype | None, int | None]]:
    """Value name -> (dtype, rank) declared by value_info and graph outputs (None: not declared).

    Outputs of Constant nodes are left out: their tensor attribute is their type, and the
    builder declares them with an empty shape (rank 0) whatever the tensor's rank."""
    constants = {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    out = {}
    for vi in [v for v in graph.value_info if v.name not in constants] + list(graph.output):
        tensor = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type)) if tensor.elem_type else None
        out[vi.name] = (dtype, len(tensor.shape.dim) if tensor.HasField("shape") else None)
    return out


@functools.lru_cache(maxsize=1)
def reference_ops() -> OpTable:
    """The op table of :data:`REFERENCE_OPS` (imported on first use)."""
    return OpTable(importlib.import_module(REFERENCE_OPS))


@functools.lru_cache(maxsize=1)
def host_memory() -> ExecutionProvider:
    """The allocator of the host contexts (module docstring, "Host nodes"): a
    ``CpuReferenceProvider`` of :data:`REFERENCE_PROVIDER` (imported on first use), whose
    ``allocate`` returns numpy arrays. Shared by every plan: allocation keeps no state."""
    return importlib.import_module(REFERENCE_PROVIDER).CpuReferenceProvider()


def kernel_name(kernel: Any) -> str:
    """``module.qualname`` of a kernel; for a wrapper object (the cuda provider's ReplayKernel)
    the function it wraps (its ``run``) and the wrapper's class."""
    inner = None if hasattr(kernel, "__qualname__") else getattr(kernel, "run", None)
    target = kernel if inner is None else inner
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__qualname__)}"
    return name if inner is None else f"{name} (wrapped by {type(kernel).__qualname__})"


class _Step:
    """One node of a run program: the kernel chosen for it and its last (checked) result."""

    __slots__ = ("ctx", "host", "index", "inputs", "kernel", "last", "outputs")

    def __init__(self, index: int, kernel: Kernel, ctx: KernelContext, node: NodeInfo, host: bool):
        self.index, self.kernel, self.ctx, self.host = index, kernel, ctx, host
        self.inputs, self.outputs = node.inputs, node.outputs
        self.last = None


class Plan:
    """An executable plan of one graph on one provider (module docstring).

    Args:
        graph: the ONNX graph (initializers loaded).
        initializers: name -> numpy array.
        provider: the execution provider.
        kv_layout: "head_major" or "seq_major", passed to every kernel context.
        host_dispatch: run host nodes on the cpu_reference kernels (module docstring); None
            (default): when the provider's tensors are not host arrays.
        logits: the graph output whose last prompt positions prefill reads ("Last-position
            program" in the module docstring).
        placer: where each weight goes as it becomes final (:class:`Placer`; "Placement" in
            the module docstring), or None: every weight is uploaded.

    Attributes:
        nodes, contexts, kernels: per node (after fusion): its NodeInfo, context, kernel.
        host_kernels: per node, the cpu_reference kernel used when all its inputs are host
            values (None: never; always None without host dispatch).
        constants: name -> value (initializers, folded values, prepared weights).
        steps: indices into ``nodes`` of the nodes run per step, in execution order.
        last_position_steps: the last-position program, ``(node index, node)`` pairs in
            execution order, or None when the plan has none (module docstring).
        prepared: names of the constants made by prepare hooks.
        staged_weights: name -> the host copy (:meth:`ProviderBase.stage`) of every constant
            kept in host memory (streamed or mapped), made once for the plan's life.

    Raises:
        UnsupportedOpError: some nodes are not supported by the provider (all are listed).
        KernelOutputError: a kernel run while folding constants returned bad outputs.
    """

    def __init__(self, graph: onnx.GraphProto, initializers: dict[str, np.ndarray],
                 provider: ExecutionProvider, kv_layout: str = "head_major",
                 host_dispatch: bool | None = None, logits: str = "logits", placer: Placer | None = None):
        self.provider = provider
        self.kv_layout = kv_layout
        self.nodes = fusion.apply(node_infos(graph), {o.name for o in graph.output}, provider.supports,
                                  set(initializers))
        branches = {i: constant_branches(n) for i, n in enumerate(self.nodes) if n.op_type == "If" and not n.domain}
        self.branches = {i: b for i, b in branches.items() if b is not None}
        check_supported(provider, [n for i, n in enumerate(self.nodes) if i not in self.branches])
        self.contexts = [KernelContext(n, provider, kv_layout) for n in self.nodes]
        self.kernels = [_select_branch if i in self.branches else provider.kernel(n)
                        for i, n in enumerate(self.nodes)]
        if host_dispatch is None:
            host_dispatch = not is_host(provider.allocate((1,), np.float32))
        self.host_dispatch = bool(host_dispatch)
        table = reference_ops() if self.host_dispatch else None
        self.host_kernels = [table.kernel(n) if table is not None and table.supports(n) and i not in self.branches
                             else None for i, n in enumerate(self.nodes)]
        host = host_memory() if self.host_dispatch else provider
        self._host_contexts = [None if k is None else KernelContext(n, host, kv_layout)
                               for n, k in zip(self.nodes, self.host_kernels)]
        self._types = _declared_types(graph)
        self.input_names = [i.name for i in graph.input]
        self.output_names = [o.name for o in graph.output]
        reset = getattr(provider, "reset_peak", None)
        peak = getattr(provider, "peak_bytes", None)
        if reset is not None:
            reset()  # cached pool blocks of earlier work: not this load's peak
        base = peak() if peak is not None else None
        #: initializers are uploaded when first needed (module docstring, "Weight memory")
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
        self.load_peak_bytes: int | None = None if base is None or peak is None else int(peak()) - int(base)
        if reset is not None:
            reset()  # give the blocks freed while packing back to the device
        for value in [*self.constants.values(), *self.last_position_constants.values()]:
            if isinstance(value, np.ndarray):
                value.flags.writeable = False  # constants are shared by every step: never written
        self._programs: dict[tuple, list[_Step]] = {}  # (last-position?, feed types or None)
        self._deaths_of: dict[tuple, list] = {}  # the same keys: activation lifetimes (_deaths)
        #: the provider's bytes the last transient run's node buffers held at once, at most (its
        #: live activations: outputs and scratch from ``ctx.output``; a kernel's own temporaries
        #: and the host nodes' buffers are not counted); 0 before any transient run
        self.transient_peak_bytes = 0
        self._live = 0
        self._frozen = False
        self._program: list[_Step] = []
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

    def _step(self, i: int, args: list, node: NodeInfo | None = None) -> _Step:
        """Node ``i``'s step for these argument values: its host kernel when it has one and
        every argument is a host value, else the provider's kernel. ``node``: the node's
        inputs and outputs when they differ from ``nodes[i]`` (the last-position program)."""
        node = self.nodes[i] if node is None else node
        kernel, ctx = self.host_kernels[i], self._host_contexts[i]
        if kernel is not None and ctx is not None and all(map(is_host, args)):
            return _Step(i, kernel, ctx, node, True)
        return _Step(i, self.kernels[i], self.contexts[i], node, False)

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
        table = reference_ops() if self.host_dispatch else None
        host = host_memory() if self.host_dispatch else self.provider
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
        self.constants[name] = self.placer.place(self, name, self.constants.pop(name), node, source or name)
        self._pending.discard(name)
        self._placed.add(name)

    def _drop(self, name: str) -> None:
        """Forget constant ``name`` (its device memory goes back to the provider)."""
        self._pending.discard(name)
        self.constants.pop(name, None)

    def _prepare(self) -> list[str]:
        """Apply the provider's ``prepare`` hooks to the per-step nodes (module docstring,
        "Prepared weights" and "Weight memory"); returns the names of the new constants.

        Raises:
            ValueError: a hook replaced an input that is not a constant.
        """
        lookup = getattr(self.provider, "prepare", None)
        made: list[str] = []
        # per-step readers left of every constant: a replaced one goes as its last reader is done
        left: dict[str, int] = {}
        for i in self.steps:
            for x in set(self.nodes[i].inputs):
                if x in self.constants:
                    left[x] = left.get(x, 0) + 1
        kept: set[str] = set(self.output_names)  # constants a processed node still reads as they are
        replaced: set[str] = set()
        names: dict[int, str] = {}  # id of a prepared value -> its constant name (shared forms)
        shared: dict = {STORAGE_NAMES: self._storage_names()}  # ctx.cache[PREPARE_SHARED] of every hook
        sharing: list[tuple[list, list[str]]] = []  # (keys a hook added to shared, its node's constants)
        for i in self._prepare_order():
            node = self.nodes[i]
            hook = None if lookup is None else lookup(node)
            here = [x for x in dict.fromkeys(node.inputs) if x in left]
            if hook is not None and any(x in self.constants for x in node.inputs if x):
                on_device = self.placer is None or self.placer.prepare_on_device(self, node)
                args = [(self._value(x) if on_device else self.constants[x]) if x in self.constants else None
                        for x in node.inputs]
                ctx = self.contexts[i]
                ctx.cache[PREPARE_SHARED] = shared
                before = set(shared)
                try:
                    changes = hook(ctx, *args)
                finally:
                    ctx.cache.pop(PREPARE_SHARED, None)
                del args
                sharing.append(([k for k in shared if k not in before], here))
                if changes:
                    for name, source in self._apply_changes(i, changes, replaced, names, made):
                        self._place(name, node.name, source)
                del changes
            kept.update(x for x in self.nodes[i].inputs if x in left)
            for x in here:
                left[x] -= 1
                if left[x]:
                    continue
                if x in replaced and x not in kept:
                    self._drop(x)  # its last reader read a prepared form: never uploaded again
                elif x not in self._placed and x in self.constants and self._weight(x):
                    self._place(x, node.name)
            # a shared form whose sources have no hook left to ask for it: dropped from the
            # dict, so a form the placer moved to host memory leaves the device now
            for keys, _ in [e for e in sharing if not any(left[x] for x in e[1])]:
                for k in keys:
                    shared.pop(k, None)
            sharing = [e for e in sharing if any(left[x] for x in e[1])]
        still_read = {x for i in self.steps for x in self.nodes[i].inputs} | set(self.output_names)
        for name in replaced - still_read:
            self._drop(name)
        return made

    def _storage_names(self) -> dict[str, str]:
        """{constant: the first constant (in name order) holding the same bytes in the same
        order}, for the uploaded constants (core.ops.STORAGE_NAMES): a contiguous view of a whole
        weight (a folded Reshape) is named by that weight; a slice or a transposed view is not.
        Every value is alive while this runs, so the ids of their storages are distinct; the
        result holds names only."""
        first: dict[tuple, str] = {}
        out: dict[str, str] = {}
        for name in sorted(self.constants):
            if name not in self._pending:
                out[name] = first.setdefault(_bytes_key(self.constants[name]), name)
        return out

    def _prepare_order(self) -> list[int]:
        """:attr:`steps` with the later readers of a weight moved up behind its first reader (the
        tied embedding's lookup and the lm_head), so a weight several hooks replace is on the
        device for those hooks only. Hooks do not depend on each other's order."""
        readers: dict[str, list[int]] = {}
        for i in self.steps:
            for x in dict.fromkeys(self.nodes[i].inputs):
                if x in self._pending:
                    readers.setdefault(x, []).append(i)
        order: dict[int, None] = {}
        for i in self.steps:
            order.setdefault(i)
            for x in dict.fromkeys(self.nodes[i].inputs):
                for j in readers.get(x, ()):
                    order.setdefault(j)
        return list(order)

    def _apply_changes(self, i: int, changes: dict, replaced: set, names: dict, made: list) -> list[tuple[str, str]]:
        """Rewire node ``i`` to a hook's replacements (module docstring, "Prepared weights"):
        new constants named ``{node}:prepared:{j}`` (one name for one object, however many
        hooks return it), dropped inputs absent. Returns (new constant, the input it replaced)
        for each constant made here.

        Raises:
            ValueError: a replaced input is not a constant.
        """
        node = self.nodes[i]
        inputs = list(node.inputs)
        dtypes = list(node.input_dtypes) + [None] * (len(inputs) - len(node.input_dtypes))
        new: list[tuple[str, str]] = []
        for j, value in sorted(changes.items()):
            if not 0 <= j < len(inputs) or not inputs[j] or inputs[j] not in self.constants:
                raise ValueError(f"prepare hook of node {node.name!r} ({node.op_type}) replaced input {j}, "
                                 "which is not a constant")
            replaced.add(inputs[j])
            if value is None:
                inputs[j], dtypes[j] = "", None
                continue
            name = names.get(id(value))
            if name is None or self.constants.get(name) is not value:
                name = names[id(value)] = f"{node.name}:prepared:{j}"
                self.constants[name] = value
                made.append(name)
                new.append((name, inputs[j]))
            inputs[j], dtypes[j] = name, np.dtype(value.dtype)
        self.nodes[i] = self.contexts[i].node = attrs.evolve(node, inputs=tuple(inputs), input_dtypes=tuple(dtypes))
        self.host_kernels[i] = None  # a reference kernel does not read the prepared form
        return new

    def _check_outputs(self, step: _Step, results: Any) -> None:
        """Check a result that is not ``step.last`` (module docstring, "Output checks").

        Raises:
            KernelOutputError: not a tuple/list, too few entries or a non-None entry past the
                declared outputs, or a named output that is None or of another dtype / rank
                than declared.
        """
        node = self.nodes[step.index]

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
                dtype, rank = self._types.get(name, (None, None))
                got = getattr(value, "dtype", None)
                if dtype is not None and got != dtype:
                    fail(f"returned {got} for output {name!r}, declared {dtype}")
                if rank is not None and getattr(value, "ndim", None) != rank:
                    fail(f"returned rank {getattr(value, 'ndim', None)} for output {name!r}, declared {rank}")
        step.last = results

    def _every_context(self) -> list[KernelContext]:
        return self.contexts + [c for c in self._host_contexts if c is not None]

    def set_frozen(self, frozen: bool) -> None:
        """Forbid (True) or allow (False) buffer allocation in every kernel context (capture)."""
        self._frozen = frozen
        for ctx in self._every_context():
            ctx.frozen = frozen

    def release_buffers(self) -> int:
        """Drop the kernel contexts' buffers that no captured graph uses (KernelContext.release);
        returns the bytes dropped."""
        return sum(ctx.release() for ctx in self._every_context())

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
        reads: list[WeightRead] = []
        first: dict[int, int] = {}  # id of the storage -> index in reads
        for pos, i in enumerate(self.steps):
            node = self.nodes[i]
            for j, x in enumerate(node.inputs):
                if not x or x not in self.constants:
                    continue
                value = self.constants[x]
                gathered = node.op_type in GATHER_OPS and j != 1  # input 1 is the indices
                key = id(storage(value))
                k = first.get(key)
                if k is None:
                    first[key] = len(reads)
                    reads.append(WeightRead(pos, node.name, x, self._weight_nbytes(x, value), gathered))
                    continue
                r = reads[k]
                if x != r.constant and x not in r.aliases:
                    r = r._replace(aliases=(*r.aliases, x))
                reads[k] = r._replace(gathered=r.gathered and gathered)
        return reads

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

    def reset_dispatch(self) -> None:
        """Forget the host/device kernel choices (module docstring, "Host nodes"): the next run
        chooses again. Needed only after replacing constants by values of another kind (a
        device weight by a host array); the choices are keyed by the graph inputs' types."""
        self._programs.clear()

    def host_nodes(self) -> list[str]:
        """Names of the nodes the latest run ran on host (cpu_reference) kernels."""
        return [self.nodes[s.index].name for s in self._program if s.host]

    def run(self, feeds: dict[str, Any], transient: bool | None = None) -> dict[str, Any]:
        """Run the graph. ``feeds`` maps every graph input to a tensor (and optionally
        :data:`core.fusion.LAST_INDEX`: the last-position program); returns graph outputs.

        ``transient``: free each node's buffers once the run no longer reads them ("Activation
        memory" in the module docstring); None (default): for runs of the last-position
        program, the prefills, and not for the others (decode steps keep theirs). Never while
        the plan is frozen (a capture: the graph keeps the buffers' pointers).

        Raises:
            KeyError: a graph input is not fed.
            KernelOutputError: a kernel returned bad outputs (module docstring).
        """
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise KeyError(f"graph inputs not fed: {', '.join(missing)}")
        values: dict[str, Any] = dict(self.constants)
        values.update(feeds)
        gathered = self.last_position_steps if feeds.get(fusion.LAST_INDEX) is not None else None
        if gathered is not None:
            values.update(self.last_position_constants)
        if transient is None or self._frozen:  # a capture records buffers that must outlive it
            transient = gathered is not None and not self._frozen
        key = (gathered is not None, tuple(type(feeds[n]) for n in self.input_names) if self.host_dispatch else None)
        program = self._programs.get(key)
        order: list[tuple[int, NodeInfo]] = []
        if program is None:
            order = gathered if gathered is not None else [(i, self.nodes[i]) for i in self.steps]
        deaths = self._deaths(key, order if program is None else program) if transient else None
        if deaths is not None:
            self._live = self.transient_peak_bytes = 0
            for ctx in self._every_context():
                ctx.transient = True
        try:
            if program is None:
                self._program = self._programs[key] = self._dispatch(values, order, deaths)
            else:
                self._program = program
                self._execute(program, values, deaths)
        finally:
            if deaths is not None:
                for ctx in self._every_context():
                    ctx.transient = False
                    ctx.release_transient()  # a run that raised: nothing of it is kept either
        return {name: values[name] for name in self.output_names}

    def _deaths(self, key: tuple, order: list) -> list[tuple[list[int], list[str]]]:
        """Activation lifetimes of the program ``key`` (``order``: its steps or its ``(index,
        node)`` pairs): after position p, the positions whose nodes' buffers die (every output
        read for the last time, or never read) and the value names that die (graph outputs
        never do: the run returns them). A node that also writes a graph output (attention
        with its present KV, the lm_head with the logits) still drops its buffers: what the
        run returns keeps its own reference, so its memory is not reused while it lives."""
        cached = self._deaths_of.get(key)
        if cached is not None:
            return cached
        ios = [(s.inputs, s.outputs) if isinstance(s, _Step) else (s[1].inputs, s[1].outputs) for s in order]
        last_read: dict[str, int] = {}
        made: dict[str, int] = {}
        for pos, (inputs, outputs) in enumerate(ios):
            for x in inputs:
                if x:
                    last_read[x] = pos
            for y in outputs:
                if y:
                    made[y] = pos
        returned = set(self.output_names)
        deaths: list[tuple[list[int], list[str]]] = [([], []) for _ in ios]
        for pos, (_, outputs) in enumerate(ios):
            names = [y for y in outputs if y]
            ends = [max(pos, last_read.get(y, pos)) for y in names]
            deaths[max(ends, default=pos)][0].append(pos)
            for y, end in zip(names, ends):
                # the run returns graph outputs: their values stay (and so does their memory: a
                # context that drops a buffer only drops its own reference)
                if made[y] == pos and y not in returned:  # a graph never writes a name twice
                    deaths[end][1].append(y)
        self._deaths_of[key] = deaths
        return deaths

    def _free(self, program: list[_Step], values: dict[str, Any], pos: int,
              death: tuple[list[int], list[str]]) -> None:
        """After position ``pos`` of a transient run: count what its node allocated, then drop
        what dies there (:meth:`_deaths`), keeping :attr:`transient_peak_bytes` up to date."""
        step = program[pos]
        if not step.host:
            self._live += step.ctx.take_transient_allocated()
            self.transient_peak_bytes = max(self.transient_peak_bytes, self._live)
        for dead in death[0]:
            freed = program[dead].ctx.release_transient()
            if not program[dead].host:
                self._live -= freed
            program[dead].last = None
        for name in death[1]:
            values.pop(name, None)

    def _execute(self, program: list[_Step], values: dict[str, Any],
                 deaths: list[tuple[list[int], list[str]]] | None) -> None:
        """:meth:`run`'s loop over a cached program; with :attr:`observer` set, the observer is
        told about every node: ``begin(node)`` before its kernel, ``end(node, args, results)``
        after (``node`` a NodeInfo; it may time it, e.g. with device events, or count its
        work). ``deaths``: a transient run's lifetimes (:meth:`_deaths`), or None."""
        observer = self.observer
        if observer is None and deaths is None:  # the decode step: nothing but the kernels
            for step in program:
                results = step.kernel(step.ctx, *[values[x] if x else None for x in step.inputs])
                if results is not step.last:
                    self._check_outputs(step, results)
                for name, value in zip(step.outputs, results):
                    if name:
                        values[name] = value
            return
        for pos, step in enumerate(program):
            args = [values[x] if x else None for x in step.inputs]
            if observer is not None:
                observer.begin(self.nodes[step.index])
            results = step.kernel(step.ctx, *args)
            if observer is not None:
                observer.end(self.nodes[step.index], args, results)
            del args
            if results is not step.last:
                self._check_outputs(step, results)
            for name, value in zip(step.outputs, results):
                if name:
                    values[name] = value
            del results
            if deaths is not None:
                self._free(program, values, pos, deaths[pos])

    def _dispatch(self, values: dict[str, Any], order: list[tuple[int, NodeInfo]],
                  deaths: list[tuple[list[int], list[str]]] | None = None) -> list[_Step]:
        """Run the nodes of ``order`` (``(index, node)`` pairs), choosing each node's kernel
        from its argument values (host dispatch); returns the program of the choices.
        ``deaths``: as :meth:`_execute`'s."""
        program = []
        observer = self.observer
        for pos, (i, node) in enumerate(order):
            args = [values[x] if x else None for x in node.inputs]
            step = self._step(i, args, node)
            if observer is not None:
                observer.begin(self.nodes[i])
            results = step.kernel(step.ctx, *args)
            if observer is not None:
                observer.end(self.nodes[i], args, results)
            del args
            self._check_outputs(step, results)
            for name, value in zip(node.outputs, results):
                if name:
                    values[name] = value
            del results
            program.append(step)
            if deaths is not None:
                self._free(program, values, pos, deaths[pos])
        return program


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

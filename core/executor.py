"""Graph executor: plan an ONNX graph once, then dispatch its nodes to a provider's kernels.

Planning checks every node with ``provider.supports`` (an unsupported op is reported at load
time, naming each op and node, CASES 15), applies the fusion passes of :mod:`core.fusion`
the provider supports, asks the provider for one kernel per node, makes one
:class:`~core.protocol.KernelContext` per node and uploads the weights once. Running walks the
nodes in graph order (the builder writes them topologically sorted).

Small integer initializers (at most :data:`HOST_CONSTANT_MAX` elements: axes, shapes, gather
indices) stay host numpy arrays on every provider, as do Constant node values; kernels of shape
ops must accept them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from core import fusion
from core.protocol import ExecutionProvider, KernelContext, NodeInfo

HOST_CONSTANT_MAX = 64
GATHER_OPS = ("Gather", "GatherBlockQuantized")


class UnsupportedOpError(ValueError):
    """The provider cannot run some nodes of the graph; the message lists op types and nodes."""


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


def is_host_constant(array: np.ndarray) -> bool:
    """True for initializers kept on the host: integer tensors of at most HOST_CONSTANT_MAX elements."""
    return array.dtype.kind in "iub" and array.size <= HOST_CONSTANT_MAX


class Plan:
    """An executable plan of one graph on one provider.

    Args:
        graph: the ONNX graph (initializers loaded).
        initializers: name -> numpy array.
        provider: the execution provider.
        kv_layout: "head_major" or "seq_major", passed to every kernel context.

    Raises:
        UnsupportedOpError: some nodes are not supported by the provider (all are listed).
    """

    def __init__(self, graph: onnx.GraphProto, initializers: dict[str, np.ndarray],
                 provider: ExecutionProvider, kv_layout: str = "head_major"):
        self.provider = provider
        self.kv_layout = kv_layout
        self.nodes = fusion.apply(node_infos(graph), {o.name for o in graph.output}, provider.supports,
                                  set(initializers))
        unsupported = [n for n in self.nodes if not provider.supports(n)]
        if unsupported:
            listed = "; ".join(f"{(n.domain + '.') if n.domain else ''}{n.op_type} at node {n.name!r}"
                               for n in unsupported[:20])
            raise UnsupportedOpError(
                f"provider {provider.name!r} does not support {len(unsupported)} node(s): {listed}")
        self.contexts = [KernelContext(n, provider, kv_layout) for n in self.nodes]
        self.kernels = [provider.kernel(n) for n in self.nodes]
        self.constants: dict[str, Any] = {}
        for name, array in initializers.items():
            self.constants[name] = array if is_host_constant(array) else provider.upload(array)
        self.steps = self._fold_constants()
        for value in self.constants.values():
            if isinstance(value, np.ndarray):
                value.flags.writeable = False  # constants are shared by every step: never written
        self._program = [(self.kernels[i], self.contexts[i], self.nodes[i].inputs, self.nodes[i].outputs)
                         for i in self.steps]
        self.input_names = [i.name for i in graph.input]
        self.output_names = [o.name for o in graph.output]
        self.output_dtypes = {o.name: np.dtype(helper.tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type))
                              for o in graph.output}

    def _fold_constants(self) -> list[int]:
        """Run once every node whose inputs are all constants (Constant nodes, the builder's
        Transpose of the tied embedding); returns the indices of the nodes left to run per step."""
        steps = []
        for i, (node, kernel, ctx) in enumerate(zip(self.nodes, self.kernels, self.contexts)):
            if all((not x) or x in self.constants for x in node.inputs):
                outs = kernel(ctx, *[self.constants[x] if x else None for x in node.inputs])
                self.constants.update((n, v) for n, v in zip(node.outputs, outs) if n)
            else:
                steps.append(i)
        return steps

    def set_frozen(self, frozen: bool) -> None:
        """Forbid (True) or allow (False) buffer allocation in every kernel context (capture)."""
        for ctx in self.contexts:
            ctx.frozen = frozen

    def activation_bytes(self) -> int:
        """Bytes held in the per-node persistent buffers (activations and scratch)."""
        return sum(ctx.buffer_bytes() for ctx in self.contexts)

    def step_weight_bytes(self) -> int:
        """Bytes of constants one decode step reads in full: each constant input of a per-step
        node, counted once; gather tables are left out (a step reads B rows of them)."""
        read = {}
        for i in self.steps:
            node = self.nodes[i]
            if node.op_type in GATHER_OPS:
                continue
            read.update((x, self.constants[x]) for x in node.inputs if x in self.constants)
        return sum(int(getattr(v, "nbytes", 0)) for v in read.values())

    def weight_bytes(self) -> int:
        """Bytes of the resident constants (initializers and folded values, e.g. the transposed
        tied embedding the builder gathers from)."""
        return sum(int(getattr(v, "nbytes", 0)) for v in self.constants.values())

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """Run the graph. ``feeds`` maps every graph input to a tensor; returns graph outputs.

        Raises:
            KeyError: a graph input is not fed.
        """
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise KeyError(f"graph inputs not fed: {', '.join(missing)}")
        values: dict[str, Any] = dict(self.constants)
        values.update(feeds)
        for kernel, ctx, inputs, outputs in self._program:
            results = kernel(ctx, *[values[x] if x else None for x in inputs])
            for name, value in zip(outputs, results):
                if name:
                    values[name] = value
        return {name: values[name] for name in self.output_names}


class PlanBinding:
    """A :class:`~core.protocol.DeviceIoBinding` over a :class:`Plan`: bound tensors are fed on
    every :meth:`run` (the same objects each step, so a captured step sees stable pointers).
    Outputs bound with :meth:`bind_output` are the buffers the kernels write in place (the
    shared KV cache); the plan returns them as the graph outputs."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.inputs: dict[str, Any] = {}
        self.outputs: dict[str, Any] = {}

    def bind_input(self, name: str, tensor: Any) -> None:
        self.inputs[name] = tensor

    def bind_output(self, name: str, tensor: Any) -> None:
        self.outputs[name] = tensor

    def run(self) -> dict[str, Any]:
        return self.plan.run(self.inputs)

"""Plan building's inputs: the ONNX graph read as :class:`~core.protocol.NodeInfo` records, its
declared types, the ``If`` nodes with constant branches, and the support check.

Planning checks every node with ``provider.supports`` (an unsupported op is reported at load
time, naming each op and node, docs/cases.md 15) before anything is uploaded.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from core.executor.errors import UnsupportedOpError
from core.opdefs import constant_supports, constant_value, is_host
from core.protocol import ExecutionProvider, KernelContext, NodeInfo


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


def select_branch(ctx: KernelContext, cond: Any) -> tuple:
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
    (the provider's ``support_reason`` when it gives one, else its input dtypes and
    attributes); graph-valued attributes are named, not printed."""
    lines = []
    for n in nodes:
        if provider.supports(n):
            continue
        reason = provider.support_reason(n)
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


def declared_types(graph: onnx.GraphProto) -> dict[str, tuple[np.dtype | None, int | None]]:
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


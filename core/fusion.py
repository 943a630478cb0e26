"""Graph rewrites the core applies when the provider supports the fused op.

Each pass replaces a chain of nodes by one node of the ``lockstep`` domain whose semantics are
exactly the chain's, rounding included (so a fused run is bitwise the unfused one on the same
provider). A pass fires only where ``provider.supports(fused)`` is true and the intermediate
values have no other consumer and are not graph outputs.

- ``lockstep.SiluMul(x, up) = Mul(Mul(x, Sigmoid(x)), up)``: the SiLU-gated MLP the builder
  writes as Sigmoid + Mul + Mul (docs/ops.md 0, step 6); 3 nodes -> 1 per layer.
- ``lockstep.SiluGatedMatMul(x, w_gate, w_up) = SiluMul(MatMul(x, w_gate), MatMul(x, w_up))``
  and ``lockstep.SiluGatedMatMulNBits(x, b_gate, scales_gate, zp_gate, b_up, scales_up, zp_up)``
  (the MatMulNBits attributes, shared by both projections; absent zero points are ""): the
  gate and up projections and their SiluMul as one node, so a provider can compute both
  projections in one GEMM with the SiluMul in its epilogue; 3 nodes -> 1 per layer. The
  weights must be graph constants (initializers).
- ``lockstep.GatherColumns(w, indices) = Gather(Transpose(w, perm=[1, 0]), indices)`` (axis 0):
  the builder's tied-embedding lookup, which gathers rows of the transposed lm_head weight
  ``w [K, V]``. Fused, the lookup reads ``w`` itself, so the embedding and the lm_head share
  one weight and no transposed copy of it is folded (a provider may keep that one weight in
  its lm_head kernel's layout and gather from it there). ``w`` must be a graph constant.
- ``lockstep.ReduceSumSubCast(data, axes, b)`` with attributes ``keepdims`` and ``to``:
  ``Cast(Sub(ReduceSum(data, axes, keepdims), b), to)`` for integer ``data`` and constant
  ``axes`` and ``b``: the builder's seqlens_k from the attention mask (docs/ops.md 0), at the
  start of every decode step; 3 nodes -> 1 (on cuda, one launch instead of four CuPy ones).

Beside these passes, :func:`last_position_nodes` builds the nodes of a plan's last-position
program (:class:`core.executor.Plan`; :mod:`core.executor.folding`): prefill gathers each row's last
prompt position before the lm_head projection, so logits are ``[B, 1, V]``, not ``[B, S, V]``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Set

import numpy as np

from core.protocol import NodeInfo

FUSED_DOMAIN = "lockstep"


def _consumers(nodes: list[NodeInfo]) -> dict[str, list[int]]:
    out = defaultdict(list)
    for i, n in enumerate(nodes):
        for x in n.inputs:
            if x:
                out[x].append(i)
    return out


def _sole_reader(nodes: list[NodeInfo], users: dict[str, list[int]], value: str, graph_outputs: set[str],
                 op: str) -> int | None:
    """The index of the one node that reads ``value``, when that node is ``op`` (default domain)
    and ``value`` is not a graph output: the next link of a chain a pass may fuse; else None."""
    readers = users[value]
    if len(readers) != 1 or value in graph_outputs or (nodes[readers[0]].op_type, nodes[readers[0]].domain) != (op, ""):
        return None
    return readers[0]


def _rewrite(nodes: list[NodeInfo], replaced: dict[int, NodeInfo | None]) -> list[NodeInfo]:
    """``nodes`` with ``replaced[i]`` in place of node i (None: dropped), order kept."""
    return [m for i, n in enumerate(nodes) if (m := replaced.get(i, n)) is not None]


def fuse_silu_mul(nodes: list[NodeInfo], graph_outputs: set[str], supports) -> list[NodeInfo]:
    """Replace Sigmoid(x) -> Mul(x, s) -> Mul(g, up) chains by ``lockstep.SiluMul(x, up)``."""
    users = _consumers(nodes)
    replaced: dict[int, NodeInfo | None] = {}
    for i, sig in enumerate(nodes):
        if (sig.op_type, sig.domain) != ("Sigmoid", ""):
            continue
        x, s = sig.inputs[0], sig.outputs[0]
        j = _sole_reader(nodes, users, s, graph_outputs, "Mul")
        if j is None or sorted(nodes[j].inputs) != sorted([x, s]):
            continue
        g = nodes[j].outputs[0]
        k = _sole_reader(nodes, users, g, graph_outputs, "Mul")
        if k is None:
            continue
        mul = nodes[k]
        up = mul.inputs[1] if mul.inputs[0] == g else mul.inputs[0]
        dtypes = (sig.input_dtypes[0] if sig.input_dtypes else None,
                  dict(zip(mul.inputs, mul.input_dtypes)).get(up) if mul.input_dtypes else None)
        fused = NodeInfo(name=f"{mul.name}/SiluMul", op_type="SiluMul", domain=FUSED_DOMAIN, attrs={},
                         inputs=(x, up), outputs=(mul.outputs[0],), input_dtypes=dtypes)
        if not supports(fused):
            continue
        replaced[i], replaced[j], replaced[k] = None, None, fused
    return _rewrite(nodes, replaced)


def _dtype(node: NodeInfo, index: int):
    return node.input_dtypes[index] if index < len(node.input_dtypes) else None


def _gated(gate: NodeInfo, up: NodeInfo, constants: Set[str]):
    """(op_type, inputs, attrs, input dtypes) of the fused projection pair, or None."""
    if gate.inputs[0] != up.inputs[0] or (gate.op_type, gate.domain) != (up.op_type, up.domain):
        return None
    if (gate.op_type, gate.domain) == ("MatMul", ""):
        weights = (gate.inputs[1], up.inputs[1])
        if not all(w in constants for w in weights):
            return None
        return ("SiluGatedMatMul", (gate.inputs[0], *weights), {},
                (_dtype(gate, 0), _dtype(gate, 1), _dtype(up, 1)))
    if (gate.op_type, gate.domain) == ("MatMulNBits", "com.microsoft") and gate.attrs == up.attrs:
        if len(gate.inputs) > 4 or len(up.inputs) > 4:  # g_idx or bias
            return None
        quant = [list(n.inputs[1:]) + [""] * (4 - len(n.inputs)) for n in (gate, up)]
        if not all(x in constants for q in quant for x in q if x):
            return None
        dts = [[_dtype(n, i) if i < len(n.inputs) and n.inputs[i] else None for i in (1, 2, 3)]
               for n in (gate, up)]
        return ("SiluGatedMatMulNBits", (gate.inputs[0], *quant[0], *quant[1]), dict(gate.attrs),
                (_dtype(gate, 0), *dts[0], *dts[1]))
    return None


def fuse_gated_matmul(nodes: list[NodeInfo], graph_outputs: set[str], supports,
                      constants: Set[str]) -> list[NodeInfo]:
    """Replace gate/up projections feeding a ``lockstep.SiluMul`` by one
    ``lockstep.SiluGatedMatMul`` or ``lockstep.SiluGatedMatMulNBits`` node (module docstring)."""
    users = _consumers(nodes)
    producer = {out: i for i, n in enumerate(nodes) for out in n.outputs if out}
    replaced: dict[int, NodeInfo | None] = {}
    for k, silu in enumerate(nodes):
        if (silu.op_type, silu.domain) != ("SiluMul", FUSED_DOMAIN):
            continue
        g, u = silu.inputs
        if g not in producer or u not in producer or g == u:
            continue
        if any(len(users[v]) != 1 or v in graph_outputs for v in (g, u)):
            continue
        i, j = producer[g], producer[u]
        gate, up = nodes[i], nodes[j]
        if len(gate.outputs) != 1 or len(up.outputs) != 1:
            continue
        found = _gated(gate, up, constants)
        if found is None:
            continue
        op_type, inputs, attrs, dtypes = found
        fused = NodeInfo(name=f"{silu.name}/Gated", op_type=op_type, domain=FUSED_DOMAIN, attrs=attrs,
                         inputs=inputs, outputs=silu.outputs, input_dtypes=dtypes)
        if not supports(fused):
            continue
        replaced[i], replaced[j], replaced[k] = None, None, fused
    return _rewrite(nodes, replaced)


def fuse_tied_gather(nodes: list[NodeInfo], graph_outputs: set[str], supports,
                     constants: Set[str]) -> list[NodeInfo]:
    """Replace Transpose(w, perm=[1, 0]) -> Gather(axis 0) pairs, ``w`` in ``constants``, by
    ``lockstep.GatherColumns(w, indices)`` (module docstring). The transposed value must feed
    that one Gather (as its data) and not be a graph output."""
    users = _consumers(nodes)
    replaced: dict[int, NodeInfo | None] = {}
    for i, tr in enumerate(nodes):
        if (tr.op_type, tr.domain) != ("Transpose", "") or len(tr.inputs) != 1 or tr.inputs[0] not in constants:
            continue
        perm = tr.attrs.get("perm")
        t = tr.outputs[0]
        if perm is None or [int(p) for p in perm] != [1, 0] or len(users[t]) != 1 or t in graph_outputs:
            continue
        j = users[t][0]
        gather = nodes[j]
        if ((gather.op_type, gather.domain) != ("Gather", "") or len(gather.inputs) != 2 or gather.inputs[0] != t
                or gather.inputs[1] == t or int(gather.attrs.get("axis", 0)) != 0):
            continue
        fused = NodeInfo(name=f"{gather.name}/GatherColumns", op_type="GatherColumns", domain=FUSED_DOMAIN,
                         attrs={}, inputs=(tr.inputs[0], gather.inputs[1]), outputs=gather.outputs,
                         input_dtypes=(_dtype(tr, 0), _dtype(gather, 1)))
        if not supports(fused):
            continue
        replaced[i], replaced[j] = None, fused
    return _rewrite(nodes, replaced)


def fuse_mask_lengths(nodes: list[NodeInfo], graph_outputs: set[str], supports,
                      constants: Set[str] = frozenset()) -> list[NodeInfo]:
    """Replace ReduceSum(data, axes) -> Sub(sum, b) -> Cast(to) chains over integer ``data``,
    with ``axes`` and ``b`` constants (in ``constants``, or made by Constant nodes, as the
    builder writes them), by ``lockstep.ReduceSumSubCast(data, axes, b)``."""
    users = _consumers(nodes)
    constants = set(constants) | {o for n in nodes if (n.op_type, n.domain) == ("Constant", "") for o in n.outputs}
    replaced: dict[int, NodeInfo | None] = {}
    for i, red in enumerate(nodes):
        if (red.op_type, red.domain) != ("ReduceSum", "") or len(red.inputs) != 2 or red.inputs[1] not in constants:
            continue
        data_dtype = _dtype(red, 0)
        if data_dtype is None or np.dtype(data_dtype).kind not in "iu" or red.attrs.get("noop_with_empty_axes", 0):
            continue
        total = red.outputs[0]
        j = _sole_reader(nodes, users, total, graph_outputs, "Sub")
        if j is None or nodes[j].inputs[0] != total or nodes[j].inputs[1] not in constants:
            continue
        sub = nodes[j]
        k = _sole_reader(nodes, users, sub.outputs[0], graph_outputs, "Cast")
        if k is None:
            continue
        cast = nodes[k]
        fused = NodeInfo(name=f"{cast.name}/ReduceSumSubCast", op_type="ReduceSumSubCast", domain=FUSED_DOMAIN,
                         attrs={"keepdims": int(red.attrs.get("keepdims", 1)), "to": int(cast.attrs["to"])},
                         inputs=(red.inputs[0], red.inputs[1], sub.inputs[1]), outputs=(cast.outputs[0],),
                         input_dtypes=(data_dtype, _dtype(red, 1), _dtype(sub, 1)))
        if not supports(fused):
            continue
        replaced[i], replaced[j], replaced[k] = None, None, fused
    return _rewrite(nodes, replaced)


def apply(nodes: list[NodeInfo], graph_outputs: set[str], supports,
          constants: Set[str] = frozenset()) -> list[NodeInfo]:
    """Run the passes in order: :func:`fuse_mask_lengths` (constant ``axes`` and ``b`` only),
    :func:`fuse_silu_mul`, :func:`fuse_gated_matmul` (which fuses only projections whose
    weights are in ``constants``), then :func:`fuse_tied_gather`
    (only for a transposed weight in ``constants``)."""
    nodes = fuse_mask_lengths(nodes, graph_outputs, supports, constants)
    nodes = fuse_silu_mul(nodes, graph_outputs, supports)
    nodes = fuse_gated_matmul(nodes, graph_outputs, supports, constants)
    return fuse_tied_gather(nodes, graph_outputs, supports, constants)


#: The optional plan input of the last-position program (:func:`last_position_nodes`): int64
#: ``[B]``, row b's flat position ``b * S + length_b - 1`` in the ``[B * S]`` prompt positions.
LAST_INDEX = "lockstep_last_index"
#: Ops a last-position gather may pass through between the projection and the logits output
#: (row-wise and shape-preserving, so they run on ``[B, 1, V]`` unchanged).
ROW_WISE = (("Cast", ""),)
PROJECTIONS = (("MatMul", ""), ("MatMulNBits", "com.microsoft"))


def logits_projection(nodes: list[NodeInfo], logits: str, constants: Set[str]) -> int | None:
    """Index of the projection whose rows become ``logits`` (the lm_head): the MatMul or
    MatMulNBits producing ``logits``, possibly through row-wise ops (:data:`ROW_WISE`) whose
    intermediate values have no other consumer. None when the graph has no such node, or the
    projection's activation input is a constant."""
    producer = {out: i for i, n in enumerate(nodes) for out in n.outputs if out}
    users = _consumers(nodes)
    i = producer.get(logits)
    while i is not None and (nodes[i].op_type, nodes[i].domain) in ROW_WISE:
        x = nodes[i].inputs[0]
        i = producer.get(x) if len(users[x]) == 1 else None
    if i is None or (nodes[i].op_type, nodes[i].domain) not in PROJECTIONS:
        return None
    return None if nodes[i].inputs[0] in constants else i


def projection_k(node: NodeInfo, shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The reduction size K of a projection node (MatMul: its constant weight's first dim;
    MatMulNBits: the ``K`` attribute), or None when it is not known at planning time."""
    if node.op_type == "MatMulNBits":
        return int(node.attrs["K"]) if "K" in node.attrs else None
    shape = shapes.get(node.inputs[1])
    return int(shape[0]) if shape is not None and len(shape) == 2 else None


def last_position_nodes(projection: NodeInfo, hidden: int, io_dtype
                        ) -> tuple[list[NodeInfo], NodeInfo, dict[str, np.ndarray]]:
    """Nodes that make ``projection`` read only each row's last prompt position.

    The activation ``x`` [B, S, K] of the projection becomes
    ``Reshape(Gather(Reshape(x, [-1, K]), LAST_INDEX, axis=0), [-1, 1, K])`` [B, 1, K]: plain
    ONNX ops, so every provider runs them (a provider that refuses one keeps every position).
    A projection computes each row alone (batch invariance), so the gathered rows are the bits
    the full projection gives at those positions.

    Returns:
        (the three new nodes in execution order, the projection reading their output, the
        host shape constants they read: name -> int64 array).
    """
    x = projection.inputs[0]
    base = f"{projection.name}/last_position"
    flat, picked, shaped = f"{base}/flat", f"{base}/rows", f"{base}/output_0"
    consts = {f"{base}/flat_shape": np.array([-1, hidden], np.int64),
              f"{base}/row_shape": np.array([-1, 1, hidden], np.int64)}
    names = list(consts)
    i64 = np.dtype(np.int64)
    nodes = [NodeInfo(name=f"{base}/Reshape_flat", op_type="Reshape", domain="", attrs={},
                      inputs=(x, names[0]), outputs=(flat,), input_dtypes=(io_dtype, i64)),
             NodeInfo(name=f"{base}/Gather", op_type="Gather", domain="", attrs={"axis": 0},
                      inputs=(flat, LAST_INDEX), outputs=(picked,), input_dtypes=(io_dtype, i64)),
             NodeInfo(name=f"{base}/Reshape_rows", op_type="Reshape", domain="", attrs={},
                      inputs=(picked, names[1]), outputs=(shaped,), input_dtypes=(io_dtype, i64))]
    rewired = NodeInfo(name=projection.name, op_type=projection.op_type, domain=projection.domain,
                       attrs=projection.attrs, inputs=(shaped, *projection.inputs[1:]),
                       outputs=projection.outputs, input_dtypes=projection.input_dtypes)
    return nodes, rewired, consts

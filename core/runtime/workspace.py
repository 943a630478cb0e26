"""The device workspace of a decode state, planned before it is allocated.

A device budget holds the resident weights, the staging ring, the KV cache and the workspace:
the buffers a decode step of B rows allocates on top of them. Those are

- the **activations**: each per-step node keeps one persistent buffer per output
  (:meth:`core.protocol.KernelContext.output`), of the decode step's shape;
- the provider's **scratch** (a split-K or split-KV workspace), which the provider declares:
  :meth:`core.provider.ProviderBase.planned_workspace_bytes` (the default: the activations);
- the decode state's **own buffers** (:class:`core.runtime.state.DecodeState`: ids, the
  ``[B, C]`` mask, the argmax result, lengths, the sampling buffers with their ``[B, V]``
  history, the ``[B, 1, V]`` prompt logits).

:func:`decode_shapes` walks the fused graph's per-step nodes once at B rows and one new
position (S = 1) against C KV positions, from the graph inputs' declared shapes and the
initializers' shapes (nothing is read), and gives every value's :class:`core.ops.Spec`. The
rules count bytes, not layouts: a projection's output has the leading elements of its input
and the weight's N columns; a norm, rotary or element-wise op the shape of its inputs
(broadcast); a gather the indices' shape and the table's row; attention the query's rows with
``num_heads * head_size`` columns (its present KV is the cache itself, already counted). An op
without a rule is taken as element-wise over its inputs. The walk counts each node's outputs
once, so it is the workspace of one batch size; a Runner reserves that of the largest decode
state it has opened (:meth:`core.runtime.runner.Runner.open_state`).

A **prefill** allocates more than a decode step: its activations are ``[rows, positions, ...]``
(every prompt position of every row, right-padded; a chunk's positions in the engine's chunked
prefill). It runs transient (core.executor.dispatch, "Activation memory"): a node's buffers die
after their last reader, so :func:`prefill_bytes` walks the same nodes at the prompt's shapes
(:func:`decode_shapes` with ``new`` positions) and takes the most the live buffers hold at once
(:func:`transient_peak`), with the provider's scratch at those shapes and the prefill's inputs.
The reservation is that of a decode state plus its largest prefill run: a Session's ``batch``
prompts at its capacity when it opens, a longer prompt (a growing cache) before that prefill
runs (:meth:`core.runtime.runner.Runner.reserve_prefill`), the engine's chunk and batched runs
when its slots open; under a device budget what does not fit is refused before any work.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from onnx import helper

from core.ops import Spec

#: Ops whose output 0 (and output 3 of the skip norm) has the shape of input 0.
_LIKE_INPUT = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
               "SkipLayerNormalization", "RotaryEmbedding", "Softmax", "MoE", "QMoE")
_BOOL = ("Equal", "Greater", "Less", "Not", "And", "Or")


def _dim(name: str, batch: int, capacity: int, new: int = 1) -> int:
    """A symbolic input dimension at a step: batch -> B, total/past/max lengths -> C, the new
    positions -> ``new`` (1 at a decode step, the prompt positions at a prefill)."""
    low = name.lower()
    if "batch" in low:
        return batch
    if any(k in low for k in ("total", "past", "max", "cache", "capacity")):
        return capacity
    return new


def input_specs(graph: Any, batch: int, capacity: int, new: int = 1) -> dict[str, Spec]:
    """The graph inputs at a step of ``batch`` rows and ``new`` new positions over ``capacity``
    KV positions (:func:`_dim`), from their declared shapes and element types."""
    out = {}
    for vi in graph.input:
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else _dim(d.dim_param, batch, capacity, new)
                for d in t.shape.dim]
        out[vi.name] = Spec(tuple(dims), helper.tensor_dtype_to_np_dtype(t.elem_type), vi.name)
    return out


def _lead(spec: Spec) -> tuple[int, ...]:
    return spec.shape[:-1] if spec.ndim else ()


def _broadcast(specs: Sequence[Spec]) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*(s.shape for s in specs)))
    except ValueError:
        return max(specs, key=lambda s: s.size).shape


def node_outputs(node: Any, ins: Sequence[Spec | None], constants: dict) -> list[Spec | None]:
    """The Specs of ``node``'s outputs at a decode step from its inputs' (module docstring);
    None for an unused output and for attention's present KV (the cache, counted as KV)."""
    a = node.attrs
    live = [s for s in ins if s is not None]
    first = ins[0] if ins and ins[0] is not None else (live[0] if live else Spec((1,), np.float32))
    op, shape, dtype = node.op_type, first.shape, first.dtype
    extra: dict[int, Spec | None] = {}
    if op in ("MatMul", "SiluGatedMatMul") and len(ins) > 1 and ins[1] is not None and ins[1].ndim >= 1:
        shape = _lead(first) + (ins[1].shape[-1],)
    elif op in ("MatMulNBits", "SiluGatedMatMulNBits") and "N" in a:
        shape = _lead(first) + (int(a["N"]),)
    elif op == "GroupQueryAttention":
        past = ins[3] if len(ins) > 3 and ins[3] is not None else None
        h = int(past.shape[-1]) if past is not None else first.shape[-1] // max(int(a["num_heads"]), 1)
        shape = _lead(first) + (int(a["num_heads"]) * h,)
        extra = {1: None, 2: None}
    elif op == "Gather" and len(ins) > 1 and ins[1] is not None:
        axis = int(a.get("axis", 0)) % max(first.ndim, 1)
        # a table's row counted by its elements: a folded view of it may be forecast flat
        rest = (first.size // max(first.shape[0], 1),) if axis == 0 and first.ndim else first.shape[axis + 1:]
        shape = first.shape[:axis] + ins[1].shape + rest
    elif op == "GatherColumns" and len(ins) > 1 and ins[1] is not None:
        shape = ins[1].shape + (first.shape[0],)
    elif op == "GatherBlockQuantized" and len(ins) > 2 and ins[1] is not None and ins[2] is not None:
        # the row from the scales [V, blocks] (the codes may be a folded view, forecast flat)
        row = ins[2].size // max(ins[2].shape[0], 1) * int(a.get("block_size", 128))
        shape, dtype = ins[1].shape + (row,), ins[2].dtype
    elif op == "Cast":
        dtype = helper.tensor_dtype_to_np_dtype(int(a["to"]))
    elif op in ("Shape", "Size"):
        shape, dtype = (max(first.ndim, 1),), np.dtype(np.int64)
    elif op not in _LIKE_INPUT and live:
        shape = _broadcast(live)
        dtype = np.dtype(bool) if op in _BOOL else first.dtype
    out: list[Spec | None] = []
    for j, name in enumerate(node.outputs):
        if not name or (j in extra and extra[j] is None):
            out.append(None)
        elif op in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization") and j in (1, 2):
            out.append(Spec(_lead(first) + (1,), np.float32, name))
        else:
            out.append(Spec(shape, dtype, name))
    return out


def decode_shapes(graph: Any, nodes: Sequence[Any], steps: Sequence[int], constants: dict, batch: int,
                  capacity: int, new: int = 1, last: int | None = None) -> Callable[[str], Spec | None]:
    """Every value's Spec at a decode step (module docstring): ``nodes``, ``steps`` and
    ``constants`` (name -> anything with ``shape`` and ``dtype``) of a plan or of its header
    (:class:`core.plan._Header`), the graph for its inputs. With ``new`` > 1, at a prefill of
    ``new`` positions a row; ``last``, the lm_head's node index when the prefill gathers each
    row's last position before it (its input then ``[B, 1, K]``). Returns name -> Spec (None:
    not a value of the step)."""
    values: dict[str, Spec] = {name: Spec(c.shape, c.dtype, name) for name, c in constants.items()}
    values.update(input_specs(graph, batch, capacity, new))
    for i in steps:
        node = nodes[i]
        ins = [values.get(x) if x else None for x in node.inputs]
        if i == last and ins and ins[0] is not None:
            ins[0] = Spec((batch, 1, ins[0].shape[-1]), ins[0].dtype, node.inputs[0])
        for name, spec in zip(node.outputs, node_outputs(node, ins, constants)):
            if name and spec is not None:
                values[name] = spec
    return values.get


def activation_bytes(nodes: Sequence[Any], steps: Sequence[int], shape_of: Callable[[str], Spec | None]) -> int:
    """Bytes of the per-step nodes' output buffers at the shapes ``shape_of`` gives (one buffer
    per output; a fused gated projection keeps its gate and up products too)."""
    total = 0
    for i in steps:
        node = nodes[i]
        for name in node.outputs:
            spec = shape_of(name) if name else None
            if spec is None:
                continue
            copies = 3 if node.op_type in ("SiluGatedMatMul", "SiluGatedMatMulNBits") else 1
            total += copies * spec.nbytes
    return total


def state_bytes(batch: int, capacity: int, vocab: int, logits_itemsize: int) -> int:
    """Bytes of a decode state's own buffers (module docstring): int64 ids [B, 1] and mask
    [B, C], int32 result [B, 2], positions and lengths [B], sampling params and options
    [B, 4] and uint8 history [B, V], and the prompt logits [B, 1, V]."""
    return batch * (8 + 8 * capacity + 8 + 4 + 4 + 16 + 16 + vocab + vocab * logits_itemsize)


def transient_peak(nodes: Sequence[Any], steps: Sequence[int], shape_of: Callable[[str], Spec | None],
                   returned: set[str]) -> int:
    """The most bytes the node buffers of a transient run (a prefill, core.executor.dispatch
    "Activation memory") hold at once, at the shapes ``shape_of`` gives: walking ``steps`` in
    order, a node's buffers are allocated as it runs and die after the last reader of its
    outputs (:meth:`core.executor.Plan._deaths`), except the outputs in ``returned`` (the graph
    outputs: the run returns them, so their memory stays to its end)."""
    last_read: dict[str, int] = {}
    for pos, i in enumerate(steps):
        for x in nodes[i].inputs:
            if x:
                last_read[x] = pos
    dies: dict[int, int] = {}
    live = peak = 0
    for pos, i in enumerate(steps):
        node = nodes[i]
        copies = 3 if node.op_type in ("SiluGatedMatMul", "SiluGatedMatMulNBits") else 1
        freed, ends = 0, [pos]
        for name in node.outputs:
            spec = shape_of(name) if name else None
            if spec is None:
                continue
            live += copies * spec.nbytes
            if name not in returned:
                freed += copies * spec.nbytes
                ends.append(last_read.get(name, pos))
        peak = max(peak, live)
        dies[max(ends)] = dies.get(max(ends), 0) + freed
        live -= dies.pop(pos, 0)
    return peak


def prefill_bytes(model: Any, header: Any, provider: Any, rows: int, positions: int, capacity: int,
                  gathered: bool = True) -> int:
    """Device bytes a prefill run of ``rows`` prompts of ``positions`` positions each (right-padded;
    a chunk of a chunked prefill: its rows and positions) over ``capacity`` KV positions allocates
    while it runs, beside the decode state's workspace (:func:`estimate`):

    - its node buffers: with the last-position program (``gathered`` and the graph has an lm_head
      projection, :func:`core.fusion.logits_projection`) the run is transient, so the most its
      live buffers hold at once (:func:`transient_peak`; the lm_head and what follows it at
      ``[rows, 1, ...]``, plus the gather's copies of its ``[rows * positions, K]`` input); without
      it, every node's buffer at the prompt's shape (the run keeps them, logits ``[rows,
      positions, V]`` among them);
    - the provider's scratch at those shapes (``planned_workspace_bytes`` less the activations);
    - its inputs: int64 ids ``[rows, positions]``, mask ``[rows, capacity]`` at most, the last
      indices ``[rows]`` and the int32 positions ``[rows]``.
    """
    from core import fusion

    outputs = {o.name for o in model.graph.output}
    lm = fusion.logits_projection(header.nodes, "logits", set(model.initializers)) if gathered else None
    if lm is not None and lm not in header.steps:
        lm = None
    shape_of = decode_shapes(model.graph, header.nodes, header.steps, header.constants, rows, capacity, positions, lm)
    kept = activation_bytes(header.nodes, header.steps, shape_of)
    planned = int(provider.planned_workspace_bytes(header.nodes, header.steps, shape_of, rows, capacity))
    total = max(planned - kept, 0) + rows * (8 * positions + 8 * capacity + 8 + 4)
    if lm is None:
        return total + kept
    x = shape_of(header.nodes[lm].inputs[0])  # the lm_head's input before the gather: [rows, positions, K]
    gather = (rows * positions + 2 * rows) * x.shape[-1] * x.dtype.itemsize if x is not None and x.ndim else 0
    return total + transient_peak(header.nodes, header.steps, shape_of, outputs) + gather


def estimate(model: Any, header: Any, provider: Any, batch: int, capacity: int,
             prefill: tuple[int, int] | None = None, gathered: bool = True) -> int:
    """Device bytes of the workspace of a decode state of ``batch`` rows over ``capacity`` KV
    positions (module docstring): ``provider``'s declared activations and scratch
    (``planned_workspace_bytes``) at the shapes :func:`decode_shapes` finds over ``header``
    (:class:`core.plan._Header` of ``model``), plus the state's own buffers; with ``prefill``
    (rows, positions a row) of its largest prefill run, plus what that run allocates on top
    (:func:`prefill_bytes`; ``gathered``: the plan has a last-position program)."""
    shape_of = decode_shapes(model.graph, header.nodes, header.steps, header.constants, batch, capacity)
    planned = int(provider.planned_workspace_bytes(header.nodes, header.steps, shape_of, batch, capacity))
    total = planned + state_bytes(batch, capacity, model.config.vocab_size, 4)
    if prefill is None:
        return total
    rows, positions = prefill
    return total + prefill_bytes(model, header, provider, rows, min(positions, capacity), capacity, gathered)

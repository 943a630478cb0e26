"""Op conformance cases of an in-graph MoE router (LFM2-MoE, docs/moe.md), registered in
:data:`core.testing.op_cases.OP_CASES` (which calls :func:`cases`; this module imports
op_cases only there, so either module may be imported first): the standard ops the builder writes between the router
projection and the MoE node (Neg, Exp, Reciprocal: its sigmoid; TopK over the biased scores;
GatherElements of the chosen scores; their ReduceSum; Clip and Log; ScatterElements into the
ConstantOfShape sentinel logits), plus the device Slice and Concat, on shapes of a decode step
(token rows x experts). TopK ties (lower index first), NaN (after every number) and duplicate
scatter indices (the last update wins) are exact; each row alone is bitwise its row of the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from core.testing.op_cases import OpCase

#: token rows and experts of the router cases (a decode batch of 9 rows, LFM2-8B's 32 experts).
ROWS, EXPERTS = 9, 32


def _normal(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def _positive(rng, dtype):
    """Sigmoid-range scores, with tiny and NaN values (Log's inputs after the Clip)."""
    x = rng.uniform(1e-3, 1.0, (ROWS, EXPERTS)).astype(np.float32)
    x[0, :3] = (1e-4, 3.0, np.nan)
    return x.astype(dtype)


def _sigmoid_denominator(rng, dtype):
    """1 + exp(-logit): Reciprocal's input in the router's sigmoid."""
    return (1.0 + np.exp(_normal(rng, (ROWS, EXPERTS), np.float32, 2.0))).astype(dtype)


def _scores(rng, dtype):
    """Scores with ties (values on a grid of 1/4), a tied top row, NaN, -0.0 and 0.0."""
    x = (rng.integers(-8, 9, (ROWS, EXPERTS)) / 4).astype(np.float32)
    x[0] = 1.0
    x[1, [3, 17, 30]] = 5.0
    x[2, [0, 5]] = np.nan
    x[3, [2, 9]] = (-0.0, 0.0)
    return x.astype(dtype)


def _topk_inputs(k: int):
    def make(rng, dtype):
        return {"x": _scores(rng, dtype), "k": np.array([k], np.int64)}
    return make


def _chosen(rng, k: int, negative: bool = False):
    idx = np.stack([rng.permutation(EXPERTS)[:k] for _ in range(ROWS)]).astype(np.int64)
    if negative:
        idx[1, 0] -= EXPERTS  # the same expert, counted from the end
    return idx


def _gather(rng, dtype):
    return {"data": _normal(rng, (ROWS, EXPERTS), dtype), "indices": _chosen(rng, 4, negative=True)}


def _gather_axis0(rng, dtype):
    return {"data": _normal(rng, (5, ROWS, 3), dtype), "indices": rng.integers(-5, 5, (2, ROWS, 3)).astype(np.int32)}


def _scatter(fill: bool):
    def make(rng, dtype):
        data = np.full((ROWS, EXPERTS), -10000.0, dtype) if fill else _normal(rng, (ROWS, EXPERTS), dtype)
        idx = _chosen(rng, 4, negative=True)
        idx[2, 3] = idx[2, 1]  # a duplicate index: the later update wins
        return {"data": data, "indices": idx, "updates": _normal(rng, (ROWS, 4), dtype)}
    return make


def _reduce(shape, axes):
    def make(rng, dtype):
        return {"x": _normal(rng, shape, dtype), "axes": np.array(axes, np.int64)}
    return make


def _clip(rng, dtype):
    return {"x": _positive(rng, dtype) - np.asarray(0.5, dtype), "low": np.array(1e-30, dtype), "high": None}


def _clip_both(rng, dtype):
    x = _normal(rng, (ROWS, EXPERTS), dtype)
    x[0, 0] = np.nan
    return {"x": x, "low": np.array(-0.5, dtype), "high": np.array(0.7, dtype)}


def _slice(rng, dtype):
    return {"x": _normal(rng, (ROWS, 2, EXPERTS), dtype), "starts": np.array([1, -20], np.int64),
            "ends": np.array([2, 1000], np.int64), "axes": np.array([1, 2], np.int64)}


def _concat(rng, dtype):
    return {name: _normal(rng, (ROWS, width), dtype) for name, width in (("a", 3), ("b", 1), ("c", 5))}


def cases() -> list[OpCase]:
    """The router cases (module docstring)."""
    from core.testing.op_cases import ELEMENTWISE, EXACT, REDUCTION, OpCase

    def unary(op: str, make) -> OpCase:
        return OpCase(f"{op}/router", op, lambda rng, dt: {"x": make(rng, dt)}, tolerance=dict(ELEMENTWISE),
                      rows=("x",))

    def topk(k: int, largest: int, axis: int = -1) -> OpCase:
        return OpCase(f"TopK/router-k{k}-largest{largest}-axis{axis}", "TopK", _topk_inputs(k),
                      attributes={"axis": axis, "largest": largest}, outputs=("values", "indices"),
                      output_dtype=(None, "int64"), constants=("k",), tolerance=dict(EXACT),
                      rows=("x",) if axis in (-1, 1) else ())

    return [
        unary("Neg", lambda rng, dt: _normal(rng, (ROWS, EXPERTS), dt, 3.0)),
        unary("Exp", lambda rng, dt: _normal(rng, (ROWS, EXPERTS), dt, 1.5)),
        unary("Reciprocal", _sigmoid_denominator),
        unary("Log", _positive),
        OpCase("Clip/router-low", "Clip", _clip, constants=("low",), tolerance=dict(EXACT), rows=("x",)),
        OpCase("Clip/both-nan", "Clip", _clip_both, constants=("low", "high"), tolerance=dict(EXACT), rows=("x",)),
        topk(2, 1),
        topk(4, 0),
        topk(3, 1, axis=0),
        topk(EXPERTS, 1),
        OpCase("GatherElements/router-axis1", "GatherElements", _gather, attributes={"axis": 1},
               tolerance=dict(EXACT), rows=("data", "indices")),
        OpCase("GatherElements/axis0-int32", "GatherElements", _gather_axis0, attributes={"axis": 0},
               tolerance=dict(EXACT)),
        OpCase("ScatterElements/router-sentinel", "ScatterElements", _scatter(True), attributes={"axis": 1},
               tolerance=dict(EXACT), host=("data",), rows=("data", "indices", "updates")),
        OpCase("ScatterElements/device-data", "ScatterElements", _scatter(False), attributes={"axis": 1},
               tolerance=dict(EXACT), rows=("data", "indices", "updates")),
        OpCase("ReduceSum/router-last-keep", "ReduceSum", _reduce((ROWS, 4), [-1]), attributes={"keepdims": 1},
               constants=("axes",), rows=("x",)),
        OpCase("ReduceSum/float-middle-axes", "ReduceSum", _reduce((3, 5, 7, 2), [1, 2]),
               attributes={"keepdims": 0}, constants=("axes",), tolerance=dict(REDUCTION)),
        OpCase("Slice/device-axes", "Slice", _slice, constants=("starts", "ends", "axes"), tolerance=dict(EXACT),
               rows=("x",)),
        OpCase("Concat/device-axis1", "Concat", _concat, attributes={"axis": 1}, tolerance=dict(EXACT),
               rows=("a", "b", "c")),
    ]

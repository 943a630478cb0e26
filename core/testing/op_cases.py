"""Op conformance cases of the parity kit, written once as data.

Each :class:`OpCase` describes one single-node ONNX model: the op, its domain and attributes,
an input generator (fresh random inputs on every call), the activation dtypes it is run in,
and the tolerance per dtype. :mod:`core.testing.kit` builds the model with ``onnx.helper``,
runs it through :class:`core.executor.Plan` on the provider under test and on cpu_reference,
and compares. :data:`ARGMAX_CASES` do the same for ``device_argmax`` (CASES 11, 12).

Input generators take ``(rng, dtype)`` and return an ordered dict ``input name -> array``
(None for an absent optional input, written as "" in the node). Inputs named in
``OpCase.constants`` become initializers (weights, drawn once per case run); the others are fed.
"""

from __future__ import annotations

from typing import Callable

import attrs
import numpy as np

from core.testing.tiny_model import quantize_int4

#: (atol, rtol) per dtype for elementwise ops (one rounding of the output).
ELEMENTWISE = {"float32": (1e-6, 1e-5), "float16": (1e-3, 2e-3)}
#: (atol, rtol) per dtype for ops with a reduction (matmul, norms, attention).
REDUCTION = {"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2)}
#: Integer and shape ops are exact.
EXACT = {"float32": (0.0, 0.0), "float16": (0.0, 0.0), "int64": (0.0, 0.0), "int32": (0.0, 0.0)}
FLOATS = ("float32", "float16")

Inputs = dict[str, "np.ndarray | None"]


@attrs.frozen
class OpCase:
    """One op conformance case.

    Attributes:
        id: unique name, "Op/variant"; the kit id of a run is "op/<id>/<dtype>".
        op: ONNX op type.
        make_inputs: ``(rng, dtype) -> {name: array | None}`` in node input order.
        domain: "" or "com.microsoft".
        attributes: node attributes.
        outputs: node output names ("" for an unused optional output).
        dtypes: activation dtypes the case runs in.
        tolerance: ``dtype -> (atol, rtol)``; a value passes when |t - r| <= atol + rtol * |r|.
        constants: input names that become initializers.
        output_dtype: dtype of every output (None: the dtype argument).
        kv_layout: layout tag of the kernel context ("head_major" or "seq_major").
        select: ``(inputs, output_index, array) -> array``: the part of an output that is
            defined (e.g. live KV rows only); None compares everything.
    """

    id: str
    op: str
    make_inputs: Callable[[np.random.Generator, str], Inputs]
    domain: str = ""
    attributes: dict = attrs.field(factory=dict)
    outputs: tuple[str, ...] = ("y",)
    dtypes: tuple[str, ...] = FLOATS
    tolerance: dict = attrs.field(factory=lambda: dict(REDUCTION))
    constants: tuple[str, ...] = ()
    output_dtype: str | None = None
    kv_layout: str = "head_major"
    select: Callable[[Inputs, int, np.ndarray], np.ndarray] | None = None


def _normal(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


# -- MatMul / MatMulNBits / GatherBlockQuantized -------------------------------------------

def _matmul(m_shape, k, n):
    def make(rng, dtype):
        return {"a": _normal(rng, (*m_shape, k), dtype), "b": _normal(rng, (k, n), dtype, k ** -0.5)}
    return make


def _matmul_nbits(m_shape, k, n, block, zp):
    n_blocks = -(-k // block)

    def make(rng, dtype):
        packed, scales = quantize_int4(rng.standard_normal((k, n)).astype(np.float32), block)
        packed = rng.integers(0, 256, packed.shape, dtype=np.uint8)  # every code value
        inputs = {"a": _normal(rng, (*m_shape, k), dtype), "b": packed,
                  "scales": (scales * rng.uniform(0.5, 1.5, scales.shape)).astype(dtype).reshape(-1)}
        if zp:
            inputs["zero_points"] = rng.integers(0, 256, (n, -(-n_blocks // 2)), dtype=np.uint8)
        return inputs
    return make


def _nbits_case(m_shape, k, n, block, zp) -> OpCase:
    tag = f"bs{block}-K{k}-{'zp' if zp else 'nozp'}-M{int(np.prod(m_shape))}"
    return OpCase(f"MatMulNBits/{tag}", "MatMulNBits", _matmul_nbits(m_shape, k, n, block, zp),
                  domain="com.microsoft",
                  attributes={"K": k, "N": n, "bits": 4, "block_size": block, "accuracy_level": 4},
                  constants=("b", "scales", "zero_points"))


def _gbq(shape, v, d, block, zp):
    def make(rng, dtype):
        n_blocks = d // block
        inputs = {"data": rng.integers(0, 256, (v, d // 2), dtype=np.uint8),
                  "indices": rng.integers(0, v, shape).astype(np.int64),
                  "scales": rng.uniform(0.01, 0.1, (v, n_blocks)).astype(dtype)}
        if zp:
            inputs["zero_points"] = rng.integers(0, 256, (v, -(-n_blocks // 2)), dtype=np.uint8)
        return inputs
    return make


# -- GroupQueryAttention -------------------------------------------------------------------

NQ, NKV, HEAD, CAP = 4, 2, 16, 16


def _kv_buffer(rng, dtype, layout, batch, lengths):
    """A KV buffer of capacity CAP with rows [0, length_b) random and NaN beyond (poison)."""
    buf = np.full((batch, NKV, CAP, HEAD), np.nan, np.float32)
    for b, n in enumerate(lengths):
        buf[b, :, :n] = rng.standard_normal((NKV, n, HEAD))
    buf = buf.astype(dtype)
    return np.ascontiguousarray(buf if layout == "head_major" else buf.transpose(0, 2, 1, 3))


def _gqa(layout, seq, pasts, lengths, total):
    """Packed-QKV GQA inputs: ``pasts`` rows already cached, ``lengths`` new tokens per row
    (right padding up to ``seq``); seqlens_k = past + length - 1."""
    batch = len(pasts)

    def make(rng, dtype):
        angles = np.arange(64)[:, None] / (10000.0 ** (np.arange(0, HEAD, 2) / HEAD))[None, :]
        return {
            "query": _normal(rng, (batch, seq, (NQ + 2 * NKV) * HEAD), dtype),
            "key": None, "value": None,
            "past_key": _kv_buffer(rng, dtype, layout, batch, pasts),
            "past_value": _kv_buffer(rng, dtype, layout, batch, pasts),
            "seqlens_k": np.array([p + n - 1 for p, n in zip(pasts, lengths)], np.int32),
            "total_sequence_length": np.array(total, np.int32),
            "cos_cache": np.cos(angles).astype(dtype), "sin_cache": np.sin(angles).astype(dtype)}
    return make


def _gqa_select(layout, pasts, lengths):
    """Compare output rows of real tokens, and KV rows [0, past + length) of each row."""
    def select(inputs, index, array):
        parts = []
        for b, (p, n) in enumerate(zip(pasts, lengths)):
            if index == 0:
                parts.append(array[b, :n].ravel())
            elif layout == "head_major":
                parts.append(array[b, :, :p + n].ravel())
            else:
                parts.append(array[b, :p + n].ravel())
        return np.concatenate(parts)
    return select


def _gqa_case(name, layout, seq, pasts, lengths, total) -> OpCase:
    return OpCase(
        f"GroupQueryAttention/{name}-{layout}", "GroupQueryAttention",
        _gqa(layout, seq, pasts, lengths, total), domain="com.microsoft",
        attributes={"num_heads": NQ, "kv_num_heads": NKV, "scale": HEAD ** -0.5, "local_window_size": -1,
                    "softcap": 0.0, "do_rotary": 1, "rotary_interleaved": 0},
        outputs=("y", "present_key", "present_value"), constants=("cos_cache", "sin_cache"),
        kv_layout=layout, select=_gqa_select(layout, pasts, lengths))


def _gqa_cases() -> list[OpCase]:
    cases = []
    for layout in ("head_major", "seq_major"):
        # prompt (first prompt: every past is 0), right padding to S = 6
        cases.append(_gqa_case("prompt-right-padding", layout, 6, [0, 0, 0], [6, 3, 1], 6))
        # decode: S = 1 against a shared buffer of capacity 16, per-row past lengths
        cases.append(_gqa_case("decode-per-row-lengths", layout, 1, [5, 9, 2], [1, 1, 1], CAP))
        # append 4 tokens after 3 into a shared buffer of capacity 16 (CASES 5, B = 1)
        cases.append(_gqa_case("append-shared-buffer", layout, 4, [3], [4], 7))
    return cases


# -- norms, elementwise, gather, cast ------------------------------------------------------

def _skip_norm(rng, dtype):
    return {"x": _normal(rng, (2, 3, 48), dtype), "skip": _normal(rng, (2, 3, 48), dtype),
            "gamma": (1 + 0.1 * rng.standard_normal(48)).astype(dtype)}


def _norm(rng, dtype):
    return {"x": _normal(rng, (2, 3, 48), dtype, 3.0), "scale": (1 + 0.1 * rng.standard_normal(48)).astype(dtype)}


def _binary(shape_a, shape_b):
    def make(rng, dtype):
        return {"a": _normal(rng, shape_a, dtype), "b": _normal(rng, shape_b, dtype)}
    return make


def _gather_rows(rng, dtype):
    return {"data": _normal(rng, (50, 24), dtype), "indices": rng.integers(0, 50, (3, 5)).astype(np.int64)}


def _gather_shape(rng, dtype):
    return {"data": rng.integers(1, 100, 4).astype(np.int64), "indices": np.array(1, np.int64)}


def _cast_from(src):
    def make(rng, dtype):
        if np.dtype(src).kind == "f":
            return {"x": _normal(rng, (3, 17), src, 4.0)}
        return {"x": rng.integers(-1000, 1000, (3, 17)).astype(src)}
    return make


def _reduce_sum(rng, dtype):
    return {"x": rng.integers(0, 2, (3, 12)).astype(np.int64), "axes": np.array([1], np.int64)}


OP_CASES: list[OpCase] = [
    OpCase("MatMul/2d", "MatMul", _matmul((5,), 64, 32), constants=("b",)),
    OpCase("MatMul/3d", "MatMul", _matmul((2, 3), 40, 24), constants=("b",)),
    OpCase("MatMul/M1", "MatMul", _matmul((1, 1), 96, 40), constants=("b",)),
    _nbits_case((1, 1), 40, 24, 16, False),   # K % 16 != 0, odd block count
    _nbits_case((2, 3), 40, 24, 16, True),
    _nbits_case((2, 3), 72, 24, 32, False),   # K % 32 != 0
    _nbits_case((1, 1), 64, 24, 32, True),
    _nbits_case((2, 3), 200, 16, 128, True),  # K % 128 != 0, even block count
    _nbits_case((1, 1), 256, 16, 128, False),
    OpCase("GatherBlockQuantized/bs32-nozp", "GatherBlockQuantized", _gbq((2, 5), 40, 64, 32, False),
           domain="com.microsoft", attributes={"bits": 4, "block_size": 32, "gather_axis": 0, "quantize_axis": 1},
           constants=("data", "scales"), tolerance=dict(ELEMENTWISE)),
    OpCase("GatherBlockQuantized/bs16-zp", "GatherBlockQuantized", _gbq((1, 3), 40, 48, 16, True),
           domain="com.microsoft", attributes={"bits": 4, "block_size": 16, "gather_axis": 0, "quantize_axis": 1},
           constants=("data", "scales", "zero_points"), tolerance=dict(ELEMENTWISE)),
    *_gqa_cases(),
    OpCase("SkipSimplifiedLayerNormalization/y-sum", "SkipSimplifiedLayerNormalization", _skip_norm,
           domain="com.microsoft", attributes={"epsilon": 1e-5}, outputs=("y", "", "", "sum"),
           constants=("gamma",)),
    OpCase("SkipSimplifiedLayerNormalization/y", "SkipSimplifiedLayerNormalization", _skip_norm,
           domain="com.microsoft", attributes={"epsilon": 1e-5}, constants=("gamma",)),
    OpCase("SimplifiedLayerNormalization/last-axis", "SimplifiedLayerNormalization", _norm,
           attributes={"epsilon": 1e-5, "axis": -1, "stash_type": 1}, constants=("scale",)),
    OpCase("Mul/same-shape", "Mul", _binary((2, 3, 20), (2, 3, 20)), tolerance=dict(ELEMENTWISE)),
    OpCase("Mul/broadcast", "Mul", _binary((2, 3, 20), (20,)), tolerance=dict(ELEMENTWISE)),
    OpCase("Add/broadcast", "Add", _binary((2, 3, 20), (1, 3, 1)), tolerance=dict(ELEMENTWISE)),
    OpCase("Sigmoid/wide-range", "Sigmoid", lambda rng, dt: {"x": _normal(rng, (4, 33), dt, 6.0)},
           tolerance=dict(ELEMENTWISE)),
    OpCase("Gather/embedding-rows", "Gather", _gather_rows, constants=("data",), tolerance=dict(EXACT)),
    OpCase("Gather/shape-scalar", "Gather", _gather_shape, attributes={"axis": 0}, constants=("indices",),
           dtypes=("int64",), tolerance=dict(EXACT), output_dtype="int64"),
    OpCase("Cast/float32-to-float16", "Cast", _cast_from("float32"), attributes={"to": 10},
           dtypes=("float16",), tolerance=dict(EXACT)),
    OpCase("Cast/float16-to-float32", "Cast", _cast_from("float16"), attributes={"to": 1},
           dtypes=("float32",), tolerance=dict(EXACT)),
    OpCase("Cast/int64-to-int32", "Cast", _cast_from("int64"), attributes={"to": 6},
           dtypes=("int32",), tolerance=dict(EXACT)),
    OpCase("ReduceSum/mask-lengths", "ReduceSum", _reduce_sum, attributes={"keepdims": 0},
           constants=("axes",), dtypes=("int64",), tolerance=dict(EXACT)),
]


# -- device_argmax (CASES 11, 12) ----------------------------------------------------------

VOCAB = 2304  # > 2 * 1024, so ties {i, i + blockDim} fit for blockDim 256 and 1024


def _argmax_ties(rng, dtype):
    """Rows with ties: {0, last}, {i, i + 256}, {i, i + 1024}, all-equal, plus random rows."""
    rows = _normal(rng, (7, VOCAB), np.float32)
    rows[0, [0, VOCAB - 1]] = 9.0
    i = int(rng.integers(0, 255))
    rows[1, [i, i + 256]] = 9.0
    j = int(rng.integers(0, 1024))
    rows[2, [j, j + 1024]] = 9.0
    rows[3] = 1.5
    rows[4, [VOCAB - 2, VOCAB - 1]] = 9.0
    return rows[:, None, :].astype(dtype), np.zeros(7, np.int32)


def _argmax_nonfinite(rng, dtype):
    """All-NaN, NaN at 0, +inf, -inf, NaN at the end, and one finite row."""
    rows = _normal(rng, (6, VOCAB), np.float32)
    rows[0] = np.nan
    rows[1, 0] = np.nan
    rows[2, 17] = np.inf
    rows[3, 5] = -np.inf
    rows[4, VOCAB - 1] = np.nan
    return rows[:, None, :].astype(dtype), np.zeros(6, np.int32)


def _argmax_positions(rng, dtype):
    """Prefill-shaped logits [B, S, V]: each row reads its own position (the last real token)."""
    logits = _normal(rng, (4, 5, VOCAB), np.float32)
    return logits.astype(dtype), np.array([4, 0, 2, 1], np.int32)


@attrs.frozen
class ArgmaxCase:
    """A device_argmax case: ``make(rng, dtype) -> (logits [B, S, V], positions int32 [B])``."""

    id: str
    make: Callable
    dtypes: tuple[str, ...] = FLOATS


ARGMAX_CASES: list[ArgmaxCase] = [
    ArgmaxCase("ties", _argmax_ties),
    ArgmaxCase("nonfinite", _argmax_nonfinite),
    ArgmaxCase("positions", _argmax_positions),
]


def case_params() -> list[tuple[str, OpCase, str]]:
    """Every (kit id, case, dtype) the op suite runs: kit id "op/<case id>/<dtype>"."""
    return [(f"op/{c.id}/{dt}", c, dt) for c in OP_CASES for dt in c.dtypes]


def argmax_params() -> list[tuple[str, ArgmaxCase, str]]:
    """Every (kit id, case, dtype) of device_argmax: kit id "argmax/<case id>/<dtype>"."""
    return [(f"argmax/{c.id}/{dt}", c, dt) for c in ARGMAX_CASES for dt in c.dtypes]

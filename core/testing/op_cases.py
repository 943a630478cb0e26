"""Op conformance cases of the parity kit, written once as data and run on every provider.

Each :class:`OpCase` describes one single-node ONNX model: the op, its domain and attributes,
an input generator (fresh random inputs on every call), the activation dtypes it is run in,
and the tolerance per dtype. :mod:`core.testing.kit` builds the model with ``onnx.helper``,
runs it through :class:`core.executor.Plan` on the provider under test and on cpu_reference,
and compares. Two optional properties are checked bitwise on the provider under test alone:

- ``rows``: each row of the batch, run alone, gives the bits of that row in the batch (batch
  invariance at op level: docs/cases.md 1, 21, M = 1..256);
- ``unfused``: a fused ``lockstep`` op gives the bits of the chain of standard ops it stands
  for (the contract of :mod:`core.fusion`).

:data:`ARGMAX_CASES` do the same for ``device_argmax`` (docs/cases.md 11, 12, 23).

Input generators take ``(rng, dtype)`` and return an ordered dict ``input name -> array``
(None for an absent optional input, written as "" in the node). Inputs named in
``OpCase.constants`` become initializers (weights, drawn once per case run); the others are fed.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import numpy as np
from onnx import NodeProto, TensorProto, helper

#: (atol, rtol) per dtype for elementwise ops (one rounding of the output).
ELEMENTWISE = {"float32": (1e-6, 1e-5), "float16": (1e-3, 2e-3)}
#: (atol, rtol) per dtype for ops with a reduction (matmul, norms, attention).
REDUCTION = {"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2)}
#: Integer and shape ops are exact (and so is any product whose arithmetic is exact in fp32).
EXACT = {"float32": (0.0, 0.0), "float16": (0.0, 0.0), "int64": (0.0, 0.0), "int32": (0.0, 0.0)}
FLOATS = ("float32", "float16")
LAYOUTS = ("head_major", "seq_major")

Inputs = dict[str, "np.ndarray | None"]


@attrs.frozen
class OpCase:
    """One op conformance case.

    Attributes:
        id: unique name, "Op/variant"; the kit id of a run is "op/<id>/<dtype>".
        op: ONNX op type.
        make_inputs: ``(rng, dtype) -> {name: array | None}`` in node input order.
        domain: "", "com.microsoft" or "lockstep" (the core's fused ops).
        attributes: node attributes.
        outputs: node output names ("" for an unused optional output).
        dtypes: activation dtypes the case runs in.
        tolerance: ``dtype -> (atol, rtol)``; a value passes when |t - r| <= atol + rtol * |r|.
        constants: input names that become initializers.
        output_dtype: dtype of every output, or a tuple with one entry per output (None: the
            dtype argument); None: the dtype argument for every output.
        kv_layout: layout tag of the kernel context ("head_major" or "seq_major").
        select: ``(inputs, output_index, array) -> array``: the part of an output that is
            defined for these inputs (e.g. live KV rows only); it must also work on the inputs
            of one row (``rows``); None compares everything.
        rows: fed inputs whose axis 0 is the batch (row) axis. When set, each row is also run
            alone (these inputs sliced to that row, the others unchanged) and must give
            bitwise the same (selected) outputs as its row of the batch run.
        alone: ``inputs -> inputs`` applied to the inputs of one row before it is run alone
            (e.g. drop a prompt's right padding); None runs the sliced inputs as they are.
        unfused: ``() -> [onnx nodes]``: the chain of standard ops a fused op stands for, on
            the case's input and output names; when set, the provider must give bitwise the
            same outputs for the chain (run unfused) as for the fused node.
        host: fed inputs passed as host numpy arrays instead of uploaded: values a real graph
            computes on the host from shapes (GroupQueryAttention's total_sequence_length).
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
    output_dtype: str | tuple[str | None, ...] | None = None
    kv_layout: str = "head_major"
    select: Callable[[Inputs, int, np.ndarray], np.ndarray] | None = None
    rows: tuple[str, ...] = ()
    alone: Callable[[Inputs], Inputs] | None = None
    unfused: Callable[[], list[NodeProto]] | None = None
    host: tuple[str, ...] = ()


def _normal(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def _exact_1e4(rng, shape, dtype):
    """Values of magnitude 5000..10000, multiples of 8, random signs (exact in fp16)."""
    return (rng.integers(625, 1251, shape) * 8 * rng.choice([-1, 1], shape)).astype(dtype)


# -- MatMul / MatMulNBits / GatherBlockQuantized -------------------------------------------

ROW_COUNTS = (2, 3, 5, 8, 9, 17, 64, 256)  # around the kernels' dispatch thresholds (docs/cases.md 21)
EXACT_COUNTS = (1, 8, 9, 17, 64)


def _matmul(m_shape, k, n):
    def make(rng, dtype):
        return {"a": _normal(rng, (*m_shape, k), dtype), "b": _normal(rng, (k, n), dtype, k ** -0.5)}
    return make


def _matmul_1e4(m, k, n):
    """A ~ 1e4 (docs/cases.md 22), B multiples of 1/128 in [-1/16, 1/16]: every product and partial
    sum is a multiple of 1/16 below 2^20, exact in fp32, so any fp32 accumulation gives the
    same bits, while an fp16 accumulator (spacing 8 at 1e4) loses them."""
    def make(rng, dtype):
        return {"a": _exact_1e4(rng, (m, k), dtype), "b": (rng.integers(-8, 9, (k, n)) / 128).astype(dtype)}
    return make


def _nbits_weights(rng, dtype, k, n, block, bits=4, zp=None, scale=None):
    """(B, scales, zero_points) of MatMulNBits: every code value; scales for O(1) outputs, or
    ``scale`` everywhere; zp None (2^(bits-1)), "packed" (uint8 codes) or "float"."""
    n_blocks = -(-k // block)
    b = rng.integers(0, 256, (n, n_blocks, block * bits // 8), dtype=np.uint8)
    if scale is None:
        scales = rng.uniform(0.5, 1.5, n * n_blocks) / (2 ** (bits - 1) * np.sqrt(k))
    else:
        scales = np.full(n * n_blocks, scale)
    zero_points = None
    if zp == "packed":
        zero_points = rng.integers(0, 256, (n, -(-n_blocks * bits // 8)), dtype=np.uint8)
    elif zp == "float":
        zero_points = rng.integers(0, 2 ** bits, (n, n_blocks)).astype(dtype)
    return b, scales.astype(dtype), zero_points


def _nbits_attrs(k, n, block, bits=4):
    return {"K": k, "N": n, "bits": bits, "block_size": block, "accuracy_level": 4}


def _nbits_case(m_shape, k, n, block, bits=4, zp=None, tag=None, exact=False, rows=False) -> OpCase:
    """MatMulNBits [*m_shape, K] x [K, N]; ``exact``: A ~ 1e4 and scale 1/128 (see _matmul_1e4);
    ``rows``: with the row-invariance property."""
    def make(rng, dtype):
        a = _exact_1e4(rng, (*m_shape, k), dtype) if exact else _normal(rng, (*m_shape, k), dtype)
        b, scales, zero_points = _nbits_weights(rng, dtype, k, n, block, bits, zp, 1 / 128 if exact else None)
        inputs = {"a": a, "b": b, "scales": scales}
        if zero_points is not None:
            inputs["zero_points"] = zero_points
        return inputs

    tag = tag or f"int{bits}-bs{block}-K{k}-N{n}-{zp or 'nozp'}-M{int(np.prod(m_shape))}"
    return OpCase(f"MatMulNBits/{tag}", "MatMulNBits", make, domain="com.microsoft",
                  attributes=_nbits_attrs(k, n, block, bits), constants=("b", "scales", "zero_points"),
                  tolerance=dict(EXACT if exact else REDUCTION), rows=("a",) if rows else ())


def _linear_cases() -> list[OpCase]:
    cases = [
        OpCase("MatMul/2d", "MatMul", _matmul((5,), 64, 32), constants=("b",)),
        OpCase("MatMul/3d", "MatMul", _matmul((2, 3), 40, 24), constants=("b",), rows=("a",)),
        OpCase("MatMul/M1", "MatMul", _matmul((1, 1), 96, 40), constants=("b",)),
        OpCase("MatMul/K576-N960-M1", "MatMul", _matmul((1,), 576, 960), constants=("b",)),
        OpCase("MatMul/K100-N37-M5", "MatMul", _matmul((5,), 100, 37), constants=("b",)),
        OpCase("MatMul/K1536-N576-M33", "MatMul", _matmul((33,), 1536, 576), constants=("b",)),
        OpCase("MatMul/K2560-N64-M3", "MatMul", _matmul((3,), 2560, 64), constants=("b",)),  # K > 2048
        _nbits_case((1, 1), 40, 24, 16),                   # K % 16 != 0, odd block count
        _nbits_case((2, 3), 40, 24, 16, zp="packed", rows=True),
        _nbits_case((2, 3), 72, 24, 32),                   # K % 32 != 0
        _nbits_case((1, 1), 64, 24, 32, zp="packed"),
        _nbits_case((2, 3), 200, 16, 128, zp="packed"),    # K % 128 != 0, even block count
        _nbits_case((1, 1), 256, 16, 128),
        _nbits_case((1, 3), 576, 72, 32),
        _nbits_case((1, 3), 80, 72, 16, zp="packed"),
        _nbits_case((1, 3), 300, 72, 128, zp="packed"),
        _nbits_case((1, 3), 576, 72, 64, zp="float"),
        _nbits_case((3,), 600, 40, 256, zp="packed"),
        _nbits_case((3,), 1100, 40, 512),                  # 3 blocks of 512, K % 512 != 0
        _nbits_case((3,), 2560, 64, 128, zp="packed"),     # K > 2048
        _nbits_case((1, 3), 200, 72, 64, bits=8),
        _nbits_case((1, 3), 96, 72, 32, bits=8, zp="packed"),
        _nbits_case((3,), 96, 40, 32, bits=2, zp="packed"),
    ]
    for m in ROW_COUNTS:
        cases.append(OpCase(f"MatMul/rows-M{m}", "MatMul", _matmul((m,), 576, 200), constants=("b",), rows=("a",)))
        cases.append(_nbits_case((m,), 576, 200, 32, tag=f"rows-M{m}", rows=True))
    for m in (1, 17, 40):  # K = 4,864 (19 segments of 256, more than one per warp on cuda)
        cases.append(OpCase(f"MatMul/K4864-rows-M{m}", "MatMul", _matmul((m,), 4864, 48), constants=("b",),
                            rows=("a",)))
        cases.append(_nbits_case((m,), 4864, 48, 32, tag=f"K4864-rows-M{m}", rows=True))
    for m in EXACT_COUNTS:
        cases.append(OpCase(f"MatMul/1e4-M{m}", "MatMul", _matmul_1e4(m, 576, 64), constants=("b",),
                            tolerance=dict(EXACT)))
        cases.append(_nbits_case((m,), 576, 64, 32, tag=f"1e4-M{m}", exact=True))
    return cases


def _gbq(shape, v, d, block, bits=4, zp=False):
    def make(rng, dtype):
        n_blocks = d // block
        inputs = {"data": rng.integers(0, 256, (v, d * bits // 8), dtype=np.uint8),
                  "indices": rng.integers(0, v, shape).astype(np.int64),
                  "scales": rng.uniform(0.01, 0.1, (v, n_blocks)).astype(dtype)}
        if zp:
            inputs["zero_points"] = rng.integers(0, 256, (v, -(-n_blocks * bits // 8)), dtype=np.uint8)
        return inputs
    return make


def _gbq_case(tag, shape, v, d, block, bits=4, zp=False) -> OpCase:
    return OpCase(f"GatherBlockQuantized/{tag}", "GatherBlockQuantized", _gbq(shape, v, d, block, bits, zp),
                  domain="com.microsoft",
                  attributes={"bits": bits, "block_size": block, "gather_axis": 0, "quantize_axis": 1},
                  constants=("data", "scales", "zero_points"), tolerance=dict(ELEMENTWISE))


# -- GroupQueryAttention -------------------------------------------------------------------

CAP = 16


def _kv_buffer(rng, dtype, layout, nkv, head, lengths, cap=CAP, ring=False):
    """A KV buffer of capacity ``cap`` with rows [0, length_b) random and NaN beyond (poison);
    ``ring``: the slots of row b's last min(length_b, cap) positions (slot = position mod cap,
    docs/kv-geometry.md) random, NaN elsewhere."""
    buf = np.full((len(lengths), nkv, cap, head), np.nan, np.float32)
    for b, n in enumerate(lengths):
        rows = np.arange(max(0, n - cap), n) % cap if ring else np.arange(n)
        buf[b][:, rows] = rng.standard_normal((nkv, len(rows), head))
    buf = buf.astype(dtype)
    return np.ascontiguousarray(buf if layout == "head_major" else buf.transpose(0, 2, 1, 3))


def _gqa(layout, seq, pasts, lengths, total, heads, nan_padding, cap=CAP, qk_norm=False, ring=False):
    """GQA inputs: ``pasts`` rows already cached, ``lengths`` new tokens per row (right padding
    up to ``seq``, NaN with ``nan_padding``); seqlens_k = past + length - 1. Packed QKV, or with
    ``qk_norm`` separate q/k/v (scaled by 3, which the norm undoes) and q_norm_weight /
    k_norm_weight [H] (inputs 14, 15), as the builder writes Qwen3 for CUDA."""
    nq, nkv, head = heads

    def make(rng, dtype):
        angles = np.arange(max(64, cap, total))[:, None] / (10000.0 ** (np.arange(0, head, 2) / head))[None, :]
        scale = 3.0 if qk_norm else 1.0
        query = _normal(rng, (len(pasts), seq, (nq + 2 * nkv) * head), dtype, scale)
        if nan_padding:
            for b, n in enumerate(lengths):
                query[b, n:] = np.nan
        qkv = {"query": query, "key": None, "value": None}
        if qk_norm:
            qkv = {"query": np.ascontiguousarray(query[..., :nq * head]),
                   "key": np.ascontiguousarray(query[..., nq * head:(nq + nkv) * head]),
                   "value": np.ascontiguousarray(query[..., (nq + nkv) * head:])}
        inputs = qkv | {
            "past_key": _kv_buffer(rng, dtype, layout, nkv, head, pasts, cap, ring),
            "past_value": _kv_buffer(rng, dtype, layout, nkv, head, pasts, cap, ring),
            "seqlens_k": np.array([p + n - 1 for p, n in zip(pasts, lengths)], np.int32),
            "total_sequence_length": np.array(total, np.int32),
            "cos_cache": np.cos(angles).astype(dtype), "sin_cache": np.sin(angles).astype(dtype)}
        if qk_norm:
            inputs |= {name: None for name in ("position_ids", "attention_bias", "head_sink", "k_scale", "v_scale")}
            inputs |= {"q_norm_weight": (1 + 0.3 * rng.standard_normal(head)).astype(dtype),
                       "k_norm_weight": (1 + 0.3 * rng.standard_normal(head)).astype(dtype)}
        return inputs
    return make


def _gqa_spans(inputs: dict[str, Any]) -> list[tuple[int, int]]:
    """(past, new tokens) of every row, read from the inputs (the op's own rule: a first
    prompt when S == total_sequence_length, else past = seqlens_k + 1 - S)."""
    seq, total = inputs["query"].shape[1], int(inputs["total_sequence_length"])
    spans = []
    for sk in inputs["seqlens_k"]:
        t = int(sk) + 1
        past = 0 if seq == total else t - seq
        spans.append((past, t - past))
    return spans


def _gqa_select(layout, ring=False):
    """Output rows of real tokens, and KV rows [0, past + new) of each row (``ring``: the slots
    of its last min(past + new, capacity) positions)."""
    def select(inputs, index, array):
        parts = []
        for b, (p, n) in enumerate(_gqa_spans(inputs)):
            cap = array.shape[2 if layout == "head_major" else 1]
            rows = np.sort(np.arange(max(0, p + n - cap), p + n) % cap) if ring and index else np.arange(p + n)
            if index == 0:
                parts.append(array[b, :n].ravel())
            elif layout == "head_major":
                parts.append(array[b][:, rows].ravel())
            else:
                parts.append(array[b][rows].ravel())
        return np.concatenate(parts)
    return select


def _gqa_alone(inputs: dict[str, Any]) -> Inputs:
    """One row of a first prompt without its right padding (S = total = its length)."""
    (past, new), = _gqa_spans(inputs)
    if past or new == inputs["query"].shape[1]:
        return inputs
    cut = {k: inputs[k][:, :new] for k in ("query", "key", "value") if inputs.get(k) is not None}
    return dict(inputs, **cut, total_sequence_length=np.array(new, np.int32))


def _gqa_case(name, layout, seq, pasts, lengths, total, heads=(4, 2, 16), scale=None,
              nan_padding=False, cap=CAP, window=-1, qk_norm=False, ring=False) -> OpCase:
    nq, nkv, head = heads
    attributes = {"num_heads": nq, "kv_num_heads": nkv, "scale": head ** -0.5 if scale is None else scale,
                  "local_window_size": window, "softcap": 0.0, "do_rotary": 1, "rotary_interleaved": 0}
    constants: tuple[str, ...] = ("cos_cache", "sin_cache")
    rows: tuple[str, ...] = ("query", "past_key", "past_value", "seqlens_k")
    if qk_norm:
        attributes["qk_norm_epsilon"] = 1e-6
        constants += ("q_norm_weight", "k_norm_weight")
        rows += ("key", "value")
    if ring:
        attributes["sliding_window_cache"] = 1
    return OpCase(
        f"GroupQueryAttention/{name}-{layout}", "GroupQueryAttention",
        _gqa(layout, seq, pasts, lengths, total, heads, nan_padding, cap, qk_norm, ring), domain="com.microsoft",
        attributes=attributes, outputs=("y", "present_key", "present_value"), constants=constants,
        kv_layout=layout, select=_gqa_select(layout, ring),
        rows=rows if len(pasts) > 1 else (), alone=_gqa_alone, host=("total_sequence_length",))


def _gqa_cases() -> list[OpCase]:
    cases = []
    g3 = {"heads": (6, 2, 32), "scale": 0.0}  # 3 query heads per KV head, default scale
    for layout in LAYOUTS:
        # prompt (first prompt: every past is 0), right padding to S = 6; padding NaN (docs/cases.md 20)
        cases.append(_gqa_case("prompt-right-padding", layout, 6, [0, 0, 0], [6, 3, 1], 6))
        cases.append(_gqa_case("prompt-nan-padding", layout, 6, [0, 0, 0], [6, 3, 1], 6, nan_padding=True))
        cases.append(_gqa_case("g3-h32-prompt", layout, 7, [0, 0, 0], [3, 7, 1], 7, **g3))
        # decode: S = 1 against a shared buffer of capacity 16, per-row past lengths (docs/cases.md 2, 7)
        cases.append(_gqa_case("decode-per-row-lengths", layout, 1, [5, 9, 2], [1, 1, 1], CAP))
        cases.append(_gqa_case("g3-h32-decode", layout, 1, [3, 7, 1], [1, 1, 1], CAP, **g3))
        # append 4 tokens after 3 into a shared buffer of capacity 16 (docs/cases.md 5, B = 1)
        cases.append(_gqa_case("append-shared-buffer", layout, 4, [3], [4], 7))
        # long contexts, across the split-KV chunk boundaries of 64 positions (docs/cuda.md):
        # contexts 1, 2, 63, 64, 65 and 1,000 in one decode batch; 8,192 alone; a local window
        # that starts inside a chunk; prompts of 1..1,000 tokens; an append ending at 8,192
        cases.append(_gqa_case("decode-split-contexts", layout, 1, [0, 1, 62, 63, 64, 999], [1] * 6,
                               1024, cap=1024))
        cases.append(_gqa_case("decode-context-8192", layout, 1, [8191], [1], 8192, cap=8192))
        cases.append(_gqa_case("decode-window-split", layout, 1, [150, 999], [1, 1], 1024, cap=1024,
                               window=70))
        cases.append(_gqa_case("prompt-split-lengths", layout, 65, [0] * 5, [65, 64, 63, 2, 1], 65, cap=128))
        cases.append(_gqa_case("prompt-1000", layout, 1000, [0, 0], [1000, 300], 1000, cap=1024, **g3))
        cases.append(_gqa_case("append-to-8192", layout, 4, [8188], [4], 8192, cap=8192))
        # the fused q/k RMSNorm (Qwen3 on CUDA, docs/ops.md 1.3.0): prompt, decode across a chunk
        # boundary, an append; G = 3 query heads per KV head, H = 128
        qk = {"qk_norm": True, "heads": (6, 2, 128)}
        cases.append(_gqa_case("qk-norm-prompt", layout, 6, [0, 0, 0], [6, 3, 1], 6, **qk))
        cases.append(_gqa_case("qk-norm-decode", layout, 1, [5, 63, 99], [1, 1, 1], 128, cap=128, **qk))
        cases.append(_gqa_case("qk-norm-append", layout, 4, [3], [4], 7, **qk))
        # sliding_window_cache=1 rings (docs/kv-geometry.md): window 24 in 40 slots, rows before,
        # at and past a wrap; a right-padded prompt longer than the ring; window 100 in 116 slots
        # with windows across chunk boundaries and a wrap inside a chunk
        cases.append(_gqa_case("ring-decode", layout, 1, [5, 39, 40, 150], [1] * 4, 256, cap=40, window=24,
                               ring=True))
        cases.append(_gqa_case("ring-prompt", layout, 50, [0, 0, 0], [50, 30, 7], 50, cap=40, window=24,
                               ring=True))
        cases.append(_gqa_case("ring-decode-split", layout, 1, [150, 999, 60], [1, 1, 1], 1024, cap=116,
                               window=100, ring=True, **g3))
    return cases


# -- fused ops (core.fusion) ---------------------------------------------------------------

FUSED_COUNTS = (1, 3, 8, 17, 256)


def _silu_chain(x: str, up: str, y: str) -> list[NodeProto]:
    """Mul(Mul(x, Sigmoid(x)), up): what lockstep.SiluMul stands for."""
    return [helper.make_node("Sigmoid", [x], [f"{y}.s"]), helper.make_node("Mul", [x, f"{y}.s"], [f"{y}.g"]),
            helper.make_node("Mul", [f"{y}.g", up], [y])]


def _silu_mul(rng, dtype):
    return {"x": _normal(rng, (3, 1, 1536), dtype, 4.0), "up": _normal(rng, (3, 1, 1536), dtype)}


def _gated_case(m, k, n, nbits=False, zp=None) -> OpCase:
    """lockstep.SiluGatedMatMul(NBits) at M rows; N = 52 leaves a partial last group of 8."""
    names = ("b_gate", "scales_gate", "zp_gate", "b_up", "scales_up", "zp_up") if nbits else ("w_gate", "w_up")

    def make(rng, dtype):
        inputs = {"x": _normal(rng, (m, k), dtype, 0.5)}
        if not nbits:
            return inputs | {name: _normal(rng, (k, n), dtype, k ** -0.5) for name in names}
        weights = [*_nbits_weights(rng, dtype, k, n, 32, zp=zp), *_nbits_weights(rng, dtype, k, n, 32, zp=zp)]
        return inputs | dict(zip(names, weights))

    attrs = _nbits_attrs(k, n, 32) if nbits else {}

    def unfused():
        if nbits:
            gate = ["x", "b_gate", "scales_gate"] + (["zp_gate"] if zp else [])
            up = ["x", "b_up", "scales_up"] + (["zp_up"] if zp else [])
            proj = [helper.make_node("MatMulNBits", gate, ["gate"], domain="com.microsoft", **attrs),
                    helper.make_node("MatMulNBits", up, ["up"], domain="com.microsoft", **attrs)]
        else:
            proj = [helper.make_node("MatMul", ["x", "w_gate"], ["gate"]),
                    helper.make_node("MatMul", ["x", "w_up"], ["up"])]
        return proj + _silu_chain("gate", "up", "y")

    op = "SiluGatedMatMulNBits" if nbits else "SiluGatedMatMul"
    tag = f"int4-{zp or 'nozp'}-M{m}" if nbits else f"M{m}"
    return OpCase(f"{op}/{tag}", op, make, domain="lockstep", attributes=attrs, constants=names,
                  rows=("x",), unfused=unfused)


def _fused_cases() -> list[OpCase]:
    cases = [OpCase("SiluMul/d1536", "SiluMul", _silu_mul, domain="lockstep", rows=("x", "up"),
                    unfused=lambda: _silu_chain("x", "up", "y"))]
    for m in FUSED_COUNTS:
        cases += [_gated_case(m, 576, 52), _gated_case(m, 576, 52, nbits=True),
                  _gated_case(m, 576, 52, nbits=True, zp="packed")]
    return cases


# -- norms, elementwise, gather, cast ------------------------------------------------------

def _skip_norm(shape):
    def make(rng, dtype):
        return {"x": _normal(rng, shape, dtype), "skip": _normal(rng, shape, dtype),
                "gamma": (1 + 0.1 * rng.standard_normal(shape[-1])).astype(dtype)}
    return make


def _norm(shape):
    def make(rng, dtype):
        return {"x": _normal(rng, shape, dtype, 3.0), "scale": (1 + 0.1 * rng.standard_normal(shape[-1])).astype(dtype)}
    return make


def _binary(shape_a, shape_b):
    def make(rng, dtype):
        return {"a": _normal(rng, shape_a, dtype), "b": _normal(rng, shape_b, dtype)}
    return make


def _gather_rows(v, d):
    def make(rng, dtype):
        return {"data": _normal(rng, (v, d), dtype), "indices": rng.integers(0, v, (3, 5)).astype(np.int64)}
    return make


def _gather_columns(k, v):
    def make(rng, dtype):
        return {"w": _normal(rng, (k, v), dtype), "indices": rng.integers(-v, v, (3, 5)).astype(np.int64)}
    return make


def _gather_columns_case(k, v) -> OpCase:
    """lockstep.GatherColumns: the tied-embedding lookup from the lm_head weight W [K, V]
    (negative indices too); W is a constant, so a provider may read it prepared (packed)."""
    def unfused():
        return [helper.make_node("Transpose", ["w"], ["w.t"], perm=[1, 0]),
                helper.make_node("Gather", ["w.t", "indices"], ["y"], axis=0)]

    return OpCase(f"GatherColumns/k{k}-v{v}", "GatherColumns", _gather_columns(k, v), domain="lockstep",
                  constants=("w",), tolerance=dict(EXACT), rows=("indices",), unfused=unfused)


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


def _mask_rows(width, data=np.int64):
    """An attention mask [5, width] of ``data``: each row ones over a prefix of its own length
    (1 to width), as a decode step's persistent mask; a case of the fused ReduceSumSubCast."""
    def make(rng, dtype):
        lengths = rng.integers(1, width + 1, 5)
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(data)
        return {"x": mask, "axes": np.array([1], np.int64), "b": np.array([1], np.int64)}
    return make


def _mask_seqlens_case(width: int, keepdims: int, data=np.int64) -> OpCase:
    """lockstep.ReduceSumSubCast: the builder's seqlens_k = int32(ReduceSum(mask, [1]) - 1), of an
    int64 mask as the builder writes it, or of another integer ``data`` (an int32 mask: the
    providers' general path, on cuda the CuPy expressions rather than the kernel)."""
    def unfused():
        return [helper.make_node("ReduceSum", ["x", "axes"], ["sum"], keepdims=keepdims),
                helper.make_node("Sub", ["sum", "b"], ["diff"]),
                helper.make_node("Cast", ["diff"], ["y"], to=TensorProto.INT32)]

    tag = "" if data is np.int64 else f"-{np.dtype(data).name}"
    return OpCase(f"ReduceSumSubCast/mask-w{width}-keep{keepdims}{tag}", "ReduceSumSubCast", _mask_rows(width, data),
                  domain="lockstep", attributes={"keepdims": keepdims, "to": TensorProto.INT32},
                  constants=("axes", "b"), dtypes=("int32",), tolerance=dict(EXACT), rows=("x",), unfused=unfused)


# -- MoE / QMoE (docs/moe.md) -----------------------------------------------------------------

MOE_SWIGLU = {"activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": 1.702, "activation_beta": 1.0,
              "swiglu_limit": 7.0, "normalize_routing_weights": 1}


def _moe_case(m, e, h, inter, k, quantized=False, prepacked=False) -> OpCase:
    """MoE (dense experts) or QMoE (int4, block 32; ``prepacked``: the codes in ONNX Runtime's
    CUDA layout, core.qmoe_layout) with gpt-oss's SwiGLU over M token rows, with the
    row-invariance property (rows share experts)."""
    def make(rng, dtype):
        from core.qmoe_layout import to_cutlass

        inputs = {"x": _normal(rng, (m, h), dtype), "router": _normal(rng, (m, e), dtype, 2.0)}
        if quantized:
            for name, (n, kk) in (("1", (2 * inter, h)), ("2", (h, inter))):
                codes = rng.integers(0, 256, (e, n, kk // 2), dtype=np.uint8)
                inputs[f"w{name}"] = to_cutlass(codes, 4) if prepacked else codes
                inputs[f"s{name}"] = (rng.uniform(0.5, 1.5, (e, n, kk // 32)) / (8 * np.sqrt(kk))).astype(dtype)
                inputs[f"b{name}"] = _normal(rng, (e, n), dtype, 0.1)
            return inputs
        return inputs | {"w1": _normal(rng, (e, 2 * inter, h), dtype, h ** -0.5),
                         "b1": _normal(rng, (e, 2 * inter), dtype, 0.1),
                         "w2": _normal(rng, (e, h, inter), dtype, inter ** -0.5),
                         "b2": _normal(rng, (e, h), dtype, 0.1)}

    op = "QMoE" if quantized else "MoE"
    attrs = (MOE_SWIGLU | {"k": k} | ({"expert_weight_bits": 4, "block_size": 32} if quantized else {})
             | ({"weights_prepacked": 1} if prepacked else {}))
    weights = ("w1", "s1", "b1", "w2", "s2", "b2") if quantized else ("w1", "b1", "w2", "b2")
    tag = "-prepacked" if prepacked else ""
    return OpCase(f"{op}/swiglu-E{e}-k{k}-H{h}-I{inter}-M{m}{tag}", op, make, domain="com.microsoft", attributes=attrs,
                  constants=weights, rows=("x", "router"))


SKIP_NORM: dict[str, Any] = {"op": "SkipSimplifiedLayerNormalization", "domain": "com.microsoft",
             "attributes": {"epsilon": 1e-5}, "constants": ("gamma",), "rows": ("x", "skip")}

OP_CASES: list[OpCase] = [
    *_linear_cases(),
    _gbq_case("bs32-nozp", (2, 5), 40, 64, 32),
    _gbq_case("bs16-zp", (1, 3), 40, 48, 16, zp=True),
    _gbq_case("bs32-d576-nozp", (3, 4), 100, 576, 32),
    _gbq_case("int8-bs64-zp", (3, 4), 50, 256, 64, bits=8, zp=True),
    *_gqa_cases(),
    *_fused_cases(),
    OpCase("SkipSimplifiedLayerNormalization/y-sum", make_inputs=_skip_norm((2, 3, 48)),
           outputs=("y", "", "", "sum"), **SKIP_NORM),
    OpCase("SkipSimplifiedLayerNormalization/y", make_inputs=_skip_norm((2, 3, 48)), **SKIP_NORM),
    OpCase("SkipSimplifiedLayerNormalization/d576-inv-std", make_inputs=_skip_norm((2, 5, 576)),
           outputs=("y", "", "inv_std", "sum"), output_dtype=(None, None, "float32", None), **SKIP_NORM),
    # a row longer than 2,048 values: the cuda kernel's multi-round path (values kept in shared memory)
    OpCase("SkipSimplifiedLayerNormalization/d2560-sum", make_inputs=_skip_norm((1, 3, 2560)),
           outputs=("y", "", "", "sum"), **SKIP_NORM),
    OpCase("SimplifiedLayerNormalization/last-axis", "SimplifiedLayerNormalization", _norm((2, 3, 48)),
           attributes={"epsilon": 1e-5, "axis": -1, "stash_type": 1}, constants=("scale",), rows=("x",)),
    OpCase("SimplifiedLayerNormalization/d576", "SimplifiedLayerNormalization", _norm((2, 5, 576)),
           attributes={"epsilon": 1e-5, "axis": -1, "stash_type": 1}, constants=("scale",), rows=("x",)),
    OpCase("Mul/same-shape", "Mul", _binary((2, 3, 20), (2, 3, 20)), tolerance=dict(ELEMENTWISE)),
    OpCase("Mul/broadcast", "Mul", _binary((2, 3, 20), (20,)), tolerance=dict(ELEMENTWISE)),
    OpCase("Add/broadcast", "Add", _binary((2, 3, 20), (1, 3, 1)), tolerance=dict(ELEMENTWISE)),
    OpCase("Sigmoid/wide-range", "Sigmoid", lambda rng, dt: {"x": _normal(rng, (4, 33), dt, 6.0)},
           tolerance=dict(ELEMENTWISE)),
    OpCase("Gelu/erf", "Gelu", lambda rng, dt: {"x": _normal(rng, (4, 33), dt, 4.0)},
           attributes={"approximate": "none"}, tolerance=dict(ELEMENTWISE)),
    OpCase("Gelu/tanh", "Gelu", lambda rng, dt: {"x": _normal(rng, (4, 33), dt, 4.0)},
           attributes={"approximate": "tanh"}, tolerance=dict(ELEMENTWISE)),
    OpCase("FastGelu/bias", "FastGelu", lambda rng, dt: {"x": _normal(rng, (2, 3, 33), dt, 4.0),
                                                         "bias": _normal(rng, (33,), dt)},
           domain="com.microsoft", constants=("bias",), tolerance=dict(ELEMENTWISE)),
    OpCase("QuickGelu/alpha", "QuickGelu", lambda rng, dt: {"x": _normal(rng, (4, 33), dt, 4.0)},
           domain="com.microsoft", attributes={"alpha": 1.702}, tolerance=dict(ELEMENTWISE)),
    OpCase("Tanh/softcap-range", "Tanh", lambda rng, dt: {"x": _normal(rng, (4, 33), dt, 3.0)},
           tolerance=dict(ELEMENTWISE)),
    OpCase("Gather/embedding-rows", "Gather", _gather_rows(50, 24), constants=("data",), tolerance=dict(EXACT)),
    OpCase("Gather/embedding-576", "Gather", _gather_rows(100, 576), constants=("data",), tolerance=dict(EXACT)),
    _gather_columns_case(100, 37),
    _gather_columns_case(576, 512),
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
    _mask_seqlens_case(12, 0),
    _mask_seqlens_case(4100, 0),
    _mask_seqlens_case(64, 1),
    _mask_seqlens_case(64, 1, np.int32),
    _moe_case(9, 8, 64, 64, 2),
    _moe_case(17, 8, 64, 32, 4, quantized=True),
    _moe_case(9, 8, 64, 64, 2, quantized=True, prepacked=True),
]


def _register() -> None:
    """Add the case modules' cases (each imports this module inside its ``cases()``)."""
    from core.testing import router_cases

    OP_CASES.extend(router_cases.cases())


_register()


# -- device_argmax (docs/cases.md 11, 12, 23) ------------------------------------------------------

VOCAB = 2304  # > 2 * 1024, so ties {i, i + blockDim} fit for blockDim 256 and 1024
WIDE_VOCABS = (49152, 151936, 262144)  # SmolLM2, Qwen3, Gemma 3


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


def _argmax_wide(vocab):
    """Full-size vocabularies, logits [8, 2, V] read at positions 0, 1, 0, 1, ...: ties at
    {0, last}, {i, i + 256}, {4097, 12288}, {j, j + 1024}, an all-equal row, NaN at 0, +inf,
    and an all-NaN row; position 1 holds the rows in reverse order."""
    def make(rng, dtype):
        rows = _normal(rng, (8, vocab), np.float32)
        rows[0, [0, vocab - 1]] = 10.0
        i = int(rng.integers(0, 256))
        rows[1, [i, i + 256]] = 10.0
        rows[2, [4097, 3 * 4096]] = 10.0
        j = int(rng.integers(0, vocab - 1024))
        rows[3, [j, j + 1024]] = 10.0
        rows[4] = 1.0
        rows[5, 0] = np.nan
        rows[6, 77] = np.inf
        rows[7] = np.nan
        return np.stack([rows, rows[::-1]], 1).astype(dtype), np.array([0, 1] * 4, np.int32)
    return make


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
    *[ArgmaxCase(f"vocab{v}", _argmax_wide(v)) for v in WIDE_VOCABS],
]


def case_params() -> list[tuple[str, OpCase, str]]:
    """Every (kit id, case, dtype) the op suite runs: kit id "op/<case id>/<dtype>"."""
    return [(f"op/{c.id}/{dt}", c, dt) for c in OP_CASES for dt in c.dtypes]


def argmax_params() -> list[tuple[str, ArgmaxCase, str]]:
    """Every (kit id, case, dtype) of device_argmax: kit id "argmax/<case id>/<dtype>"."""
    return [(f"argmax/{c.id}/{dt}", c, dt) for c in ARGMAX_CASES for dt in c.dtypes]

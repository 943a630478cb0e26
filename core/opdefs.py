"""Op semantics shared by providers: host-value tests, integer-input parsing, attribute and
dtype rules of the ops (ONNX, com.microsoft and the core's fused ops).

Providers import these instead of each other's op modules, so no provider depends on another
one (a cuda op never imports cpu_reference). NumPy only; no provider import.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from onnx import TensorProto

#: Types of host values: numpy arrays and scalars, Python numbers (None is an absent input).
HOST_TYPES = (np.ndarray, np.generic, int, float)


def is_host(x) -> bool:
    """True for host values (numpy arrays / scalars, Python numbers) and absent inputs (None)."""
    return x is None or isinstance(x, HOST_TYPES)


def int_list(x) -> list[int]:
    """A host integer tensor (scalar or 1-D, any int dtype) as a list of Python ints."""
    return [int(v) for v in np.asarray(x).reshape(-1)]


def int_scalar(x) -> int:
    """A host integer scalar or 1-element tensor as a Python int.

    Raises:
        ValueError: ``x`` has not exactly one element.
    """
    values = int_list(x)
    if len(values) != 1:
        raise ValueError(f"expected a scalar or 1-element tensor, got {len(values)} elements")
    return values[0]


def normalize_axis(axis: int, rank: int) -> int:
    """``axis`` in [-rank, rank) as a non-negative axis.

    Raises:
        ValueError: ``axis`` out of range.
    """
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} out of range for rank {rank}")
    return axis % rank


# -- ReduceSum (ONNX ReduceSum-13) ----------------------------------------------------------
def reduce_axes(node, axes, rank: int) -> tuple[int, ...] | None:
    """The axes a ReduceSum node sums over, non-negative and sorted: the ``axes`` input (a host
    integer tensor) or, when it is absent, the ``axes`` attribute (opset < 13); every axis when
    those are empty, unless ``noop_with_empty_axes=1``: then None (the output is the input).

    Raises:
        ValueError: an axis out of range.
    """
    axis_list = int_list(axes) if axes is not None else list(node.attrs.get("axes", []))
    if not axis_list:
        if node.attrs.get("noop_with_empty_axes", 0):
            return None
        axis_list = list(range(rank))
    return tuple(sorted({normalize_axis(a, rank) for a in axis_list}))


def reduce_sum_sub_cast_supports(node) -> bool:
    """The shared rule of ``lockstep.ReduceSumSubCast`` (core.fusion): integer data and the
    three inputs (data, axes, b); the arithmetic is then exact on every provider."""
    data = node.input_dtypes[0] if node.input_dtypes else None
    return data is not None and np.dtype(data).kind in "iu" and len(node.inputs) == 3


# -- Slice (ONNX Slice-13) ------------------------------------------------------------------
def slice_index(shape, starts, ends, axes=None, steps=None) -> tuple:
    """The index (a tuple of slices) of ``data[starts:ends:steps]`` along ``axes`` for data of
    ``shape``; the inputs are host integer tensors. Negative starts/ends add the dim, then
    step > 0 clamps start and end to [0, dim], step < 0 clamps start to [0, dim-1] and end to
    [-1, dim-1] (-1: before 0); axes default to 0..len(starts)-1, steps to 1.

    Raises:
        ValueError: a step of 0.
    """
    starts, ends = int_list(starts), int_list(ends)
    axes = int_list(axes) if axes is not None else list(range(len(starts)))
    steps = int_list(steps) if steps is not None else [1] * len(starts)
    index = [slice(None)] * len(shape)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = normalize_axis(axis, len(shape))
        dim = int(shape[axis])
        if step == 0:
            raise ValueError("Slice: step 0")
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        index[axis] = slice(start, None if end < 0 else end, step)
    return tuple(index)


# -- Constant (ONNX Constant-21) ------------------------------------------------------------
#: Attribute of a Constant node -> numpy dtype of its value (None: the tensor's own dtype).
CONSTANT_KINDS = {"value": None, "value_float": np.float32, "value_floats": np.float32,
                  "value_int": np.int64, "value_ints": np.int64}


def constant_supports(node) -> bool:
    """Exactly one attribute, a dense tensor or float/int value(s); sparse and string values
    are not supported."""
    return len(node.attrs) == 1 and next(iter(node.attrs)) in CONSTANT_KINDS


def constant_value(node) -> np.ndarray:
    """The host array a Constant node outputs."""
    (name, value), = node.attrs.items()
    return np.array(value, dtype=CONSTANT_KINDS[name])


# -- Cast (ONNX Cast-21) --------------------------------------------------------------------
#: Cast targets no provider supports: bfloat16, float8, string, 4-bit integers.
CAST_UNSUPPORTED = frozenset({
    TensorProto.BFLOAT16, TensorProto.STRING, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ,
    TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ, TensorProto.UINT4, TensorProto.INT4})


def cast_supports(node) -> bool:
    """The ``to`` attribute is set and names a supported dtype (not in CAST_UNSUPPORTED)."""
    to = int(node.attrs.get("to", 0))
    return to != 0 and to not in CAST_UNSUPPORTED


# -- MatMulNBits and GatherBlockQuantized (com.microsoft, docs/ops.md 2 and 5) ---------------------
def matmul_nbits_supports(node) -> bool:
    """bits 2/4/8, block_size a power of two >= 16, no prepacked weight, no g_idx (input 4)."""
    attrs = node.attrs
    bs = int(attrs.get("block_size", 0))
    g_idx = len(node.inputs) > 4 and node.inputs[4] != ""
    return (int(attrs.get("bits", 4)) in (2, 4, 8) and bs >= 16 and bs & (bs - 1) == 0
            and not attrs.get("weight_prepacked", 0) and not g_idx)


def gather_block_quantized_supports(node) -> bool:
    """gather_axis 0, quantize_axis the last (1), bits 4/8, block_size a power of two >= 16."""
    attrs = node.attrs
    bs = int(attrs.get("block_size", 128))
    return (int(attrs.get("gather_axis", 0)) == 0 and int(attrs.get("quantize_axis", 1)) in (1, -1)
            and int(attrs.get("bits", 4)) in (4, 8) and bs >= 16 and bs & (bs - 1) == 0)


# -- fused gated projections (core.fusion) -------------------------------------------------
def gate_view(node) -> SimpleNamespace:
    """The gate projection of a fused ``lockstep.SiluGatedMatMulNBits`` node as a MatMulNBits
    node: its name, attributes, inputs 0..3 and their dtypes."""
    return SimpleNamespace(name=node.name, attrs=node.attrs, inputs=tuple(node.inputs[:4]),
                           input_dtypes=tuple(node.input_dtypes[:4]))


# -- GroupQueryAttention (com.microsoft, docs/ops.md 1) -------------------------------------
def gqa_unsupported(node, interleaved: bool = True, bias: bool = True, qk_norm: bool = False,
                    any_norm_dtype: bool = True, ring: bool = False) -> list[str]:
    """The attributes, inputs and dtypes of a GroupQueryAttention node outside what the
    built-in kernels run (empty: supported), each as ``what=value (meaning)``.

    Args:
        interleaved: the kernel runs ``rotary_interleaved=1``.
        bias: the kernel reads ``position_ids`` and ``attention_bias`` (inputs 9, 10).
        qk_norm: the kernel applies the fused q/k RMSNorm (inputs 14, 15 given together;
            ``qk_norm_epsilon``, overridden per side by ``q_norm_epsilon`` / ``k_norm_epsilon``).
        any_norm_dtype: the q/k norm weights may have another float dtype than the query (else
            a declared dtype that differs is reported).
        ring: the kernel runs ``sliding_window_cache=1`` as Lockstep's ring KV cache
            (docs/kv-geometry.md): with ``local_window_size > 0``, past key/value given and no
            attention_bias.
    """
    attrs = node.attrs
    ins = list(node.inputs) + [""] * 17
    out = []
    if int(attrs.get("sliding_window_cache", 0)):
        if not ring:
            out.append("sliding_window_cache=1 (a window-sized KV cache, which this provider does not run yet; "
                       "run the folder on cpu_reference, or rebuild it with `lockstep prepare` or the builder's "
                       "`--extra_options windowed_kv_cache=false`: a full-length cache and a window mask)")
        elif int(attrs.get("local_window_size", -1)) <= 0 or not (ins[3] and ins[4]) or ins[10]:
            out.append(f"sliding_window_cache=1 with local_window_size={attrs.get('local_window_size', -1)}"
                       f"{'' if ins[3] and ins[4] else ', no past key/value'}"
                       f"{', attention_bias' if ins[10] else ''} (a ring needs a window > 0, a past and no bias)")
    for a in ("k_quant_type", "v_quant_type"):
        if str(attrs.get(a, "NONE")).upper() not in ("NONE", ""):
            out.append(f"{a}={attrs[a]!r} (quantized KV cache)")
    if int(attrs.get("kv_cache_bit_width", 0)) not in (0, 16, 32):
        out.append(f"kv_cache_bit_width={attrs['kv_cache_bit_width']}")
    if int(attrs.get("qk_output", 0)):
        out.append(f"qk_output={attrs['qk_output']}")
    if int(attrs.get("causal", 1)) != 1:
        out.append("causal=0")
    if not interleaved and int(attrs.get("rotary_interleaved", 0)):
        out.append("rotary_interleaved=1")
    if not bias and any(ins[9:11]):
        out.append("position_ids / attention_bias inputs")
    names = ["k_scale", "v_scale", "q_norm_weight (fused q/k RMSNorm)", "k_norm_weight (fused q/k RMSNorm)",
             "query_seqlens"]
    out += [f"input {names[j - 12]}" for j in range(12, 17) if ins[j] and not (qk_norm and j in (14, 15))]
    if qk_norm and bool(ins[14]) != bool(ins[15]):
        out.append("q_norm_weight without k_norm_weight or the reverse (ORT requires both)")
    dtypes = list(node.input_dtypes or ()) + [None] * 17
    if qk_norm and ins[14] and not any_norm_dtype:
        for j, name in ((14, "q_norm_weight"), (15, "k_norm_weight")):
            if dtypes[j] is not None and dtypes[0] is not None and np.dtype(dtypes[j]) != np.dtype(dtypes[0]):
                out.append(f"{name} dtype {np.dtype(dtypes[j]).name} (the kernel needs the query's, "
                           f"{np.dtype(dtypes[0]).name})")
    if qk_norm and ins[14]:
        for a in ("qk_norm_epsilon", "q_norm_epsilon", "k_norm_epsilon"):
            eps = float(attrs.get(a, 1e-6))
            if not (np.isfinite(eps) and eps > 0):
                out.append(f"{a}={eps} (must be finite and > 0)")
    if any(node.outputs[3:]):
        out.append("output qk")
    dtype = node.input_dtypes[0] if node.input_dtypes else None
    if dtype is not None and np.dtype(dtype) not in (np.float32, np.float16):
        out.append(f"dtype {np.dtype(dtype).name}")
    return out


# -- MoE and QMoE (com.microsoft, docs/moe.md) --------------------------------------------
#: Activations the MoE kernels run (ORT's CPU set).
MOE_ACTIVATIONS = ("relu", "gelu", "silu", "identity", "swiglu")


def moe_unsupported(node) -> list[str]:
    """The attributes and inputs of a MoE / QMoE node outside what the built-in kernels run
    (empty: supported), each as ``what=value (meaning)``."""
    attrs = node.attrs
    ins = list(node.inputs) + [""] * 21
    out = []
    act = str(attrs.get("activation_type", "relu"))
    if act not in MOE_ACTIVATIONS:
        out.append(f"activation_type={act!r} (runs {', '.join(MOE_ACTIVATIONS)})")
    if int(attrs.get("use_sparse_mixer", 0)):
        out.append("use_sparse_mixer=1 (Phi-3.5-MoE's SparseMixer routing)")
    if int(attrs.get("swiglu_limit_after_activation", 0)):
        out.append("swiglu_limit_after_activation=1 (a CUDA-only clamp)")
    if int(attrs.get("k", 1)) < 1:
        out.append(f"k={attrs.get('k')}")
    fusion = int(attrs.get("swiglu_fusion", 0))
    if fusion not in (0, 1, 2):
        out.append(f"swiglu_fusion={fusion}")
    fc3 = ins[8] if node.op_type == "QMoE" else ins[6]
    if act == "swiglu" and fusion == 0 and not fc3:
        out.append("swiglu_fusion=0 without fc3 weights (the up projection)")
    if fc3 and not (act == "swiglu" and fusion == 0):
        out.append("fc3 weights with a fused or non-SwiGLU activation")
    if node.op_type == "QMoE":
        if str(attrs.get("quant_type", "int")) != "int":
            out.append(f"quant_type={attrs['quant_type']!r} (integer QMoE only)")
        if int(attrs.get("weights_prepacked", -1)) not in (-1, 0, 1):
            out.append(f"weights_prepacked={attrs['weights_prepacked']} (-1, 0 or 1)")
        for name in ("expert_weight_bits", "fc1_expert_weight_bits", "fc2_expert_weight_bits",
                     "fc3_expert_weight_bits"):
            if name in attrs and int(attrs[name]) not in (2, 4, 8):
                out.append(f"{name}={attrs[name]} (2, 4 or 8)")
        bs = int(attrs.get("block_size", 0))
        if "block_size" in attrs and (bs < 16 or bs & (bs - 1)):
            out.append(f"block_size={bs} (a power of two >= 16)")
        if any(ins[14:]):
            out.append("router_weights, global scales or activation scales (inputs 14..20)")
    dtype = node.input_dtypes[0] if node.input_dtypes else None
    if dtype is not None and np.dtype(dtype) not in (np.float32, np.float16):
        out.append(f"dtype {np.dtype(dtype).name}")
    return out

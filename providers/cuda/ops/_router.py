"""Launchers of kernels/router.cu (no OP_TYPE: a helper): the standard ops of an in-graph MoE
router (LFM2-MoE; docs/moe.md "On cuda"): Neg, Exp, Log, Reciprocal, Clip, TopK,
GatherElements, ScatterElements and the float ReduceSum over one axis run as device kernels
whose shapes follow the tensors' shapes only, so a step with them captures; the kernel file's
header states the (batch-invariant) order of each.
"""

from __future__ import annotations

import numpy as np

from core.opdefs import normalize_axis
from providers.cuda.module import ctype, function
from providers.cuda.ops import device_array, grid_threads, is_host

#: element size in bytes -> the kernels' unsigned element type (copies move bits only).
ELEMENTS = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
#: index dtype -> its C type.
INDICES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
FLOATS = ("__half", "float")
EXPRS = tuple([f"{k}<{t}>" for k in ("unary", "clip", "topk", "reduce_axis") for t in FLOATS]
              + [f"{k}<{e}, {i}>" for k in ("gather_elements", "scatter_elements") for e in ELEMENTS.values()
                 for i in INDICES.values()])
NEG, EXP, LOG, RECIPROCAL = 0, 1, 2, 3
_UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def floats_only(node) -> str | None:
    """None when input 0 is declared fp16 or fp32 (or undeclared), else why not."""
    dtype = node.input_dtypes[0] if node.input_dtypes else None
    if dtype is None or np.dtype(dtype) in (np.float16, np.float32):
        return None
    return f"input dtype {np.dtype(dtype).name} (cuda runs float16 and float32)"


def copyable(node, i: int = 0) -> str | None:
    """None when input ``i`` is declared with an element size the copy kernels move (2, 4 or 8
    bytes), or undeclared; else why not."""
    dtype = node.input_dtypes[i] if len(node.input_dtypes) > i else None
    if dtype is None or np.dtype(dtype).itemsize in ELEMENTS:
        return None
    return f"data dtype {np.dtype(dtype).name} (cuda copies elements of 2, 4 or 8 bytes)"


def device(ctx, x, key: str, what: str):
    """``x`` as a C-contiguous device array: itself, or a host value uploaded once (device_array).

    Raises:
        ValueError: a device array that is not C-contiguous.
    """
    if is_host(x):
        return device_array(ctx, np.ascontiguousarray(x), key)
    if not x.flags.c_contiguous:
        raise ValueError(f"{ctx.node.op_type} (cuda): {what} must be C-contiguous, got strides {x.strides}")
    return x


def split(shape: tuple, axis: int) -> tuple[int, int, int]:
    """(outer, n, inner) of a C-contiguous ``shape`` around ``axis`` (already non-negative)."""
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    return outer, int(shape[axis]), inner


def float_input(ctx, x):
    """``x`` checked: an fp16/fp32 C-contiguous device array.

    Raises:
        ValueError: a host value, another dtype, or a strided array.
    """
    if is_host(x) or x.dtype not in (np.float16, np.float32):
        raise ValueError(f"{ctx.node.op_type} (cuda): needs an fp16/fp32 device input, got "
                         f"{type(x).__name__} {getattr(x, 'dtype', '')}")
    return device(ctx, x, "x", "the input")


def unary(ctx, x, kind: int) -> tuple:
    """y = op(x) elementwise in fp32, rounded once to x's dtype (kind: NEG, EXP, LOG, RECIPROCAL)."""
    x = float_input(ctx, x)
    y = ctx.output(0, x.shape, x.dtype)
    if x.size:
        function("router", f"unary<{ctype(x.dtype)}>", EXPRS)(
            grid_threads(x.size, 256, 4096), (256,), (x, y, np.int64(x.size), np.int32(kind)))
    return (y,)


def element_type(ctx, dtype) -> str:
    """The copy kernels' element type of ``dtype``.

    Raises:
        ValueError: an element size other than 2, 4 or 8 bytes.
    """
    name = ELEMENTS.get(np.dtype(dtype).itemsize)
    if name is None:
        raise ValueError(f"{ctx.node.op_type} (cuda): {np.dtype(dtype).name} elements are not 2, 4 or 8 bytes")
    return name


def index_type(ctx, idx) -> str:
    """The C type of an int32/int64 index array.

    Raises:
        ValueError: another dtype.
    """
    name = INDICES.get(np.dtype(idx.dtype))
    if name is None:
        raise ValueError(f"{ctx.node.op_type} (cuda): indices must be int32 or int64, got {idx.dtype}")
    return name


def check_lines(ctx, data_shape: tuple, idx_shape: tuple, axis: int) -> None:
    """Indices of data's rank whose dims equal data's on every axis but ``axis``.

    Raises:
        ValueError: they do not.
    """
    if len(idx_shape) != len(data_shape) or any(a != b for i, (a, b) in enumerate(zip(data_shape, idx_shape))
                                                 if i != axis):
        raise ValueError(f"{ctx.node.op_type} (cuda): indices {tuple(idx_shape)} must match data "
                         f"{tuple(data_shape)} on every axis but {axis}")


def host_fill(data) -> np.generic | None:
    """The bits of every element of a host ``data`` as one unsigned scalar, when they are all the
    same (ConstantOfShape's output: the scatter writes it without reading data); else None."""
    flat = np.ascontiguousarray(data).reshape(-1)
    if not flat.size or flat.dtype.itemsize not in _UNSIGNED:
        return None
    bits = flat.view(_UNSIGNED[flat.dtype.itemsize])
    return bits[0] if bool((bits == bits[0]).all()) else None


def axis_of(ctx, rank: int, default: int) -> int:
    """The node's ``axis`` attribute, non-negative for ``rank``."""
    return normalize_axis(int(ctx.node.attrs.get("axis", default)), rank)

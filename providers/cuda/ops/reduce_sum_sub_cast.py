"""ReduceSumSubCast (domain "lockstep", core.fusion): Cast(Sub(ReduceSum(data, axes, keepdims), b),
to), the builder's seqlens_k from the attention mask, in one launch instead of four CuPy ones.

The kernel (kernels/mask.cu ``rowsum_sub_i32``) covers what the builder writes: int64 data of
two dimensions summed over the last axis, a one-element host ``b`` that does not widen the
output, ``to`` int32. Anything else (empty axes sum every axis, as ReduceSum) runs the three ops
as CuPy expressions (exact integer arithmetic either way).
"""

import numpy as np
from onnx import helper

from core.opdefs import reduce_axes
from core.opdefs import reduce_sum_sub_cast_supports as supports  # noqa: F401 - the shared rule
from providers.cuda import replay
from providers.cuda.module import function
from providers.cuda.ops import is_host
from providers.cuda.paths import PATHS

#: Launcher runs per path since import: "kernel" (rowsum_sub_i32) or "cupy" (the general path).
PATHS.declare("reduce_sum_sub_cast", ("kernel", "cupy"))

#: Threads per row block of ``rowsum_sub_i32`` (kernels/mask.cu MASK_NT).
THREADS = 128

OP_TYPE = "ReduceSumSubCast"
DOMAIN = "lockstep"


def stats() -> dict:
    """Launcher runs per path since import ({"kernel": n, "cupy": n}); tests read it to know
    which path a case took."""
    return PATHS.stats("reduce_sum_sub_cast")


def run(ctx, data, axes, b):
    import cupy

    if is_host(data) or not is_host(axes):
        raise ValueError("ReduceSumSubCast (cuda): needs device data and host axes")
    keepdims = bool(ctx.node.attrs.get("keepdims", 1))
    to = helper.tensor_dtype_to_np_dtype(int(ctx.node.attrs["to"]))
    red = reduce_axes(ctx.node, axes, data.ndim)  # empty axes: every axis, as ReduceSum
    if red is None:
        raise ValueError("ReduceSumSubCast (cuda): empty axes with noop_with_empty_axes=1 reduce nothing")
    shape = tuple(1 if i in red else d for i, d in enumerate(data.shape) if keepdims or i not in red)
    if (is_host(b) and data.dtype == np.int64 and data.ndim == 2 and red == (1,) and np.size(b) == 1
            and np.broadcast_shapes(shape, np.shape(b)) == shape and to == np.int32 and data.flags.c_contiguous):
        out = ctx.output(0, shape, np.int32)
        PATHS.add("reduce_sum_sub_cast", "kernel")
        if data.shape[0]:
            kern = function("mask", "rowsum_sub_i32", ("rowsum_sub_i32",))
            shift = np.int64(np.asarray(b).reshape(-1)[0])
            kern((data.shape[0],), (THREADS,), (data, np.int64(data.shape[1]), shift, out))
        return (out,)
    PATHS.add("reduce_sum_sub_cast", "cupy")
    summed = cupy.sum(data, axis=red, keepdims=keepdims)
    bd = cupy.asarray(b)
    diff = summed - bd.astype(np.result_type(data.dtype, bd.dtype))
    out = ctx.output(0, diff.shape, to)
    replay.not_replayable()  # CuPy expressions, not recorded Kernel launches
    cupy.copyto(out, diff, casting="unsafe")
    return (out,)

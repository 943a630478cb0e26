"""lockstep.ReduceSumSubCast (core.fusion): Y = Cast(Sub(ReduceSum(DATA, axes, keepdims), B), to),
the builder's seqlens_k from the attention mask. Integer data only: the sum, the difference and
the cast are exact (the cast keeps the low bits, as ONNX Cast does), so it equals the unfused
chain bit for bit.
"""

import numpy as np
from onnx import helper

from core.opdefs import reduce_axes
from core.opdefs import reduce_sum_sub_cast_supports as supports  # noqa: F401 - the shared rule
from providers.cpu_reference.ops._out import write

OP_TYPE = "ReduceSumSubCast"
DOMAIN = "lockstep"


def run(ctx, data, axes, b):
    data = np.asarray(data)
    keepdims = bool(ctx.node.attrs.get("keepdims", 1))
    red = reduce_axes(ctx.node, axes, data.ndim)  # empty axes: every axis, as ReduceSum
    bh = np.asarray(b)
    summed = np.sum(data, axis=red, keepdims=keepdims, dtype=data.dtype)
    diff = summed - bh.astype(np.result_type(data.dtype, bh.dtype))
    return (write(ctx, 0, diff, helper.tensor_dtype_to_np_dtype(int(ctx.node.attrs["to"]))),)

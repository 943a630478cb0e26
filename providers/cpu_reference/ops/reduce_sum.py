"""ReduceSum (ONNX, default domain, opset 13+: axes as optional int64 input).

Sums over ``axes`` (all axes when axes is absent or empty, unless ``noop_with_empty_axes=1``,
which returns the input unchanged); ``keepdims`` default 1. fp16 is summed in fp32; integers in
their own dtype. The builder uses it on the attention mask for seqlens_k (docs/ops.md 0).
An ``axes`` attribute (opset < 13) is honoured when the input is absent. Source: ONNX ReduceSum-13.
"""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import compute_dtype, int_list, normalize_axis

OP_TYPE = "ReduceSum"
DOMAIN = ""


def run(ctx, data, axes=None):
    data = np.asarray(data)
    attrs = ctx.node.attrs
    keepdims = bool(attrs.get("keepdims", 1))
    axis_list = int_list(axes) if axes is not None else list(attrs.get("axes", []))
    if not axis_list:
        if attrs.get("noop_with_empty_axes", 0):
            return (write(ctx, 0, data),)
        axis_list = list(range(data.ndim))
    reduce_axes = tuple(sorted({normalize_axis(a, data.ndim) for a in axis_list}))
    total = np.sum(data, axis=reduce_axes, keepdims=keepdims, dtype=compute_dtype(data.dtype))
    return (write(ctx, 0, total, data.dtype),)

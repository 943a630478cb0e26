"""ReduceSum (ONNX, default domain, opset 13+: axes as optional int64 input).

Sums over ``axes`` (all axes when axes is absent or empty, unless ``noop_with_empty_axes=1``,
which returns the input unchanged); ``keepdims`` default 1. fp16 is summed in fp32; integers in
their own dtype. The builder uses it on the attention mask for seqlens_k (docs/ops.md 0).
An ``axes`` attribute (opset < 13) is honoured when the input is absent. Source: ONNX ReduceSum-13.
"""

import numpy as np

from core.opdefs import reduce_axes
from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import compute_dtype

OP_TYPE = "ReduceSum"
DOMAIN = ""


def run(ctx, data, axes=None):
    data = np.asarray(data)
    keepdims = bool(ctx.node.attrs.get("keepdims", 1))
    red = reduce_axes(ctx.node, axes, data.ndim)
    if red is None:
        return (write(ctx, 0, data),)
    total = np.sum(data, axis=red, keepdims=keepdims, dtype=compute_dtype(data.dtype))
    return (write(ctx, 0, total, data.dtype),)

"""TopK (ONNX, default domain): the ``k`` largest (``largest=1``, default) or smallest values
along ``axis`` (default -1) of an fp16/fp32 input and their int64 indices, sorted (``sorted=0``
is refused, as on cpu_reference). Equal values keep the lower index first and NaN comes after
every number, exactly cpu_reference's stable order. ``k`` must be a host value (it sets the
output shape). kernels/router.cu ``topk``: each element's rank is counted over its own slice
(no reduction, batch-invariant). Source: ONNX TopK-11."""

import numpy as np

from core.opdefs import int_scalar
from providers.cuda.module import ctype, function
from providers.cuda.ops import _router, grid_threads, is_host

OP_TYPE = "TopK"
DOMAIN = ""


def support_reason(node) -> str | None:
    reasons = [r for r in (_router.floats_only(node),) if r]
    if int(node.attrs.get("sorted", 1)) != 1:
        reasons.append("sorted=0")
    return "; ".join(reasons) or None



def run(ctx, x, k):
    x = _router.float_input(ctx, x)
    if not is_host(k):
        raise ValueError("TopK (cuda): k must be a host value (it sets the output shape)")
    axis = _router.axis_of(ctx, x.ndim, -1)
    outer, n, inner = _router.split(x.shape, axis)
    count = int_scalar(k)
    if not 0 <= count <= n:
        raise ValueError(f"TopK: k={count} outside 0..{n}")
    shape = tuple(count if i == axis else d for i, d in enumerate(x.shape))
    values = ctx.output(0, shape, x.dtype)
    indices = ctx.output(1, shape, np.int64)
    if count and x.size:
        function("router", f"topk<{ctype(x.dtype)}>", _router.EXPRS)(
            grid_threads(x.size, 128, 1 << 20), (128,),
            (x, values, indices, np.int64(outer), np.int64(n), np.int64(inner), np.int64(count),
             np.int32(int(ctx.node.attrs.get("largest", 1)) != 0)))
    return (values, indices)

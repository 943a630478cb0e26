"""GatherElements (ONNX, default domain): out[..., j, ...] = data[..., index[..., j, ...], ...]
along ``axis`` (default 0); the indices (int32/int64, negative counting from the end) have
data's shape on every other axis; the output has the indices' shape and data's dtype (elements
of 2, 4 or 8 bytes). kernels/router.cu ``gather_elements`` (a copy: batch-invariant). An index
out of range cannot raise on the device: its element gets all bits set (NaN for floats).
Host operands are uploaded once (device_array). Source: ONNX GatherElements-13."""

import numpy as np

from providers.cuda.module import function
from providers.cuda.ops import _router, grid_threads

OP_TYPE = "GatherElements"
DOMAIN = ""


def support_reason(node) -> str | None:
    return _router.copyable(node)



def run(ctx, data, indices):
    data = _router.device(ctx, data, "data", "data")
    idx = _router.device(ctx, indices, "indices", "the indices")
    axis = _router.axis_of(ctx, data.ndim, 0)
    _router.check_lines(ctx, data.shape, idx.shape, axis)
    outer, n, inner = _router.split(data.shape, axis)
    m = int(idx.shape[axis])
    out = ctx.output(0, idx.shape, data.dtype)
    if out.size:
        kern = f"gather_elements<{_router.element_type(ctx, data.dtype)}, {_router.index_type(ctx, idx)}>"
        function("router", kern, _router.EXPRS)(
            grid_threads(out.size, 256, 1 << 20), (256,),
            (data, idx, out, np.int64(outer), np.int64(n), np.int64(m), np.int64(inner)))
    return (out,)

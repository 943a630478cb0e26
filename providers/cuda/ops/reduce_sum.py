"""ReduceSum (ONNX, opset 13+): host data runs on the host (core.executor). On the device, fp16
and fp32 data summed over one axis, or over adjacent axes (the router's sum of its top-k
scores), run kernels/router.cu ``reduce_axis``: one thread per output, an fp32 sum in ascending
index order, rounded once (batch-invariant: the order depends on the reduced length only).
Integer data (the builder's int64 attention mask: exact) and float sums over non-adjacent axes
run ``cupy.sum(..., out=)``, whose order is CuPy's (not batch-invariant; no builder graph
has one). Source: ONNX ReduceSum-13."""

import numpy as np

from core.opdefs import is_host, reduce_axes
from providers.cuda import replay
from providers.cuda.module import ctype, function
from providers.cuda.ops import _router, grid_threads

OP_TYPE = "ReduceSum"
DOMAIN = ""


def run(ctx, data, axes=None):
    if not is_host(axes):
        raise ValueError("ReduceSum (cuda): axes must be a host value")
    keepdims = bool(ctx.node.attrs.get("keepdims", 1))
    red = reduce_axes(ctx.node, axes, data.ndim)
    if red is None:
        import cupy

        out = ctx.output(0, data.shape, data.dtype)
        replay.not_replayable()  # a CuPy copy, not a recorded Kernel launch
        cupy.copyto(out, data)
        return (out,)
    shape = [1 if i in red else d for i, d in enumerate(data.shape) if keepdims or i not in red]
    out = ctx.output(0, shape, data.dtype)
    if data.dtype in (np.float16, np.float32) and red == tuple(range(red[0], red[-1] + 1)):
        x = _router.device(ctx, data, "data", "data")
        outer = int(np.prod(x.shape[:red[0]], dtype=np.int64))
        n = int(np.prod(x.shape[red[0]:red[-1] + 1], dtype=np.int64))
        inner = int(np.prod(x.shape[red[-1] + 1:], dtype=np.int64))
        if out.size:
            function("router", f"reduce_axis<{ctype(x.dtype)}>", _router.EXPRS)(
                grid_threads(out.size, 128, 1 << 20), (128,),
                (x, out, np.int64(outer), np.int64(n), np.int64(inner)))
        return (out,)
    import cupy

    replay.not_replayable()  # a CuPy reduction, not a recorded Kernel launch
    cupy.sum(data, axis=red, keepdims=keepdims, out=out)
    return (out,)

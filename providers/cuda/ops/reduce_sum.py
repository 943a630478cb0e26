"""ReduceSum (ONNX, opset 13+): host data runs on the host (core.executor); device tensors with
cupy.sum(..., out=) (integer sums are exact; the builder only sums the int64 attention mask).
Float sums are not batch-invariant by design here and only run outside the decode path.
Source: ONNX ReduceSum-13."""

from core.opdefs import is_host, reduce_axes

OP_TYPE = "ReduceSum"
DOMAIN = ""
REPLAY = False  # device work through CuPy expressions (providers/cuda/replay.py)


def run(ctx, data, axes=None):
    import cupy

    if not is_host(axes):
        raise ValueError("ReduceSum (cuda): axes must be a host value")
    keepdims = bool(ctx.node.attrs.get("keepdims", 1))
    red = reduce_axes(ctx.node, axes, data.ndim)
    if red is None:
        out = ctx.output(0, data.shape, data.dtype)
        cupy.copyto(out, data)
        return (out,)
    shape = [1 if i in red else d for i, d in enumerate(data.shape) if keepdims or i not in red]
    out = ctx.output(0, shape, data.dtype)
    cupy.sum(data, axis=red, keepdims=keepdims, out=out)
    return (out,)

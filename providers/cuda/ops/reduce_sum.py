"""ReduceSum (ONNX, opset 13+): host data runs on the host (core.executor); device tensors with
cupy.sum(..., out=) (integer sums are exact; the builder only sums the int64 attention mask).
Float sums are not batch-invariant by design here and only run outside the decode path.
Source: ONNX ReduceSum-13."""

from core.opdefs import int_list, is_host, normalize_axis

OP_TYPE = "ReduceSum"
DOMAIN = ""
REPLAY = False  # device work through CuPy expressions (providers/cuda/replay.py)


def run(ctx, data, axes=None):
    import cupy

    if not is_host(axes):
        raise ValueError("ReduceSum (cuda): axes must be a host value")
    attrs = ctx.node.attrs
    keepdims = bool(attrs.get("keepdims", 1))
    axis_list = int_list(axes) if axes is not None else list(attrs.get("axes", []))
    if not axis_list:
        if attrs.get("noop_with_empty_axes", 0):
            out = ctx.output(0, data.shape, data.dtype)
            cupy.copyto(out, data)
            return (out,)
        axis_list = list(range(data.ndim))
    red = tuple(sorted({normalize_axis(a, data.ndim) for a in axis_list}))
    shape = [1 if i in red else d for i, d in enumerate(data.shape) if keepdims or i not in red]
    out = ctx.output(0, shape, data.dtype)
    cupy.sum(data, axis=red, keepdims=keepdims, out=out)
    return (out,)

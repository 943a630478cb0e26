"""Slice (ONNX, default domain, opset 13+): data[starts:ends:steps] along ``axes``, the ONNX
clamping rules of cpu_reference's Slice (core.opdefs.slice_index); starts, ends, axes and
steps must be host values (they set the output shape). Host data runs on the host
(core.executor: the router's shape arithmetic); device data is copied into the output buffer
with ``cupy.copyto`` (a copy: batch-invariant; not replayed). Source: ONNX Slice-13."""

from core.opdefs import is_host, slice_index
from providers.cuda import replay

OP_TYPE = "Slice"
DOMAIN = ""


def run(ctx, data, starts, ends, axes=None, steps=None):
    import cupy

    if not all(map(is_host, (starts, ends, axes, steps))):
        raise ValueError("Slice (cuda): starts, ends, axes and steps must be host values")
    view = data[slice_index(data.shape, starts, ends, axes, steps)]
    out = ctx.output(0, view.shape, data.dtype)
    replay.not_replayable()  # a CuPy copy, not a recorded Kernel launch
    cupy.copyto(out, view)
    return (out,)

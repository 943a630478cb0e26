"""Cast (ONNX): on the device with cupy.copyto(out, x, casting="unsafe"); on the host when x is
a host value (cpu_reference). bfloat16/float8/string/int4 targets are rejected. ONNX Cast-21."""

from onnx import helper

from providers.cpu_reference.ops.cast import supports  # noqa: F401 - same dtype rules
from providers.cuda.ops import host_or_none

OP_TYPE = "Cast"
DOMAIN = ""
REPLAY = False  # device work through CuPy expressions (providers/cuda/replay.py)


def run(ctx, x):
    import cupy

    host = host_or_none(ctx, "cast", (x,))
    if host is not None:
        return host
    y = ctx.output(0, x.shape, helper.tensor_dtype_to_np_dtype(int(ctx.node.attrs["to"])))
    cupy.copyto(y, x, casting="unsafe")
    return (y,)

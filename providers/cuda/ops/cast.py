"""Cast (ONNX): on the device with cupy.copyto(out, x, casting="unsafe"); a host x runs on the
host (core.executor). bfloat16/float8/string/int4 targets are rejected (core.opdefs). ONNX Cast-21."""

from onnx import helper

from core.opdefs import cast_supports as supports  # noqa: F401 - the shared dtype rules

OP_TYPE = "Cast"
DOMAIN = ""
REPLAY = False  # device work through CuPy expressions (providers/cuda/replay.py)


def run(ctx, x):
    import cupy

    y = ctx.output(0, x.shape, helper.tensor_dtype_to_np_dtype(int(ctx.node.attrs["to"])))
    cupy.copyto(y, x, casting="unsafe")
    return (y,)

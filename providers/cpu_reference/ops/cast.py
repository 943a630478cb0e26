"""Cast (ONNX, default domain): Y = X converted to the dtype named by attribute ``to``.

Float -> int truncates toward zero (numpy astype, as ORT). bfloat16, float8 and string targets
are not supported (``supports`` rejects them). Source: ONNX Cast-21.
"""

from onnx import helper

from core.opdefs import cast_supports
from providers.cpu_reference.ops._out import write

OP_TYPE = "Cast"
DOMAIN = ""

supports = cast_supports  # the shared dtype rules (core.opdefs.CAST_UNSUPPORTED)


def run(ctx, x):
    dtype = helper.tensor_dtype_to_np_dtype(int(ctx.node.attrs["to"]))
    return (write(ctx, 0, x, dtype),)

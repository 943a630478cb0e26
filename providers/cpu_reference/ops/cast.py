"""Cast (ONNX, default domain): Y = X converted to the dtype named by attribute ``to``.

Float -> int truncates toward zero (numpy astype, as ORT). bfloat16, float8 and string targets
are not supported (``supports`` rejects them). Source: ONNX Cast-21.
"""

import numpy as np
from onnx import TensorProto, helper

from providers.cpu_reference.ops._out import write

OP_TYPE = "Cast"
DOMAIN = ""

_UNSUPPORTED = {TensorProto.BFLOAT16, TensorProto.STRING, TensorProto.FLOAT8E4M3FN,
                TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ,
                TensorProto.UINT4, TensorProto.INT4}


def supports(node) -> bool:
    return int(node.attrs.get("to", 0)) not in _UNSUPPORTED | {0}


def run(ctx, x):
    dtype = helper.tensor_dtype_to_np_dtype(int(ctx.node.attrs["to"]))
    return (write(ctx, 0, x, dtype),)

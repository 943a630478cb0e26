"""Constant (ONNX, default domain): outputs the tensor given by exactly one attribute.

value (tensor), value_float(s) (fp32), value_int(s) (int64). Sparse and string values are not
supported. Source: ONNX Constant-21.
"""

from core.opdefs import constant_supports, constant_value
from providers.cpu_reference.ops._out import write

OP_TYPE = "Constant"
DOMAIN = ""

supports = constant_supports  # the attribute kinds (core.opdefs.CONSTANT_KINDS)


def run(ctx, *_):
    return (write(ctx, 0, constant_value(ctx.node)),)

"""Constant (ONNX, default domain): outputs the tensor given by exactly one attribute.

value (tensor), value_float(s) (fp32), value_int(s) (int64). Sparse and string values are not
supported. Source: ONNX Constant-21.
"""

import numpy as np

from providers.cpu_reference.ops._out import write

OP_TYPE = "Constant"
DOMAIN = ""

_KINDS = {"value": None, "value_float": np.float32, "value_floats": np.float32,
          "value_int": np.int64, "value_ints": np.int64}


def supports(node) -> bool:
    return len(node.attrs) == 1 and next(iter(node.attrs)) in _KINDS


def run(ctx, *_):
    (name, value), = ctx.node.attrs.items()
    return (write(ctx, 0, np.array(value, dtype=_KINDS[name])),)

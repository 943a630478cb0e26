"""Div (ONNX, default domain): Y = A / B with numpy broadcasting.

Floats: true division (fp16 computed in fp32). Integers: truncation toward zero, as C++
integer division in ORT's CPU kernel (not numpy's floor division). Source: ONNX Div-14.
"""

import numpy as np

from providers.cpu_reference.ops._out import write, write_elementwise

OP_TYPE = "Div"
DOMAIN = ""


def _trunc_div(a, b):
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q)


def run(ctx, a, b):
    if np.asarray(a).dtype.kind in "iu":
        return (write(ctx, 0, _trunc_div(np.asarray(a), np.asarray(b)), np.asarray(a).dtype),)
    return (write_elementwise(ctx, np.divide, a, b),)

"""Sub (ONNX, default domain): Y = A - B with numpy broadcasting.

Any numeric dtype; fp16 computed in fp32 and rounded at the output. Source: ONNX Sub-14.
"""

import numpy as np

from providers.cpu_reference.ops._out import write_elementwise

OP_TYPE = "Sub"
DOMAIN = ""


def run(ctx, a, b):
    return (write_elementwise(ctx, np.subtract, a, b),)

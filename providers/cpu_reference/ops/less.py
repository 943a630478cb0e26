"""Less (ONNX, default domain): bool Y = (A < B) with broadcasting. ONNX Less-13."""

import numpy as np

from providers.cpu_reference.ops._out import write

OP_TYPE = "Less"
DOMAIN = ""


def run(ctx, a, b):
    return (write(ctx, 0, np.less(a, b)),)

"""Equal (ONNX, default domain): bool Y = (A == B) with broadcasting. ONNX Equal-19."""

import numpy as np

from providers.cpu_reference.ops._out import write

OP_TYPE = "Equal"
DOMAIN = ""


def run(ctx, a, b):
    return (write(ctx, 0, np.equal(a, b)),)

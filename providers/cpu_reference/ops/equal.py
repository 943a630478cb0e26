"""Equal (ONNX, default domain): bool Y = (A == B) with broadcasting. ONNX Equal-19."""

import numpy as np

OP_TYPE = "Equal"
DOMAIN = ""


def run(ctx, a, b):
    return (np.equal(a, b),)

"""Neg (ONNX, default domain): Y = -X, signed numeric dtypes. ONNX Neg-13."""

import numpy as np

from providers.cpu_reference.ops._out import write

OP_TYPE = "Neg"
DOMAIN = ""


def run(ctx, x):
    return (write(ctx, 0, np.negative(x)),)

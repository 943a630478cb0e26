"""Neg (ONNX, default domain): Y = -X, signed numeric dtypes. ONNX Neg-13."""

import numpy as np

OP_TYPE = "Neg"
DOMAIN = ""


def run(ctx, x):
    return (np.negative(x),)

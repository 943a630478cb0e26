"""Reciprocal (ONNX, default domain): Y = 1 / X, float dtypes (fp16 computed in fp32; 1/0 = inf).
ONNX Reciprocal-13."""

import numpy as np

from providers.cpu_reference.ops._out import write_elementwise

OP_TYPE = "Reciprocal"
DOMAIN = ""


def run(ctx, x):
    with np.errstate(divide="ignore"):
        return (write_elementwise(ctx, np.reciprocal, x),)

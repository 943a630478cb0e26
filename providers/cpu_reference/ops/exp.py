"""Exp (ONNX, default domain): Y = exp(X), float dtypes (fp16 computed in fp32). ONNX Exp-13."""

import numpy as np

from providers.cpu_reference.ops._out import write_elementwise

OP_TYPE = "Exp"
DOMAIN = ""


def run(ctx, x):
    with np.errstate(over="ignore"):
        return (write_elementwise(ctx, np.exp, x),)

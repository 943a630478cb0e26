"""Sigmoid (ONNX, default domain): Y = 1 / (1 + exp(-X)), float dtypes (fp16 in fp32).

Source: ONNX Sigmoid-13. The builder writes SiLU as Sigmoid followed by Mul (docs/ops.md 0).
"""

import numpy as np

from providers.cpu_reference.ops._out import write_elementwise

OP_TYPE = "Sigmoid"
DOMAIN = ""


def sigmoid(x):
    """1 / (1 + exp(-x)) in x's dtype (fp32 for the kernels), without an overflow warning."""
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def run(ctx, x):
    return (write_elementwise(ctx, sigmoid, x),)

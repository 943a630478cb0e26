"""Sigmoid (ONNX, default domain): Y = 1 / (1 + exp(-X)), float dtypes (fp16 in fp32).

Source: ONNX Sigmoid-13. The builder writes SiLU as Sigmoid followed by Mul (OPS.md 0).
"""

import numpy as np

from providers.cpu_reference.ops._util import elementwise

OP_TYPE = "Sigmoid"
DOMAIN = ""


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def run(ctx, x):
    with np.errstate(over="ignore"):
        return (elementwise(_sigmoid, x),)

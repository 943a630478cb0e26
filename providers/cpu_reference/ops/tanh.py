"""Tanh (ONNX, default domain): Y = tanh(X), float dtypes (fp16 computed in fp32). ONNX Tanh-13."""

import numpy as np

from providers.cpu_reference.ops._util import elementwise

OP_TYPE = "Tanh"
DOMAIN = ""


def run(ctx, x):
    return (elementwise(np.tanh, x),)

"""Tanh (ONNX, default domain): Y = tanh(X), float dtypes (fp16 computed in fp32). ONNX Tanh-13."""

import numpy as np

from providers.cpu_reference.ops._out import write_elementwise

OP_TYPE = "Tanh"
DOMAIN = ""


def run(ctx, x):
    return (write_elementwise(ctx, np.tanh, x),)

"""Sqrt (ONNX, default domain): Y = sqrt(X), float dtypes (fp16 computed in fp32). ONNX Sqrt-13."""

import numpy as np

from providers.cpu_reference.ops._out import write_elementwise

OP_TYPE = "Sqrt"
DOMAIN = ""


def run(ctx, x):
    return (write_elementwise(ctx, np.sqrt, x),)

"""Sqrt (ONNX, default domain): Y = sqrt(X), float dtypes (fp16 computed in fp32). ONNX Sqrt-13."""

import numpy as np

from providers.cpu_reference.ops._util import elementwise

OP_TYPE = "Sqrt"
DOMAIN = ""


def run(ctx, x):
    return (elementwise(np.sqrt, x),)

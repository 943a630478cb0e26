"""Clip (ONNX, default domain): Y = min(max(X, min), max) with the optional scalar ``min`` / ``max``
inputs (absent: unbounded on that side); NaN passes through. ONNX Clip-13."""

import numpy as np

from providers.cpu_reference.ops._out import write

OP_TYPE = "Clip"
DOMAIN = ""


def run(ctx, x, low=None, high=None):
    x = np.asarray(x)
    y = x
    if low is not None:
        y = np.where(y < np.asarray(low, x.dtype), np.asarray(low, x.dtype), y)
    if high is not None:
        y = np.where(y > np.asarray(high, x.dtype), np.asarray(high, x.dtype), y)
    return (write(ctx, 0, y, x.dtype),)

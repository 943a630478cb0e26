"""Pow (ONNX, default domain): Z = X ** Y with broadcasting; Z has X's dtype.

Floats computed in fp32 for fp16 (exponent converted to the compute dtype). Source: ONNX Pow-15.
"""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import compute_dtype

OP_TYPE = "Pow"
DOMAIN = ""


def run(ctx, x, y):
    x = np.asarray(x)
    work = compute_dtype(x.dtype)
    return (write(ctx, 0, np.power(x.astype(work), np.asarray(y).astype(work)), x.dtype),)

"""Range (ONNX, default domain): start, start+delta, ... below ``limit`` (above it for delta < 0).

Length max(ceil((limit - start) / delta), 0); values accumulated by repeated addition in the
input dtype, as ORT's CPU kernel does. Source: ONNX Range-11.
"""

import math

import numpy as np

from providers.cpu_reference.ops._out import buffer

OP_TYPE = "Range"
DOMAIN = ""


def run(ctx, start, limit, delta):
    dtype = np.asarray(start).dtype
    start, limit, delta = (np.asarray(v, dtype=dtype).reshape(()) for v in (start, limit, delta))
    if delta == 0:
        raise ValueError("Range: delta 0")
    n = max(int(math.ceil((float(limit) - float(start)) / float(delta))), 0)
    out = buffer(ctx, 0, (n,), dtype)
    value = start
    for i in range(n):
        out[i] = value
        value = (value + delta).astype(dtype)
    return (out,)

"""Reshape (ONNX, default domain): reshape to the int64 ``shape`` input.

A 0 copies the input dim at that index unless ``allowzero=1`` (then 0 is a real zero dim);
one -1 is inferred. The values are copied into the output buffer (never a view of the input). Source: ONNX Reshape-21.
"""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import int_list

OP_TYPE = "Reshape"
DOMAIN = ""


def run(ctx, data, shape):
    data = np.asarray(data)
    dims = int_list(shape)
    if not ctx.node.attrs.get("allowzero", 0):
        dims = [data.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return (write(ctx, 0, data.reshape(dims)),)

"""Expand (ONNX, default domain): broadcast the input with the int64 ``shape`` input.

Bidirectional numpy broadcasting (a dim of 1 in ``shape`` keeps the input dim), written into
the output buffer. Source: ONNX Expand-13.
"""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import int_list

OP_TYPE = "Expand"
DOMAIN = ""


def run(ctx, x, shape):
    x = np.asarray(x)
    out_shape = np.broadcast_shapes(x.shape, tuple(int_list(shape)))
    return (write(ctx, 0, np.broadcast_to(x, out_shape)),)

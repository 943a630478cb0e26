"""Transpose (ONNX, default domain): permute axes by ``perm`` (default: reversed). ONNX Transpose-21.

Written into the output buffer (never a view of the input).
"""

import numpy as np

from providers.cpu_reference.ops._out import write

OP_TYPE = "Transpose"
DOMAIN = ""


def run(ctx, x):
    perm = ctx.node.attrs.get("perm")
    return (write(ctx, 0, np.transpose(x, None if perm is None else list(perm))),)

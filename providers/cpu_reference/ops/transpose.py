"""Transpose (ONNX, default domain): permute axes by ``perm`` (default: reversed). ONNX Transpose-21.

Returns a contiguous copy (never a view of the input).
"""

import numpy as np

OP_TYPE = "Transpose"
DOMAIN = ""


def run(ctx, x):
    perm = ctx.node.attrs.get("perm")
    return (np.ascontiguousarray(np.transpose(x, None if perm is None else list(perm))),)

"""TopK (ONNX, default domain): the ``k`` largest (``largest=1``, default) or smallest entries
along ``axis`` (default -1) and their int64 indices, in sorted order (``sorted=1``, default; 0
is refused); equal values keep the lower index first, as the ONNX spec and ORT's CPU kernel.
Each slice along ``axis`` is ordered alone (row-invariant). ONNX TopK-11.
"""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import int_scalar, normalize_axis

OP_TYPE = "TopK"
DOMAIN = ""


def supports(node) -> bool:
    return int(node.attrs.get("sorted", 1)) == 1


def run(ctx, x, k):
    x = np.asarray(x)
    attrs = ctx.node.attrs
    axis = normalize_axis(int(attrs.get("axis", -1)), x.ndim)
    count = int_scalar(k)
    if not 0 <= count <= x.shape[axis]:
        raise ValueError(f"TopK: k={count} outside 0..{x.shape[axis]}")
    moved = np.moveaxis(x, axis, -1)
    key = -moved if int(attrs.get("largest", 1)) else moved
    order = np.argsort(key, axis=-1, kind="stable")[..., :count]  # stable: lower index first on ties
    values = np.take_along_axis(moved, order, axis=-1)
    return (write(ctx, 0, np.moveaxis(values, -1, axis)), write(ctx, 1, np.moveaxis(order, -1, axis), np.int64))

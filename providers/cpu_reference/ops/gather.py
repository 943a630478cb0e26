"""Gather (ONNX, default domain): take entries of ``data`` along ``axis`` (default 0) at ``indices``.

Output shape data.shape[:axis] + indices.shape + data.shape[axis+1:]; negative indices count
from the end; an out-of-range index raises IndexError. The builder uses it for the embedding
lookup (docs/ops.md 0). Source: ONNX Gather-13.
"""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import normalize_axis

OP_TYPE = "Gather"
DOMAIN = ""


def run(ctx, data, indices):
    data = np.asarray(data)
    axis = normalize_axis(int(ctx.node.attrs.get("axis", 0)), data.ndim)
    idx = np.asarray(indices).astype(np.int64)
    dim = data.shape[axis]
    if idx.size and (idx.min() < -dim or idx.max() >= dim):
        raise IndexError(f"Gather: index out of range [-{dim}, {dim})")
    return (write(ctx, 0, np.take(data, np.where(idx < 0, idx + dim, idx), axis=axis)),)

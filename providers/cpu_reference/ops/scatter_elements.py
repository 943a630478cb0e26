"""ScatterElements (ONNX, default domain): a copy of ``data`` with out[index[i][j]][j] = updates[i][j]
along ``axis`` (default 0); ``reduction`` only "none" (the default); negative indices count from
the end, out of range raises IndexError; with duplicate indices the last update in C order wins.
ONNX ScatterElements-18."""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import normalize_axis

OP_TYPE = "ScatterElements"
DOMAIN = ""


def supports(node) -> bool:
    return str(node.attrs.get("reduction", "none")) == "none"


def run(ctx, data, indices, updates):
    data = np.asarray(data)
    axis = normalize_axis(int(ctx.node.attrs.get("axis", 0)), data.ndim)
    idx = np.asarray(indices).astype(np.int64)
    dim = data.shape[axis]
    if idx.size and (idx.min() < -dim or idx.max() >= dim):
        raise IndexError(f"ScatterElements: index out of range [-{dim}, {dim})")
    out = data.copy()
    np.put_along_axis(out, np.where(idx < 0, idx + dim, idx), np.asarray(updates, data.dtype), axis=axis)
    return (write(ctx, 0, out),)

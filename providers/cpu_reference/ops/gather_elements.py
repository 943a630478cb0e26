"""GatherElements (ONNX, default domain): out[i][j] = data[index[i][j]][j] along ``axis`` (default
0), for any rank; negative indices count from the end, out of range raises IndexError.
ONNX GatherElements-13."""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import normalize_axis

OP_TYPE = "GatherElements"
DOMAIN = ""


def run(ctx, data, indices):
    data = np.asarray(data)
    axis = normalize_axis(int(ctx.node.attrs.get("axis", 0)), data.ndim)
    idx = np.asarray(indices).astype(np.int64)
    dim = data.shape[axis]
    if idx.size and (idx.min() < -dim or idx.max() >= dim):
        raise IndexError(f"GatherElements: index out of range [-{dim}, {dim})")
    return (write(ctx, 0, np.take_along_axis(data, np.where(idx < 0, idx + dim, idx), axis=axis)),)

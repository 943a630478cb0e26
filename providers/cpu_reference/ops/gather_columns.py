"""lockstep.GatherColumns (core.fusion): Y[..., k] = W[k, indices[...]] for W [K, N], the
builder's tied-embedding lookup Gather(Transpose(W, perm=[1, 0]), indices) read from the
lm_head weight itself.

Output shape indices.shape + [K], W's dtype; negative indices count from the end; an
out-of-range index raises IndexError, as Gather does. A copy, so bitwise the unfused pair.
"""

import numpy as np

from providers.cpu_reference.ops._out import write

OP_TYPE = "GatherColumns"
DOMAIN = "lockstep"


def supports(node) -> bool:
    return len(node.inputs) == 2


def run(ctx, w, indices):
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"GatherColumns: W must be 2-D [K, N], got shape {w.shape}")
    idx = np.asarray(indices).astype(np.int64)
    n = w.shape[1]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"GatherColumns: index out of range [-{n}, {n})")
    cols = np.take(w, np.where(idx < 0, idx + n, idx), axis=1)  # [K, *indices.shape]
    return (write(ctx, 0, np.moveaxis(cols, 0, -1)),)

"""GatherColumns (domain "lockstep", core.fusion): Y[..., k] = W[k, indices[...]], the builder's
tied-embedding lookup Gather(Transpose(W, perm=[1, 0])) read from the lm_head weight W [K, N].

An fp16 W the lm_head's tensor-core kernel reads packed (K <= 2048) is prepared by
:func:`prepare` into that packed form, the same object the lm_head MatMul's hook returns
(``_mma_layout.prepare_dense`` shares it through the prepare pass), so the table is resident once,
in the lm_head's layout, and kernels/gather.cu ``gather_packed_columns`` reads its columns
there. Otherwise ``gather_columns`` reads the raw [K, N] weight. A copy: bitwise the unfused
Transpose + Gather. Negative indices wrap; out-of-range columns are zero (as Gather here).
"""

import numpy as np

from providers.cuda.module import function
from providers.cuda.ops import MAX_GRID_Y, _mma_layout, device_array

OP_TYPE = "GatherColumns"
DOMAIN = "lockstep"
_EXPRS = ("gather_columns<unsigned short>", "gather_columns<unsigned int>", "gather_packed_columns")
_BITS = {np.dtype(np.float16): "unsigned short", np.dtype(np.float32): "unsigned int"}


def supports(node) -> bool:
    dt = node.input_dtypes[0] if node.input_dtypes else None
    return len(node.inputs) == 2 and (dt is None or np.dtype(dt) in _BITS)


def prepare(ctx, w, indices):
    """Plan-time hook (core.ops): an fp16 constant W [K, N] with K <= MAX_K becomes the packed
    lm_head weight (input 0; (K, N) in ctx.cache[_mma_layout.PREPARED])."""
    packed = _mma_layout.prepare_dense(ctx, w, names=(ctx.node.inputs[0],))
    return None if packed is None else {0: packed}


def prepared(node, w, indices):
    """What :func:`prepare` returns, from the inputs' :class:`core.ops.Spec` (core.ops)."""
    spec = _mma_layout.dense_spec(w, names=(node.inputs[0],))
    return None if spec is None else {0: spec}


def run(ctx, w, indices):
    prepared = ctx.cache.get(_mma_layout.PREPARED)
    if prepared is not None:  # w is the packed fp16 weight
        k, n = prepared
    elif w.ndim != 2 or w.dtype not in _BITS:
        raise ValueError(f"GatherColumns (cuda): W must be a 2-D fp16/fp32 [K, N], got {w.dtype}{w.shape}")
    else:
        k, n = w.shape
    idx = device_array(ctx, indices, "indices", np.int64)
    out = ctx.output(0, (*idx.shape, k), w.dtype)
    if idx.size and k:
        grid = (max(1, min(64, -(-k // 256))), min(idx.size, MAX_GRID_Y))
        if prepared is not None:
            kern = function("gather", "gather_packed_columns", _EXPRS)
        else:
            kern = function("gather", f"gather_columns<{_BITS[w.dtype]}>", _EXPRS)
        kern(grid, (256,), (w, idx, out, np.int64(idx.size), np.int32(k), np.int64(n)))
    return (out,)

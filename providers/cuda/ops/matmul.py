"""MatMul (ONNX): Y = A @ W for A [..., K] (fp16/fp32) and a 2-D W [K, N] of the same dtype.

Kernel: kernels/linear.cu ``dense`` (fixed K order per output: chunks of 16 ascending, each
chunk an fmaf chain; batch-invariant for every M); fp16 with K <= 2048: kernels/linear_mma.cu
(tensor cores), its weight packed once at plan time by :func:`prepare`. Both operands on the
host (shape math) run on the host (core.executor). A W of rank > 2 is not supported (the
builder's weights are 2-D).
"""

import numpy as np

from providers.cuda.module import ctype, function
from providers.cuda.ops import NULL, _mma, _mma_layout, row_slices, rows_of
from providers.cuda.ops._linear import config, i32

OP_TYPE = "MatMul"
DOMAIN = ""


def supports(node) -> bool:
    dts = [d for d in node.input_dtypes[:2] if d is not None]
    return all(d in (np.float16, np.float32) for d in dts) and len(set(dts)) <= 1


def _exprs(t: str) -> tuple[str, ...]:
    return tuple(f"dense<{rt}, {t}, {t}>" for rt in (1, 2, 4, 8))


def prepare(ctx, a, w):
    """Plan-time hook (core.ops): an fp16 constant W [K, N] with K <= MAX_K is replaced by its
    tensor-core packed form (``_mma_layout.prepare_dense``; (K, N) in ctx.cache[_mma_layout.PREPARED]), the
    same object a GatherColumns over W receives (the tied embedding reads it too). When N is a
    multiple of 16 the packed form is 3-D and :func:`run` takes N from its leading axis, so a
    row-block page (whole 16-row tiles, providers/cuda/streaming.dense_rows) launches as the
    node of its rows: the kernels' arithmetic per output depends on K alone."""
    packed = _mma_layout.prepare_dense(ctx, w, names=(ctx.node.inputs[1],))
    return None if packed is None else {1: packed}


def prepared(node, a, w):
    """What :func:`prepare` returns, from the inputs' :class:`core.ops.Spec` (core.ops)."""
    spec = _mma_layout.dense_spec(w, names=(node.inputs[1],))
    return None if spec is None else {1: spec}


def run(ctx, a, w):
    prepared = ctx.cache.get(_mma_layout.PREPARED)
    if prepared is not None:  # w is the packed weight
        k, n = prepared
        n = _mma_layout.packed_rows(w) or n  # a row block's rows (core.runtime.rowblocks), else the node's N
        if a.shape[-1] != k or a.dtype != np.float16:
            raise ValueError(f"MatMul (cuda): A {a.dtype}{a.shape} for a packed fp16 weight [{k}, {n}]")
        y = ctx.output(0, (*a.shape[:-1], n), a.dtype)
        if a.size:
            _mma.dense(_mma.contiguous(ctx, a), w, None, y, a.size // k, n, k, NULL, tuning=ctx.provider.tuning)
        return (y,)
    if w.ndim != 2 or a.shape[-1] != w.shape[0] or a.dtype != w.dtype:
        raise ValueError(f"MatMul: unsupported operands {a.dtype}{a.shape} @ {w.dtype}{w.shape} "
                         "(needs A [..., K] and a 2-D W [K, N] of the same float dtype)")
    k, n = w.shape
    m = a.size // k
    y = ctx.output(0, (*a.shape[:-1], n), a.dtype)
    if m == 0:
        return (y,)
    if uses_mma(a, k):
        _mma.dense(a, _mma_layout.unprepared(ctx, w), None, y, m, n, k, NULL, tuning=ctx.provider.tuning)
    else:
        fma(a, w, y, m, n, k)
    return (y,)


def uses_mma(a, k: int) -> bool:
    """True when an [.., K] x [K, N] product of ``a`` runs on the tensor-core kernel."""
    return a.dtype == np.float16 and k <= _mma_layout.MAX_K and a.flags.c_contiguous


def fma(a, w, y, m: int, n: int, k: int) -> None:
    """y = a @ w on kernels/linear.cu ``dense`` (the non-tensor-core path)."""
    t = ctype(a.dtype)
    for r0, r1 in row_slices(m, 8):
        rt, grid, block, shared = config(r1 - r0, n, -(-k // 16))
        kern = function("linear", f"dense<{rt}, {t}, {t}>", _exprs(t))
        kern(grid, block, (rows_of(a, r0, r1, k), w, NULL, rows_of(y, r0, r1, n), i32(r1 - r0), i32(n), i32(k)),
             shared_mem=shared)

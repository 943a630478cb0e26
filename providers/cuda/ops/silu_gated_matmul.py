"""SiluGatedMatMul (domain "lockstep", core.fusion): Y = SiluMul(X @ W_gate, X @ W_up).

X [..., K] and W_gate, W_up [K, N] of one float dtype (graph constants). Where MatMul would
use the tensor-core kernel (fp16, K <= 2048, contiguous X): ONE GEMM over the gate and up
weights interleaved in groups of 8 features (``_mma_layout.glu_rows``; packed once at plan time by
:func:`prepare`) with the SiluMul in its epilogue (kernels/linear_mma.cu, GLU). Each output's
K order is the unfused MatMul's, and the epilogue rounds as MatMul and SiluMul do, so the
result is bitwise the unfused MatMul, MatMul, SiluMul of this provider. Otherwise those three
kernels run in turn.
"""

import numpy as np

from providers.cuda.ops import NULL, _mma, _mma_layout, is_host, matmul, silu_mul

OP_TYPE = "SiluGatedMatMul"
DOMAIN = "lockstep"


def supports(node) -> bool:
    dts = [d for d in node.input_dtypes[:3] if d is not None]
    return len(node.inputs) == 3 and all(d in (np.float16, np.float32) for d in dts) and len(set(dts)) <= 1


def prepare(ctx, x, w_gate, w_up):
    """Plan-time hook (core.ops): fp16 constants W_gate, W_up [K, N] with K <= MAX_K become one
    packed, interleaved weight (input 1; ``_mma_layout.prepare_dense``) and input 2 is dropped.
    When N is a multiple of 16 the packed pair is 3-D (2 N interleaved rows) and :func:`run`
    takes N from its leading axis: a row-block page (providers/cuda/streaming.dense_rows)
    launches as the node of its features."""
    packed = _mma_layout.prepare_dense(ctx, w_gate, w_up, names=ctx.node.inputs[1:3]) if w_up is not None else None
    return None if packed is None else {1: packed, 2: None}


def prepared(node, x, w_gate, w_up):
    """What :func:`prepare` returns, from the inputs' :class:`core.ops.Spec` (core.ops)."""
    spec = None if w_up is None else _mma_layout.dense_spec(w_gate, w_up, names=tuple(node.inputs[1:3]))
    return None if spec is None else {1: spec, 2: None}


def run(ctx, x, w_gate, w_up):
    prepared = ctx.cache.get(_mma_layout.PREPARED)
    if prepared is not None:  # w_gate is the packed gate/up pair, w_up None
        k, n = prepared
        n = _mma_layout.packed_rows(w_gate, glu=True) or n  # a row block's features, else the node's N
        if is_host(x) or x.shape[-1] != k or x.dtype != np.float16:
            raise ValueError(f"SiluGatedMatMul (cuda): X {getattr(x, 'shape', x)} for packed fp16 weights "
                             f"[{k}, {n}]")
        y = ctx.output(0, (*x.shape[:-1], n), x.dtype)
        if x.size:
            _mma.dense(_mma.contiguous(ctx, x), w_gate, None, y, x.size // k, n, k, NULL, glu=True,
                       tuning=ctx.provider.tuning)
        return (y,)
    if (is_host(x) or is_host(w_gate) or is_host(w_up) or w_gate.ndim != 2 or w_up.shape != w_gate.shape
            or x.shape[-1] != w_gate.shape[0] or not x.dtype == w_gate.dtype == w_up.dtype):
        raise ValueError(f"SiluGatedMatMul (cuda): needs device X [..., K] and W_gate, W_up [K, N] of one "
                         f"dtype, got {getattr(x, 'shape', x)}, {getattr(w_gate, 'shape', w_gate)}, "
                         f"{getattr(w_up, 'shape', w_up)}")
    k, n = w_gate.shape
    m = x.size // k
    y = ctx.output(0, (*x.shape[:-1], n), x.dtype)
    if m == 0:
        return (y,)
    if matmul.uses_mma(x, k):
        _mma.dense(x, _mma_layout.unprepared(ctx, w_gate, w_up), None, y, m, n, k, NULL, glu=True,
                   tuning=ctx.provider.tuning)
        return (y,)
    gate, up = ctx.output("gate", y.shape, x.dtype), ctx.output("up", y.shape, x.dtype)
    matmul.fma(x, w_gate, gate, m, n, k)
    matmul.fma(x, w_up, up, m, n, k)
    silu_mul.launch(gate, up, y)
    return (y,)

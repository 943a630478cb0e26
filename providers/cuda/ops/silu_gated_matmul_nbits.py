"""SiluGatedMatMulNBits (domain "lockstep", core.fusion): Y = SiluMul(MatMulNBits(X, gate),
MatMulNBits(X, up)) with the MatMulNBits attributes shared by both projections (docs/ops.md 2).

Inputs: X, B_gate, scales_gate, zero_points_gate (or absent), B_up, scales_up, zero_points_up
(graph constants of equal shapes and dtypes). Where MatMulNBits would use the tensor-core
int4 kernel: ONE launch over the gate and up rows interleaved in groups of 8 features
(``_mma_layout.glu_rows``; codes, scales and zero points interleaved and packed (``_mma_layout.pack_int4``)
once at plan time by :func:`prepare`) with the SiluMul in its epilogue, bitwise the unfused MatMulNBits,
MatMulNBits, SiluMul of this provider. Otherwise those three kernels run in turn.
"""

import numpy as np

from core.opdefs import gate_view
from core.ops import Spec
from providers.cuda.ops import NULL, _mma, _mma_layout, array_module, matmul_nbits, silu_mul

OP_TYPE = "SiluGatedMatMulNBits"
DOMAIN = "lockstep"
#: ctx.cache key of a prepared node: (K, N, block_size).
PREPARED = "glu_prepared"


def supports(node) -> bool:
    """The configurations MatMulNBits accepts (both projections share the attributes)."""
    return len(node.inputs) == 7 and matmul_nbits.supports(gate_view(node))


def interleave(xp, n: int, pairs) -> list:
    """Each (gate, up) pair of ``pairs`` (arrays of N rows, or (None, None)) as one array of
    glu_width(N) rows in glu_rows order (``_mma_layout.glu_interleave``); None for an absent pair."""
    return [None if g is None else _mma_layout.glu_interleave(xp, g.reshape(n, -1), u.reshape(n, -1))
            for g, u in pairs]


def _check_pair(b_gate, scales_gate, zp_gate, b_up, scales_up, zp_up) -> None:
    if (b_gate.shape != b_up.shape or scales_gate.shape != scales_up.shape or scales_gate.dtype != scales_up.dtype
            or (zp_gate is None) != (zp_up is None)
            or (zp_gate is not None and (zp_gate.shape != zp_up.shape or zp_gate.dtype != zp_up.dtype))):
        raise ValueError("SiluGatedMatMulNBits: the gate and up weights differ in shape or dtype")


def prepare(ctx, x, b_gate, scales_gate, zp_gate, b_up, scales_up, zp_up):
    """Plan-time hook (core.ops). Where the fused tensor-core launch applies to every call
    (fp16 X, as declared or else as the scales' dtype, which ORT's schema gives A too; the
    static conditions of ``matmul_nbits.mma_config``), inputs 1..3 become the interleaved
    codes, scales and zero points (:func:`interleave`), inputs 4..6 are dropped and
    ctx.cache[PREPARED] = (K, N, block_size). Returns None (nothing
    prepared) for fed weights or a configuration ``run`` would reject."""
    weights = (b_gate, scales_gate, zp_gate, b_up, scales_up, zp_up)
    shape = _packable(ctx.node, weights)
    if shape is None:
        return None
    k, n, bs = shape
    try:
        w = packed(array_module(b_gate), n, k, bs, weights)
    except ValueError:
        return None  # zero points of another size: run() raises it
    ctx.cache[PREPARED] = (k, n, bs)
    return _changes(w)


def prepared(node, x, b_gate, scales_gate, zp_gate, b_up, scales_up, zp_up):
    """What :func:`prepare` returns, from the inputs' :class:`core.ops.Spec` (core.ops): the
    interleaved pair's packed Specs (a form of the node's own)."""
    shape = _packable(node, (b_gate, scales_gate, zp_gate, b_up, scales_up, zp_up))
    if shape is None:
        return None
    k, n, bs = shape
    rows = _mma_layout.glu_width(n)
    zp = None if zp_gate is None else Spec((rows, zp_gate.size // n), zp_gate.dtype)
    try:
        return _changes(_mma_layout.int4_specs(scales_gate.dtype, zp, rows, k, bs))
    except ValueError:
        return None


def _changes(w) -> dict:
    """Inputs 1..3 become the packed pair (zero points when present), inputs 4..6 are dropped."""
    changes = {1: w.codes, 2: w.scales, 4: None, 5: None}
    if w.zq is not None:
        changes.update({3: w.zq, 6: None})
    return changes


def _packable(node, weights) -> tuple[int, int, int] | None:
    """(K, N, block_size) when :func:`prepare` packs the pair ``weights`` (arrays or Specs),
    else None."""
    if any(name and w is None for name, w in zip(node.inputs[1:7], weights)):
        return None
    scales_gate, zp_gate = weights[1], weights[2]
    dtype = node.input_dtypes[0] if node.input_dtypes else None
    if (scales_gate.dtype if dtype is None else dtype) != np.float16:  # A and scales share T1 (ORT schema)
        return None
    try:
        k, n, bits, bs, nb = matmul_nbits.geometry(node.attrs, None, weights[0], scales_gate)
        _check_pair(*weights)
        _, zp_mode, _ = matmul_nbits.zero_point_mode(zp_gate, np.dtype(np.float16), n, nb)
    except ValueError:
        return None  # run() raises it on the raw inputs
    return (k, n, bs) if matmul_nbits.mma_config(np.dtype(np.float16), bits, k, bs, zp_mode) else None


def packed(xp, n: int, k: int, bs: int, weights) -> "_mma_layout.Int4Weights":
    """The raw (gate codes, scales, zero points, up codes, scales, zero points) interleaved
    (:func:`interleave`) and packed (``_mma_layout.pack_int4``) as one weight of glu_width(N) rows."""
    b_gate, scales_gate, zp_gate, b_up, scales_up, zp_up = weights
    b, s, z = interleave(xp, n, ((b_gate, b_up), (scales_gate, scales_up), (zp_gate, zp_up)))
    return _mma_layout.pack_int4(xp, b, s, z, _mma_layout.glu_width(n), k, bs)


def _unprepared(ctx, n: int, k: int, bs: int, weights) -> "_mma_layout.Int4Weights":
    """:func:`packed` of raw weights passed to the kernel (``_mma_layout.per_call``)."""
    return _mma_layout.per_call(ctx, "glu_unprepared", tuple(weights),
                         lambda: packed(array_module(weights[0]), n, k, bs, weights))


def run(ctx, x, b_gate, scales_gate, zp_gate, b_up, scales_up, zp_up):
    prepared = ctx.cache.get(PREPARED)
    if prepared is not None:  # inputs 1..3 the packed gate/up pair (zq None when absent), 4..6 None
        k, _, bs = prepared
        n = int(ctx.node.attrs["N"])  # a row block's features (core.runtime.rowblocks), else the node's N
        if x.shape[-1] != k or x.dtype != np.float16:
            raise ValueError(f"SiluGatedMatMulNBits (cuda): X {x.dtype}{x.shape} for prepared fp16 weights, K={k}")
        y = ctx.output(0, (*x.shape[:-1], n), x.dtype)
        if x.size:
            w = _mma_layout.Int4Weights(b_gate, scales_gate, zp_gate, _mma_layout.glu_width(n), k, bs)
            _mma.nbits4(_mma.contiguous(ctx, x), w, None, y, x.size // k, NULL, glu_out=n, tuning=ctx.provider.tuning)
        return (y,)
    attrs = ctx.node.attrs
    k, n, bits, bs, nb = matmul_nbits.geometry(attrs, x, b_gate, scales_gate)
    _check_pair(b_gate, scales_gate, zp_gate, b_up, scales_up, zp_up)
    _, zp_mode, _ = matmul_nbits.zero_point_mode(zp_gate, x.dtype, n, nb)
    y = ctx.output(0, (*x.shape[:-1], n), x.dtype)
    m = x.size // k
    if m == 0:
        return (y,)
    if matmul_nbits.mma_config(x.dtype, bits, k, bs, zp_mode):  # a strided X is copied, as when prepared
        w = _unprepared(ctx, n, k, bs, (b_gate, scales_gate, zp_gate, b_up, scales_up, zp_up))
        _mma.nbits4(_mma.contiguous(ctx, x), w, None, y, m, NULL, glu_out=n, tuning=ctx.provider.tuning)
        return (y,)
    gate, up = ctx.output("gate", y.shape, x.dtype), ctx.output("up", y.shape, x.dtype)
    matmul_nbits.launch(ctx, attrs, x, b_gate, scales_gate, zp_gate, None, gate)
    matmul_nbits.launch(ctx, attrs, x, b_up, scales_up, zp_up, None, up)
    silu_mul.launch(gate, up, y)
    return (y,)

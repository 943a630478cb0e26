"""MatMulNBits (com.microsoft), docs/ops.md 2: Y = A @ dequant(B)^T (+ bias).

A [..., K] fp16/fp32; B uint8 [N, n_blocks, blob]; scales fp16/fp32 [N, n_blocks] (or flat);
zero_points absent (2^(bits-1)), packed uint8 [N, ceil(n_blocks*bits/8)] or float [N, n_blocks];
bits 2/4/8, block_size a power of two >= 16; g_idx and prepacked weights are rejected.
Kernels: kernels/linear_mma.cu ``mma_nbits4`` / ``mma_wide4`` (tensor cores, :func:`mma_config`:
per 32-wide k group the exact products (q - z) x summed by two mmas, then scaled by one fmaf
into the accumulator; the weights packed once at plan time by :func:`prepare`, in the layout
``_mma_layout.pack_int4`` defines), else kernels/linear.cu ``nbits`` (dequantisation in registers; K
order fixed per (K, block_size): one fmaf chain per quantisation block, blocks folded in
ascending order). Which one a node takes is fixed by its attributes and dtypes, never by M.
"""

import numpy as np

from core.opdefs import matmul_nbits_supports
from providers.cuda.module import ctype, function
from providers.cuda.ops import NULL, _mma, _mma_layout, row_slices, rows_of
from providers.cuda.ops._linear import config, i32

OP_TYPE = "MatMulNBits"
DOMAIN = "com.microsoft"


def supports(node) -> bool:
    """The configurations of core.opdefs.matmul_nbits_supports, with fp16 or fp32 activations."""
    dt = node.input_dtypes[0] if node.input_dtypes else None
    return matmul_nbits_supports(node) and (dt is None or dt in (np.float16, np.float32))


def _exprs(t: str, s: str) -> tuple[str, ...]:
    return tuple(f"nbits<{rt}, {t}, {s}>" for rt in (1, 2, 4, 8))


def run(ctx, a, b, scales, zero_points=None, g_idx=None, bias=None):
    if g_idx is not None:
        raise ValueError("MatMulNBits: g_idx is not supported")
    y = ctx.output(0, (*a.shape[:-1], int(ctx.node.attrs["N"])), a.dtype)
    prepared = ctx.cache.get(_mma_layout.INT4_PREPARED)
    if prepared is not None:  # b, scales, zero_points: the packed weights (_mma_layout.Int4Weights)
        k, _, bs = prepared
        n = int(ctx.node.attrs["N"])  # a row block's rows (core.runtime.rowblocks), else the node's N
        if a.shape[-1] != k or a.dtype != np.float16:
            raise ValueError(f"MatMulNBits (cuda): A {a.dtype}{a.shape} for prepared fp16 weights, K={k}")
        if bias is not None and bias.dtype != a.dtype:
            raise ValueError("MatMulNBits: bias dtype must match A")
        if a.size:
            w = _mma_layout.Int4Weights(b, scales, zero_points, n, k, bs)
            _mma.nbits4(_mma.contiguous(ctx, a), w, bias, y, a.size // k, NULL, tuning=ctx.provider.tuning)
        return (y,)
    launch(ctx, ctx.node.attrs, a, b, scales, zero_points, bias, y)
    return (y,)


def prepare(ctx, a, b, scales, zero_points=None, g_idx=None, bias=None):
    """Plan-time hook (core.ops): where the tensor-core kernel applies to every call (fp16 A,
    as declared or else as the scales' dtype, which ORT's schema gives A too; the static
    conditions of :func:`mma_config`), inputs 1..3 become the packed codes, scales and zero
    points (``_mma_layout.prepare_int4``, shared with the tied embedding's lookup) and
    ctx.cache[_mma_layout.INT4_PREPARED] = (K, N, block_size). None (nothing prepared) for fed weights or a
    configuration ``run`` would reject."""
    shape = _packable(ctx.node, b, scales, zero_points)
    if shape is None:
        return None
    k, n, bs = shape
    names = tuple((list(ctx.node.inputs) + [""] * 3)[1:4])
    try:
        w = _mma_layout.prepare_int4(ctx, b, scales, zero_points, n, k, bs, names)
    except ValueError:
        return None  # zero points of another size: run() raises it
    ctx.cache[_mma_layout.INT4_PREPARED] = (k, n, bs)
    return _changes(w)


def prepared(node, a, b, scales, zero_points=None, g_idx=None, bias=None):
    """What :func:`prepare` returns, from the inputs' :class:`core.ops.Spec` (core.ops)."""
    shape = _packable(node, b, scales, zero_points)
    if shape is None:
        return None
    k, n, bs = shape
    try:
        w = _mma_layout.int4_form(tuple((list(node.inputs) + [""] * 3)[1:4]), (b, scales, zero_points), n, k, bs)
    except ValueError:
        return None
    return _changes(w)


def _changes(w) -> dict:
    """The inputs a packed weight replaces: codes, scales and (when present) zero points."""
    changes = {1: w.codes, 2: w.scales}
    if w.zq is not None:
        changes[3] = w.zq
    return changes


def _packable(node, b, scales, zero_points) -> tuple[int, int, int] | None:
    """(K, N, block_size) when :func:`prepare` packs the node's weights (arrays or Specs),
    else None."""
    names = list(node.inputs) + [""] * 6
    if b is None or scales is None or (names[3] and zero_points is None) or names[4]:
        return None
    dtype = node.input_dtypes[0] if node.input_dtypes else None
    if (scales.dtype if dtype is None else dtype) != np.float16:
        return None
    try:
        k, n, bits, bs, nb = geometry(node.attrs, None, b, scales)
        _, zp_mode, _ = zero_point_mode(zero_points, np.dtype(np.float16), n, nb)
    except ValueError:
        return None  # run() raises it on the raw inputs
    return (k, n, bs) if mma_config(np.dtype(np.float16), bits, k, bs, zp_mode) else None


def zero_point_mode(zero_points, a_dtype, n: int, nb: int):
    """(array or NULL, mode, row stride) of the kernels: mode 0 none (2^(bits-1)), 1 packed
    uint8 rows, 2 float per block.

    Raises:
        ValueError: another layout or dtype.
    """
    if zero_points is None:
        return NULL, 0, 0
    if zero_points.dtype == np.uint8:
        return zero_points, 1, zero_points.size // n
    if zero_points.dtype == a_dtype and zero_points.size == n * nb:
        return zero_points, 2, nb
    raise ValueError(f"MatMulNBits: zero_points {zero_points.dtype}{zero_points.shape} unsupported")


def mma_config(a_dtype, bits: int, k: int, bs: int, zp_mode: int) -> bool:
    """Whether the product runs on the tensor-core int4 kernel (a strided A is copied first):
    fp16 A, 4 bits, K a multiple of 16 and at most MAX_K, and a layout the kernels compute
    (``_mma_layout.int4_layout_applies``: block_size at least 32, zero points absent or packed). Float
    zero points and smaller blocks take the CUDA-core kernel."""
    return (a_dtype == np.float16 and bits == 4 and k % 16 == 0 and k <= _mma_layout.MAX_K
            and _mma_layout.int4_layout_applies(bs, zp_mode))


def geometry(attrs: dict, a, b, scales) -> tuple[int, int, int, int, int]:
    """(K, N, bits, block_size, n_blocks) of the attributes, checked against A (unless None),
    B and scales.

    Raises:
        ValueError: A's last dim is not K, or B / scales do not match N, K, bits, block_size.
    """
    k, n = int(attrs["K"]), int(attrs["N"])
    bits, bs = int(attrs.get("bits", 4)), int(attrs["block_size"])
    nb = -(-k // bs)
    blob = bs * bits // 8
    if a is not None and a.shape[-1] != k:
        raise ValueError(f"MatMulNBits: A last dim {a.shape[-1]} != K {k}")
    if b.size != n * nb * blob or scales.size != n * nb:
        raise ValueError(f"MatMulNBits: B {b.shape} / scales {scales.shape} do not match "
                         f"N={n}, n_blocks={nb}, blob={blob}")
    return k, n, bits, bs, nb


def launch(ctx, attrs: dict, a, b, scales, zero_points, bias, y) -> None:
    """y = a @ dequant(b)^T (+ bias) into ``y`` [..., N] (checks as in the module docstring),
    for raw MatMulNBits weights; on the tensor-core kernel they are packed first
    (``_mma_layout.unprepared_int4``, kept in ``ctx``'s cache while the same weights come back) and a
    strided A is copied, as the prepared path does, so both compute alike.

    Raises:
        ValueError: shapes that do not match the attributes (:func:`geometry`), or unsupported
            zero points / bias.
    """
    k, n, bits, bs, nb = geometry(attrs, a, b, scales)
    zp, zp_mode, zp_stride = zero_point_mode(zero_points, a.dtype, n, nb)
    if bias is not None and bias.dtype != a.dtype:
        raise ValueError("MatMulNBits: bias dtype must match A")
    m = a.size // k
    if m == 0:
        return
    t, s = ctype(a.dtype), ctype(scales.dtype)
    if mma_config(a.dtype, bits, k, bs, zp_mode):
        w = _mma_layout.unprepared_int4(ctx, b, scales, zero_points, n, k, bs)
        _mma.nbits4(_mma.contiguous(ctx, a), w, bias, y, m, NULL, tuning=ctx.provider.tuning)
        return
    for r0, r1 in row_slices(m, 8):
        rt, grid, block, shared = config(r1 - r0, n, nb)
        kern = function("linear", f"nbits<{rt}, {t}, {s}>", _exprs(t, s))
        kern(grid, block, (rows_of(a, r0, r1, k), b, scales, zp, i32(zp_mode), i32(zp_stride),
                           NULL if bias is None else bias, rows_of(y, r0, r1, n), i32(r1 - r0), i32(n), i32(k),
                           i32(bits), i32(bs)),
             shared_mem=shared)

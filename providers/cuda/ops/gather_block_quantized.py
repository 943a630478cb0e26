"""GatherBlockQuantized (com.microsoft), docs/ops.md 5: dequantized rows of a block-quantized
matrix (tied int4 embeddings). data uint8 [V, D*bits/8]; indices int32/int64 (device);
scales [V, D/bs] fp16/fp32; zero_points optional packed uint8. gather_axis 0, quantize_axis
last, bits 4/8. Kernel: kernels/gather.cu ``gather_block_quantized`` (fp32 math).

A 4-bit table in the layout of the int4 tensor-core kernels (fp16 scales, block_size >= 32,
D a multiple of 16 and at most ``_mma_layout.MAX_K``, zero points absent or packed) is prepared by
:func:`prepare` into that packed form (``_mma_layout.prepare_int4``): for the builder's tied
embedding it is the same object the lm_head MatMulNBits's hook returns, so the table is
resident once, and ``gather_packed_int4`` reads its rows there, with the same arithmetic.
"""

import numpy as np

from core.opdefs import gather_block_quantized_supports as supports  # noqa: F401
from providers.cuda.module import ctype, function
from providers.cuda.ops import MAX_GRID_Y, NULL, _mma_layout, device_array

OP_TYPE = "GatherBlockQuantized"
DOMAIN = "com.microsoft"
_EXPRS = ("gather_block_quantized<__half>", "gather_block_quantized<float>",
          "gather_packed_int4<__half>", "gather_packed_int4<float>")
#: ctx.cache key of a prepared node: (V, D, block_size) of the raw table.
PREPARED = "gather_int4_prepared"


def _geometry(attrs: dict, data, scales) -> tuple[int, int, int, int, int]:
    """(bits, block_size, V, D, n_blocks) of a raw table.

    Raises:
        ValueError: data not 2-D uint8, or scales of another size."""
    bits, bs = int(attrs.get("bits", 4)), int(attrs.get("block_size", 128))
    if data.ndim != 2 or data.dtype != np.uint8:
        raise ValueError(f"GatherBlockQuantized: data must be 2-D uint8, got {data.dtype}{data.shape}")
    v, d = data.shape[0], data.shape[1] * 8 // bits
    nb = -(-d // bs)
    if scales.size != v * nb:
        raise ValueError(f"GatherBlockQuantized: scales shape {scales.shape}, expected {(v, nb)}")
    return bits, bs, v, d, nb


def prepare(ctx, data, indices, scales, zero_points=None):
    """Plan-time hook (core.ops): a constant 4-bit table the int4 tensor-core kernels could read
    (module docstring) becomes their packed form (inputs 0, 2, 3; ``_mma_layout.prepare_int4``, shared
    with the tied lm_head), with (V, D, block_size) in ctx.cache[PREPARED]. Else None."""
    shape = _packable(ctx.node, data, scales, zero_points)
    if shape is None:
        return None
    v, d, bs = shape
    names = list(ctx.node.inputs) + [""] * 4
    try:
        w = _mma_layout.prepare_int4(ctx, data, scales, zero_points, v, d, bs, (names[0], names[2], names[3]))
    except ValueError:
        return None
    ctx.cache[PREPARED] = (v, d, bs)
    return _changes(w)


def prepared(node, data, indices, scales, zero_points=None):
    """What :func:`prepare` returns, from the inputs' :class:`core.ops.Spec` (core.ops)."""
    shape = _packable(node, data, scales, zero_points)
    if shape is None:
        return None
    v, d, bs = shape
    names = list(node.inputs) + [""] * 4
    try:
        return _changes(_mma_layout.int4_form((names[0], names[2], names[3]), (data, scales, zero_points), v, d, bs))
    except ValueError:
        return None


def _changes(w) -> dict:
    changes = {0: w.codes, 2: w.scales}
    if w.zq is not None:
        changes[3] = w.zq
    return changes


def _packable(node, data, scales, zero_points) -> tuple[int, int, int] | None:
    """(V, D, block_size) when :func:`prepare` packs the table (arrays or Specs), else None."""
    names = list(node.inputs) + [""] * 4
    if data is None or scales is None or (names[3] and zero_points is None) or scales.dtype != np.float16:
        return None
    try:
        bits, bs, v, d, nb = _geometry(node.attrs, data, scales)
    except ValueError:
        return None  # run() raises it
    zp_mode = 0 if zero_points is None else 1 if zero_points.dtype == np.uint8 else 2
    if (bits != 4 or d % 16 or d > _mma_layout.MAX_K or not _mma_layout.int4_layout_applies(bs, zp_mode)
            or (zero_points is not None and zero_points.size != v * -(-nb // 2))):
        return None
    return v, d, bs


def run(ctx, data, indices, scales, zero_points=None):
    prepared = ctx.cache.get(PREPARED)
    if prepared is not None:  # data, scales, zero_points: the packed table (_mma_layout.Int4Weights)
        v, d, bs = prepared
    else:
        bits, bs, v, d, nb = _geometry(ctx.node.attrs, data, scales)
    idx = device_array(ctx, indices, "indices", np.int64)
    out = ctx.output(0, (*idx.shape, d), scales.dtype)
    if idx.size:
        grid = (max(1, -(-d // 256)), min(idx.size, MAX_GRID_Y))
        zp = NULL if zero_points is None else zero_points
        if prepared is not None:
            kern = function("gather", f"gather_packed_int4<{ctype(scales.dtype)}>", _EXPRS)
            blocks = np.int32(_mma_layout.int4_blocks(d, bs))
            kern(grid, (256,), (data, idx, scales, zp, out, np.int64(v), np.int32(d), blocks,
                                np.int32(bs.bit_length() - 1), np.int64(idx.size)))
        else:
            kern = function("gather", f"gather_block_quantized<{ctype(scales.dtype)}>", _EXPRS)
            zp_bytes = 0 if zero_points is None else zero_points.size // v
            kern(grid, (256,), (data, idx, scales, zp, out, np.int64(v), np.int32(d), np.int32(bits), np.int32(bs),
                                np.int32(data.shape[1]), np.int32(zp_bytes), np.int64(idx.size)))
    return (out,)

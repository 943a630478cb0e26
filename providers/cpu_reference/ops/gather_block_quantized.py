"""GatherBlockQuantized (com.microsoft): gather rows of a block-quantized matrix, dequantized (docs/ops.md 5).

Inputs: data uint8 [V, D*bits/8] (codes LSB-first along the last axis); indices (int32/int64,
any shape); scales [V, D/block_size] (fp32/fp16); zero_points optional uint8, packed the same
way, [V, ceil(n_blocks*bits/8)].
Attributes: bits (4 or 8, default 4), block_size (default 128), gather_axis (only 0),
quantize_axis (only the last axis, 1).
out[..., d] = (q(row, d) - zp(row, d div bs)) * scale(row, d div bs), zp = 2^(bits-1) when
absent; output shape indices.shape + [D], dtype of scales (computed in fp32). Out-of-range
indices give zero rows (ORT 1.32 schema). Source: ORT contrib_ops/cpu/quantization/
gather_block_quantized.cc; BASE make_embedding.
"""

import numpy as np

from core.opdefs import gather_block_quantized_supports
from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._quant import unpack

OP_TYPE = "GatherBlockQuantized"
DOMAIN = "com.microsoft"

supports = gather_block_quantized_supports  # the configurations above (core.opdefs)


def run(ctx, data, indices, scales, zero_points=None):
    attrs = ctx.node.attrs
    bits, bs = int(attrs.get("bits", 4)), int(attrs.get("block_size", 128))
    data, scales = np.asarray(data), np.asarray(scales)
    if data.ndim != 2 or data.dtype != np.uint8:
        raise ValueError(f"GatherBlockQuantized: data must be 2-D uint8, got {data.dtype}{data.shape}")
    v, d = data.shape[0], data.shape[1] * 8 // bits
    n_blocks = -(-d // bs)
    if scales.shape != (v, n_blocks):
        raise ValueError(f"GatherBlockQuantized: scales shape {scales.shape}, expected {(v, n_blocks)}")
    idx = np.asarray(indices).astype(np.int64)
    idx = np.where(idx < 0, idx + v, idx)
    valid = (idx >= 0) & (idx < v)
    rows = np.where(valid, idx, 0).reshape(-1)
    codes = unpack(data[rows], bits, d).astype(np.float32)
    if zero_points is None:
        zp = np.full((rows.size, n_blocks), float(1 << (bits - 1)), np.float32)
    else:
        zp = unpack(np.asarray(zero_points)[rows], bits, n_blocks).astype(np.float32)
    block = np.arange(d) // bs
    out = (codes - zp[:, block]) * scales[rows].astype(np.float32)[:, block]
    out = np.where(valid.reshape(-1, 1), out, 0.0).reshape(*idx.shape, d)
    return (write(ctx, 0, out, scales.dtype),)

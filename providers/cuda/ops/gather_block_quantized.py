"""GatherBlockQuantized (com.microsoft), docs/ops.md 5: dequantized rows of a block-quantized
matrix (tied int4 embeddings). data uint8 [V, D*bits/8]; indices int32/int64 (device);
scales [V, D/bs] fp16/fp32; zero_points optional packed uint8. gather_axis 0, quantize_axis
last, bits 4/8. Kernel: kernels/gather.cu ``gather_block_quantized`` (fp32 math)."""

import numpy as np

from core.opdefs import gather_block_quantized_supports as supports  # noqa: F401
from providers.cuda.module import ctype, function
from providers.cuda.ops import MAX_GRID_Y, NULL, device_array

OP_TYPE = "GatherBlockQuantized"
DOMAIN = "com.microsoft"
_EXPRS = ("gather_block_quantized<__half>", "gather_block_quantized<float>")


def run(ctx, data, indices, scales, zero_points=None):
    attrs = ctx.node.attrs
    bits, bs = int(attrs.get("bits", 4)), int(attrs.get("block_size", 128))
    if data.ndim != 2 or data.dtype != np.uint8:
        raise ValueError(f"GatherBlockQuantized: data must be 2-D uint8, got {data.dtype}{data.shape}")
    v, d = data.shape[0], data.shape[1] * 8 // bits
    nb = -(-d // bs)
    if scales.size != v * nb:
        raise ValueError(f"GatherBlockQuantized: scales shape {scales.shape}, expected {(v, nb)}")
    idx = device_array(ctx, indices, "indices", np.int64)
    out = ctx.output(0, (*idx.shape, d), scales.dtype)
    if idx.size:
        kern = function("gather", f"gather_block_quantized<{ctype(scales.dtype)}>", _EXPRS)
        zp_bytes = 0 if zero_points is None else zero_points.size // v
        kern((max(1, -(-d // 256)), min(idx.size, MAX_GRID_Y)), (256,),
             (data, idx, scales, NULL if zero_points is None else zero_points, out, np.int64(v),
              np.int32(d), np.int32(bits), np.int32(bs), np.int32(data.shape[1]), np.int32(zp_bytes),
              np.int64(idx.size)))
    return (out,)

"""RotaryEmbedding (com.microsoft v1): rotary position embedding of one tensor (docs/ops.md 4).

Inputs: input 3-D [B, S, hidden] (heads contiguous) or 4-D [B, N, S, H]; position_ids int64
[B, S] or one element (base: pos = base + s); cos_cache, sin_cache [max_pos, rotary_dim/2].
Attributes: interleaved, rotary_embedding_dim (0 = full head), num_heads (0 = infer),
scale (no effect), is_packed_batching (1 is rejected).
Head size: 4-D: shape[3]; 3-D: hidden/num_heads, or 2*cos.shape[1] when num_heads is 0.
Rotary dim: rotary_embedding_dim, or the head size; it must equal 2*cos.shape[1].
Output: same shape and dtype (fp16 computed in fp32). Source: ORT
contrib_ops/cpu/bert/rotary_embedding.cc and rotary_embedding_helper.h.
"""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._rotary import cache_rows, rotate

OP_TYPE = "RotaryEmbedding"
DOMAIN = "com.microsoft"


def supports(node) -> bool:
    return not node.attrs.get("is_packed_batching", 0)


def run(ctx, x, position_ids, cos_cache, sin_cache):
    attrs = ctx.node.attrs
    x = np.asarray(x)
    num_heads = int(attrs.get("num_heads", 0))
    rot = int(attrs.get("rotary_embedding_dim", 0))
    if rot > 0 and num_heads == 0 and x.ndim == 3:
        raise ValueError("RotaryEmbedding: num_heads is required when rotary_embedding_dim > 0")
    if x.ndim == 4:
        b, n, s, h = x.shape
        xs = x.astype(np.float32).transpose(0, 2, 1, 3)  # [B, S, N, H]
    elif x.ndim == 3:
        b, s, hidden = x.shape
        h = hidden // num_heads if num_heads else 2 * cos_cache.shape[1]
        if hidden % h:
            raise ValueError(f"RotaryEmbedding: hidden {hidden} is not a multiple of head size {h}")
        n = hidden // h
        xs = x.astype(np.float32).reshape(b, s, n, h)
    else:
        raise ValueError(f"RotaryEmbedding: input rank {x.ndim} (expected 3 or 4)")
    if 2 * cos_cache.shape[1] != (rot or h):
        raise ValueError(f"RotaryEmbedding: cos cache width {cos_cache.shape[1]} does not match "
                         f"rotary dim {rot or h}")
    pos = np.asarray(position_ids, dtype=np.int64)
    if pos.size == 1:
        pos = np.broadcast_to(pos.reshape(()) + np.arange(s), (b, s))
    elif pos.shape != (b, s):
        raise ValueError(f"RotaryEmbedding: position_ids shape {pos.shape}, expected {(b, s)}")
    out = rotate(xs, cache_rows(cos_cache, pos), cache_rows(sin_cache, pos),
                 bool(attrs.get("interleaved", 0)))
    out = out.transpose(0, 2, 1, 3) if x.ndim == 4 else out.reshape(x.shape)
    return (write(ctx, 0, out, x.dtype),)

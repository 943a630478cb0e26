"""SimplifiedLayerNormalization (default domain, registered by ORT): RMSNorm, docs/ops.md 3.1.

Y = X / sqrt(mean(X^2 over dims axis..end) + epsilon) * scale; computed in fp32 (stash_type 1)
and rounded to scale's dtype. Optional output 1 inv_std_var (fp32) = 1/sqrt(mean(X^2) + eps)
with the normalized dims kept as 1. Attributes: axis (-1), epsilon (1e-5), stash_type (1).
Source: ORT core/providers/cpu/nn/layer_norm_impl.cc.
"""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import normalize_axis

OP_TYPE = "SimplifiedLayerNormalization"
DOMAIN = ""


def run(ctx, x, scale):
    attrs = ctx.node.attrs
    x = np.asarray(x)
    axis = normalize_axis(int(attrs.get("axis", -1)), x.ndim)
    eps = np.float32(attrs.get("epsilon", 1e-5))
    lead = x.shape[:axis]
    v = x.astype(np.float32).reshape(*lead, -1)
    inv_std = (np.float32(1.0) / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)).astype(np.float32)
    y = (v * inv_std).reshape(x.shape) * np.asarray(scale, dtype=np.float32)
    names = ctx.node.outputs
    y = write(ctx, 0, y, np.asarray(scale).dtype)
    inv = write(ctx, 1, inv_std.reshape(*lead, *([1] * (x.ndim - axis)))) if len(names) > 1 and names[1] else None
    return (y, inv)[:len(names)]

"""SkipSimplifiedLayerNormalization (com.microsoft): residual add + RMSNorm, docs/ops.md 3.2.

Inputs: input [B, S, D] or [T, D]; skip of the same shape or broadcast by flat modulo
([1, S, D] / [S, D]); gamma [D]; bias [D] optional (index 3). Attribute epsilon (1e-12).
v = input + skip (+ bias) in fp32; y = v / sqrt(mean(v^2) + eps) * gamma.
Outputs: 0 y (input dtype); 1 mean (fp32 [..., 1], always 0); 2 inv_std_var (fp32 [..., 1]);
3 input_skip_bias_sum = v rounded to the input dtype. Unused outputs ("") are None.
Source: ORT contrib_ops/cpu/skip_layer_norm.cc.
"""

import numpy as np

from providers.cpu_reference.ops._out import buffer, write

OP_TYPE = "SkipSimplifiedLayerNormalization"
DOMAIN = "com.microsoft"


def run(ctx, x, skip, gamma, bias=None):
    x = np.asarray(x)
    d = x.shape[-1]
    skip = np.asarray(skip)
    if x.size % skip.size or skip.shape[-1] != d:
        raise ValueError(f"SkipSimplifiedLayerNormalization: skip {skip.shape} vs input {x.shape}")
    skip32 = np.tile(skip.astype(np.float32).reshape(-1), x.size // skip.size).reshape(x.shape)
    v = x.astype(np.float32) + skip32
    if bias is not None:
        v = v + np.asarray(bias, dtype=np.float32)
    eps = np.float32(ctx.node.attrs.get("epsilon", 1e-12))
    inv_std = (np.float32(1.0) / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)).astype(np.float32)
    y = buffer(ctx, 0, x.shape, x.dtype)
    outs = [np.multiply(v * inv_std, np.asarray(gamma, dtype=np.float32), out=y, casting="unsafe")]
    names = ctx.node.outputs
    for i, (value, dtype) in enumerate(((np.zeros_like(inv_std), np.float32), (inv_std, np.float32),
                                        (v, x.dtype)), start=1):
        outs.append(write(ctx, i, value, dtype) if i < len(names) and names[i] else None)
    return tuple(outs[:len(names)])

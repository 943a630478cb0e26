"""SkipSimplifiedLayerNormalization (com.microsoft), docs/ops.md 3.2: v = input + skip (+ bias);
y = RMSNorm(v) * gamma. Outputs: 0 y, 1 mean (zeros), 2 inv_std_var (fp32 [..., 1]),
3 v rounded to the input dtype; unused outputs are None. skip may broadcast by flat modulo.
Kernel: kernels/rms_norm.cu (one block per row, fixed reduction tree).
"""

import numpy as np

from providers.cuda.ops import _norm

OP_TYPE = "SkipSimplifiedLayerNormalization"
DOMAIN = "com.microsoft"


def run(ctx, x, skip, gamma, bias=None):
    d = x.shape[-1]
    if x.size % skip.size or skip.shape[-1] != d:
        raise ValueError(f"SkipSimplifiedLayerNormalization: skip {skip.shape} vs input {x.shape}")
    names = list(ctx.node.outputs) + [""] * 4
    stat = (*x.shape[:-1], 1)
    y = ctx.output(0, x.shape, x.dtype)
    mean = ctx.output(1, stat, np.float32) if names[1] else None
    inv = ctx.output(2, stat, np.float32) if names[2] else None
    total = ctx.output(3, x.shape, x.dtype) if names[3] else None
    _norm.launch(x, skip, bias, gamma, y, total, mean, inv, d, float(ctx.node.attrs.get("epsilon", 1e-12)))
    return (y, mean, inv, total)[:len(ctx.node.outputs)]

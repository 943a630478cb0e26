"""SimplifiedLayerNormalization (default domain), docs/ops.md 3.1: RMSNorm over dims axis..end.

fp32 math; output in scale's dtype; optional output 1 inv_std_var (fp32, normalized dims
kept as 1). Kernel: kernels/rms_norm.cu (one block per row, fixed reduction tree).
"""

import numpy as np

from providers.cuda.ops import _norm

OP_TYPE = "SimplifiedLayerNormalization"
DOMAIN = ""


def run(ctx, x, scale):
    attrs = ctx.node.attrs
    axis = int(attrs.get("axis", -1)) % x.ndim
    d = int(np.prod(x.shape[axis:]))
    y = ctx.output(0, x.shape, scale.dtype)
    names = ctx.node.outputs
    inv_shape = (*x.shape[:axis], *([1] * (x.ndim - axis)))
    inv = ctx.output(1, inv_shape, np.float32) if len(names) > 1 and names[1] else None
    _norm.launch(x, None, None, scale, y, None, None, inv, d, float(attrs.get("epsilon", 1e-5)))
    return (y, inv)[:len(names)]

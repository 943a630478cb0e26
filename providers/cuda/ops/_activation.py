"""Launcher of kernels/activation.cu's ``activation`` (no OP_TYPE: a helper).

Kinds: 0 Gelu (erf), 1 Gelu tanh / FastGelu, 2 QuickGelu, 3 Tanh; fp32 math rounded once to
the input dtype (fp16/fp32); no reductions, so batch-invariant by construction.
"""

import numpy as np

from providers.cuda.module import ctype, function
from providers.cuda.ops import NULL, grid_threads

EXPRS = ("activation<__half>", "activation<float>", "split_copy<__half>", "split_copy<float>")
GELU, GELU_TANH, QUICK_GELU, TANH = 0, 1, 2, 3


def supports_float(node) -> bool:
    """Input 0 is fp32 or fp16 (or undeclared)."""
    dtype = node.input_dtypes[0] if node.input_dtypes else None
    return dtype is None or np.dtype(dtype) in (np.float32, np.float16)


def launch(ctx, x, kind: int, bias=None, alpha: float = 0.0):
    """y = activation(x [+ bias]) into output buffer 0; returns (y,)."""
    y = ctx.output(0, x.shape, x.dtype)
    kern = function("activation", f"activation<{ctype(x.dtype)}>", EXPRS)
    bias_n = np.int64(bias.size if bias is not None else 1)
    kern(grid_threads(x.size, 256, 4096), (256,),
         (x, NULL if bias is None else bias, y, np.int64(x.size), bias_n, np.int32(kind), np.float32(alpha)))
    return (y,)

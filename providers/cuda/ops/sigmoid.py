"""Sigmoid (ONNX): y = 1 / (1 + exp(-x)) in fp32, rounded to the input dtype (fp16/fp32).

kernels/elementwise.cu (no reduction): batch-invariant by construction. Source: ONNX Sigmoid-13.
"""

import numpy as np

from providers.cuda.module import ctype, function
from providers.cuda.ops import grid_threads
from providers.cuda.ops._binary import EXPRS

OP_TYPE = "Sigmoid"
DOMAIN = ""


def run(ctx, x):
    y = ctx.output(0, x.shape, x.dtype)
    kern = function("elementwise", f"sigmoid<{ctype(x.dtype)}>", EXPRS)
    kern(grid_threads(x.size, 256, 4096), (256,), (x, y, np.int64(x.size)))
    return (y,)

"""FastGelu (com.microsoft): Y = GELU_tanh(X + bias), bias [hidden] optional.

GELU_tanh is 0.5 x (1 + tanh(0.7978845608 (x + 0.044715 x^3))); fp32 and fp16 (in fp32).
Older builders wrote Gemma's activation with it (docs/ops.md 5). Source: ORT
contrib_ops/cpu/activations.h (FastGelu), the contrib op schema.
"""

import numpy as np

from providers.cpu_reference.ops._gelu import gelu_tanh
from providers.cpu_reference.ops._out import write

OP_TYPE = "FastGelu"
DOMAIN = "com.microsoft"


def run(ctx, x, bias=None):
    x = np.asarray(x)
    work = x.astype(np.float32)
    if bias is not None:
        work = work + np.asarray(bias).astype(np.float32)
    return (write(ctx, 0, gelu_tanh(work), x.dtype),)

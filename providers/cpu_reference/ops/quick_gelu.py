"""QuickGelu (com.microsoft): Y = X sigmoid(alpha X), ``alpha`` default 1.702.

fp32 and fp16 (in fp32). The builder writes ``geglu`` / ``gegelu`` activations with it
(docs/ops.md 5). Source: ORT contrib_ops/cpu/activations.h (QuickGelu).
"""

import numpy as np

from providers.cpu_reference.ops._gelu import gelu_quick
from providers.cpu_reference.ops._out import write

OP_TYPE = "QuickGelu"
DOMAIN = "com.microsoft"


def run(ctx, x):
    x = np.asarray(x)
    return (write(ctx, 0, gelu_quick(x.astype(np.float32), float(ctx.node.attrs.get("alpha", 1.702))), x.dtype),)

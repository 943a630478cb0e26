"""Greater (ONNX, default domain): bool Y = (A > B) with broadcasting. ONNX Greater-13.

The builder's LongRoPE graphs (Phi-3/3.5 with ``rope_scaling.type == "longrope"``) compare the
attention mask's width with ``original_max_position_embeddings`` to pick the rope caches
(docs/ops.md 5); the operands are host shape values there, so the node runs on the host.
"""

import numpy as np

from providers.cpu_reference.ops._out import write

OP_TYPE = "Greater"
DOMAIN = ""


def run(ctx, a, b):
    return (write(ctx, 0, np.greater(a, b)),)

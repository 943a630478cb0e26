"""Shape (ONNX, default domain): int64 1-D shape of the input, sliced by ``start``/``end``.

start (default 0) and end (default rank) follow Python slicing with clamping. ONNX Shape-15.
"""

import numpy as np

from providers.cpu_reference.ops._out import write

OP_TYPE = "Shape"
DOMAIN = ""


def run(ctx, x):
    shape = np.asarray(x).shape
    start = int(ctx.node.attrs.get("start", 0))
    end = ctx.node.attrs.get("end")
    return (write(ctx, 0, np.array(shape[start:None if end is None else int(end)], dtype=np.int64)),)

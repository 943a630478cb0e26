"""Shape (ONNX): the input's shape as a HOST int64 array, sliced by start/end. ONNX Shape-15."""

import numpy as np

OP_TYPE = "Shape"
DOMAIN = ""


def run(ctx, x):
    start = int(ctx.node.attrs.get("start", 0))
    end = ctx.node.attrs.get("end")
    return (np.array(tuple(x.shape)[start:None if end is None else int(end)], dtype=np.int64),)

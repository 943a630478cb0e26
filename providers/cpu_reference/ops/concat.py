"""Concat (ONNX, default domain): concatenate the inputs along attribute ``axis``. ONNX Concat-13."""

import numpy as np

from providers.cpu_reference.ops._out import write

OP_TYPE = "Concat"
DOMAIN = ""


def run(ctx, *inputs):
    return (write(ctx, 0, np.concatenate([np.asarray(x) for x in inputs], axis=int(ctx.node.attrs["axis"]))),)

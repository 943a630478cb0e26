"""Concat (ONNX, default domain): concatenate the inputs along attribute ``axis``. ONNX Concat-13."""

import numpy as np

OP_TYPE = "Concat"
DOMAIN = ""


def run(ctx, *inputs):
    return (np.concatenate([np.asarray(x) for x in inputs], axis=int(ctx.node.attrs["axis"])),)

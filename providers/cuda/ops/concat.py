"""Concat (ONNX, default domain): the inputs joined along attribute ``axis``. Inputs that are
all host values run on the host (core.executor: the router's shape arithmetic); otherwise
host inputs are uploaded once (device_array) and ``cupy.concatenate(..., out=)`` copies into
the output buffer (a copy: batch-invariant; not replayed). Source: ONNX Concat-13."""

import numpy as np

from core.opdefs import normalize_axis
from providers.cuda import replay
from providers.cuda.ops import device_array, is_host

OP_TYPE = "Concat"
DOMAIN = ""


def run(ctx, *inputs):
    import cupy

    arrays = [device_array(ctx, np.asarray(x), f"host{i}") if is_host(x) else x for i, x in enumerate(inputs)]
    axis = normalize_axis(int(ctx.node.attrs["axis"]), arrays[0].ndim)
    shape = list(arrays[0].shape)
    shape[axis] = sum(int(a.shape[axis]) for a in arrays)
    out = ctx.output(0, shape, arrays[0].dtype)
    replay.not_replayable()  # a CuPy copy, not a recorded Kernel launch
    cupy.concatenate(arrays, axis=axis, out=out)
    return (out,)

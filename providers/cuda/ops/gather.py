"""Gather (ONNX): host operands run on the host (core.executor, e.g. Shape()[1]); the embedding
lookup (device data, axis 0) with kernels/gather.cu ``gather_rows`` (16-byte row copies);
other device gathers with cupy.take(..., out=). Out-of-range rows are zero on the device
(no host check: that would sync). ONNX Gather-13."""

import numpy as np

from core.opdefs import normalize_axis
from providers.cuda import replay
from providers.cuda.module import function
from providers.cuda.ops import MAX_GRID_Y, device_array

OP_TYPE = "Gather"
DOMAIN = ""


def run(ctx, data, indices):
    import cupy

    axis = normalize_axis(int(ctx.node.attrs.get("axis", 0)), data.ndim)
    idx = device_array(ctx, indices, "indices", np.int64)
    shape = (*data.shape[:axis], *idx.shape, *data.shape[axis + 1:])
    out = ctx.output(0, shape, data.dtype)
    if axis == 0 and data.flags.c_contiguous and idx.size:
        row_bytes = data.nbytes // max(1, data.shape[0])
        kern = function("gather", "gather_rows", ("gather_rows",))
        units = row_bytes // 16 if row_bytes % 16 == 0 else row_bytes
        kern((max(1, min(64, -(-units // 128))), min(idx.size, MAX_GRID_Y)), (128,),
             (data, idx, out, np.int64(idx.size), np.int64(data.shape[0]), np.int64(row_bytes)))
    elif idx.size:
        replay.not_replayable()  # a CuPy launch, not a recorded Kernel launch
        cupy.take(data, idx, axis=axis, out=out)
    return (out,)

"""Slice (ONNX, default domain, opset 13+): data[starts:ends:steps] along ``axes``.

Negative starts/ends add the dim; then clamping per the ONNX spec: step > 0 clamps start and
end to [0, dim]; step < 0 clamps start to [0, dim-1] and end to [-1, dim-1] (-1 = before 0).
axes default to 0..len(starts)-1, steps to 1; a step of 0 raises (core.opdefs.slice_index).
The values are copied into the output buffer.
Source: ONNX Slice-13.
"""

import numpy as np

from core.opdefs import slice_index
from providers.cpu_reference.ops._out import write

OP_TYPE = "Slice"
DOMAIN = ""


def run(ctx, data, starts, ends, axes=None, steps=None):
    data = np.asarray(data)
    return (write(ctx, 0, data[slice_index(data.shape, starts, ends, axes, steps)]),)

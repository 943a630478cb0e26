"""Slice (ONNX, default domain, opset 13+): data[starts:ends:steps] along ``axes``.

Negative starts/ends add the dim; then clamping per the ONNX spec: step > 0 clamps start and
end to [0, dim]; step < 0 clamps start to [0, dim-1] and end to [-1, dim-1] (-1 = before 0).
axes default to 0..len(starts)-1, steps to 1; a step of 0 raises. The values are copied into the output buffer.
Source: ONNX Slice-13.
"""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import int_list, normalize_axis

OP_TYPE = "Slice"
DOMAIN = ""


def run(ctx, data, starts, ends, axes=None, steps=None):
    data = np.asarray(data)
    starts, ends = int_list(starts), int_list(ends)
    axes = int_list(axes) if axes is not None else list(range(len(starts)))
    steps = int_list(steps) if steps is not None else [1] * len(starts)
    index = [slice(None)] * data.ndim
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = normalize_axis(axis, data.ndim)
        dim = data.shape[axis]
        if step == 0:
            raise ValueError("Slice: step 0")
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        index[axis] = slice(start, None if end < 0 else end, step)
    return (write(ctx, 0, data[tuple(index)]),)

"""Unsqueeze (ONNX, default domain): insert size-1 dims at ``axes`` (input, opset 13+; or attr).

Negative axes count from the end of the output rank. The values are copied into the output
buffer. Source: ONNX Unsqueeze-21.
"""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import int_list, normalize_axis

OP_TYPE = "Unsqueeze"
DOMAIN = ""


def run(ctx, data, axes=None):
    data = np.asarray(data)
    axis_list = int_list(axes) if axes is not None else list(ctx.node.attrs["axes"])
    rank = data.ndim + len(axis_list)
    out = data
    for a in sorted(normalize_axis(a, rank) for a in axis_list):
        out = np.expand_dims(out, a)
    return (write(ctx, 0, out),)

"""Squeeze (ONNX, default domain): remove size-1 dims at ``axes`` (input, opset 13+; or attr).

Without axes, every size-1 dim is removed. A listed dim whose size is not 1 raises ValueError.
The values are copied into the output buffer. Source: ONNX Squeeze-21.
"""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import int_list, normalize_axis

OP_TYPE = "Squeeze"
DOMAIN = ""


def run(ctx, data, axes=None):
    data = np.asarray(data)
    axis_list = int_list(axes) if axes is not None else list(ctx.node.attrs.get("axes", []))
    if not axis_list:
        return (write(ctx, 0, np.squeeze(data)),)
    norm = tuple(normalize_axis(a, data.ndim) for a in axis_list)
    if any(data.shape[a] != 1 for a in norm):
        raise ValueError(f"Squeeze: axes {axis_list} of shape {data.shape} are not all size 1")
    return (write(ctx, 0, np.squeeze(data, axis=norm)),)

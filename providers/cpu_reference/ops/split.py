"""Split (ONNX, default domain): split along ``axis`` (default 0) into the declared outputs.

Sizes from the optional int64 ``split`` input (or attribute, opset < 13); otherwise equal
chunks of ceil(dim / n) with a smaller last chunk, n = ``num_outputs`` or the number of
outputs. The builder uses it for Qwen3 q/k/v (docs/ops.md 0). Source: ONNX Split-18.
"""

import numpy as np

from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._util import int_list, normalize_axis

OP_TYPE = "Split"
DOMAIN = ""


def run(ctx, x, split=None):
    x = np.asarray(x)
    axis = normalize_axis(int(ctx.node.attrs.get("axis", 0)), x.ndim)
    dim = x.shape[axis]
    if split is not None:
        sizes = int_list(split)
    elif "split" in ctx.node.attrs:
        sizes = list(ctx.node.attrs["split"])
    else:
        n = int(ctx.node.attrs.get("num_outputs", len(ctx.node.outputs)))
        chunk = -(-dim // n)
        sizes = [chunk] * (n - 1) + [dim - chunk * (n - 1)]
    if sum(sizes) != dim or len(sizes) != len(ctx.node.outputs):
        raise ValueError(f"Split: sizes {sizes} do not split dim {dim} into {len(ctx.node.outputs)}")
    bounds = np.cumsum([0] + sizes)
    lead = (slice(None),) * axis
    return tuple(write(ctx, i, x[lead + (slice(bounds[i], bounds[i + 1]),)]) if name else None
                 for i, name in enumerate(ctx.node.outputs))

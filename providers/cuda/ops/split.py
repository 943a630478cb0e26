"""Split (ONNX Split-18): x into pieces along ``axis`` by the ``split`` input (host ints) or
attribute, or into ``num_outputs`` / len(outputs) equal pieces; fp16/fp32 device tensors.

Each output is one kernels/activation.cu ``split_copy`` launch (a strided copy; no arithmetic).
The builder's Qwen3 graphs split the packed Q/K/V before the q/k RMSNorm.
"""

import numpy as np

from core.opdefs import int_list, normalize_axis
from providers.cuda.module import ctype, function
from providers.cuda.ops import grid_threads
from providers.cuda.ops._activation import EXPRS, supports_float

OP_TYPE = "Split"
DOMAIN = ""


def supports(node) -> bool:
    return supports_float(node)


def _widths(node, size: int, split) -> list[int]:
    n_out = len(node.outputs)
    if split is not None:
        widths = int_list(split)
    elif "split" in node.attrs:
        widths = [int(v) for v in node.attrs["split"]]
    else:
        parts = int(node.attrs.get("num_outputs", n_out))
        chunk = -(-size // parts)
        widths = [min(chunk, size - i * chunk) for i in range(parts)]
    if sum(widths) != size or len(widths) != n_out:
        raise ValueError(f"Split at node {node.name!r}: widths {widths} do not cover axis size {size} "
                         f"in {n_out} outputs")
    return widths


def run(ctx, x, split=None):
    axis = normalize_axis(int(ctx.node.attrs.get("axis", 0)), x.ndim)
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    inner = int(np.prod(x.shape[axis + 1:], dtype=np.int64))
    kern = function("activation", f"split_copy<{ctype(x.dtype)}>", EXPRS)
    outs, offset = [], 0
    for slot, width in enumerate(_widths(ctx.node, x.shape[axis], split)):
        shape = x.shape[:axis] + (width,) + x.shape[axis + 1:]
        y = ctx.output(slot, shape, x.dtype)
        kern(grid_threads(max(1, y.size), 256, 4096), (256,),
             (x, y, np.int64(outer), np.int64(x.shape[axis]), np.int64(inner), np.int64(offset), np.int64(width)))
        outs.append(y)
        offset += width
    return tuple(outs)

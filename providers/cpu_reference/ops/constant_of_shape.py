"""ConstantOfShape (ONNX, default domain): a tensor of the int64 ``shape`` input filled with the
one-element ``value`` attribute (default float32 0). ONNX ConstantOfShape-21."""

import numpy as np

from providers.cpu_reference.ops._out import buffer
from providers.cpu_reference.ops._util import int_list

OP_TYPE = "ConstantOfShape"
DOMAIN = ""


def run(ctx, shape):
    value = ctx.node.attrs.get("value")
    fill = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
    if fill.size != 1:
        raise ValueError(f"ConstantOfShape: value has {fill.size} elements, expected 1")
    out = buffer(ctx, 0, tuple(int_list(shape)), fill.dtype)
    out.fill(fill[0])
    return (out,)

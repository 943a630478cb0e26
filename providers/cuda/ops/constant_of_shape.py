"""ConstantOfShape (ONNX, default domain): a HOST tensor of the int64 ``shape`` input filled
with the one-element ``value`` attribute (default float32 0), as Shape gives a host value: in
the graphs the builder writes the shape is the Shape of the router's scores, so the output,
the router's sentinel logits, stays on the host and ScatterElements writes it as a fill value
(ops/scatter_elements.py). A device ``shape`` is refused (reading it would sync).
Source: ONNX ConstantOfShape-21."""

import numpy as np

from core.opdefs import int_list, is_host

OP_TYPE = "ConstantOfShape"
DOMAIN = ""


def run(ctx, shape):
    if not is_host(shape):
        raise ValueError("ConstantOfShape (cuda): the shape input must be a host value")
    value = ctx.node.attrs.get("value")
    fill = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
    if fill.size != 1:
        raise ValueError(f"ConstantOfShape: value has {fill.size} elements, expected 1")
    return (np.full(tuple(int_list(shape)), fill[0], fill.dtype),)

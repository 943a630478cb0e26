"""Greater (ONNX): host only. The builder compares shape values with it (LongRoPE's choice of
rope caches), which the core runs on the host; a device operand is refused."""

import numpy as np

from core.opdefs import is_host

OP_TYPE = "Greater"
DOMAIN = ""


def run(ctx, a, b):
    if not (is_host(a) and is_host(b)):
        raise ValueError(f"Greater at node {ctx.node.name!r}: only host (shape) operands are supported")
    return (np.greater(a, b),)

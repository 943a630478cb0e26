"""Softmax (ONNX, default domain, opset 13+ semantics): softmax along one axis (default -1).

Y = exp(X - max) / sum(exp(X - max)) along ``axis``; fp16 computed in fp32. Every slice along
the axis is reduced alone. Source: ONNX Softmax-13 (opset < 13 2-D coercion not implemented).
"""

import numpy as np

from providers.cpu_reference.ops._out import write_elementwise

OP_TYPE = "Softmax"
DOMAIN = ""


def run(ctx, x):
    axis = int(ctx.node.attrs.get("axis", -1))

    def _softmax(v):
        e = np.exp(v - np.max(v, axis=axis, keepdims=True))
        return e / np.sum(e, axis=axis, keepdims=True)

    return (write_elementwise(ctx, _softmax, x),)

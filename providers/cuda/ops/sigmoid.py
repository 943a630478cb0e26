"""Sigmoid (ONNX): y = 1 / (1 + exp(-x)) in fp32, rounded to the input dtype (fp16/fp32).

Elementwise (no reduction): batch-invariant by construction. Source: ONNX Sigmoid-13.
"""

import functools

from providers.cuda.ops import host_or_none

OP_TYPE = "Sigmoid"
DOMAIN = ""


@functools.lru_cache(maxsize=None)
def _kernel():
    import cupy

    return cupy.ElementwiseKernel("T x", "T y", "y = (T)(1.0f / (1.0f + expf(-(float)x)))",
                                  "lockstep_sigmoid")


def run(ctx, x):
    host = host_or_none(ctx, "sigmoid", (x,))
    if host is not None:
        return host
    y = ctx.output(0, x.shape, x.dtype)
    _kernel()(x, y)
    return (y,)

"""Clip (ONNX, default domain): y = min(max(x, min), max), fp16/fp32, with the optional
one-element ``min`` / ``max`` inputs (absent: unbounded on that side; a bound is a value of
x's dtype, compared in fp32); NaN passes through. kernels/router.cu ``clip`` (no reduction:
batch-invariant). A host bound is a kernel scalar, a device bound is read by the kernel.
Source: ONNX Clip-13."""

import numpy as np

from providers.cuda.module import ctype, function
from providers.cuda.ops import NULL, _router, grid_threads, is_host

OP_TYPE = "Clip"
DOMAIN = ""


def support_reason(node) -> str | None:
    return _router.floats_only(node)



def _bound(ctx, b, dtype, name: str) -> tuple:
    """(pointer, scalar, present) of one bound."""
    if b is None:
        return NULL, np.float32(0.0), np.int32(0)
    if is_host(b):
        value = np.asarray(b).astype(dtype).reshape(-1)
        if value.size != 1:
            raise ValueError(f"Clip (cuda): {name} must have one element, got {value.size}")
        return NULL, np.float32(value[0]), np.int32(1)
    if b.size != 1 or b.dtype != dtype:
        raise ValueError(f"Clip (cuda): {name} must be one {dtype} element, got {b.dtype}{b.shape}")
    return b, np.float32(0.0), np.int32(1)


def run(ctx, x, low=None, high=None):
    x = _router.float_input(ctx, x)
    (lo_p, lo, has_lo), (hi_p, hi, has_hi) = _bound(ctx, low, x.dtype, "min"), _bound(ctx, high, x.dtype, "max")
    y = ctx.output(0, x.shape, x.dtype)
    if x.size:
        function("router", f"clip<{ctype(x.dtype)}>", _router.EXPRS)(
            grid_threads(x.size, 256, 4096), (256,),
            (x, y, np.int64(x.size), lo_p, hi_p, lo, hi, has_lo, has_hi))
    return (y,)

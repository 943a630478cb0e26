"""SiluMul (domain "lockstep"): y = (x * sigmoid(x)) * up, the core fusion of
Sigmoid(x) -> Mul(x, sig) -> Mul(., up).  Semantics exactly the unfused sequence: fp32 math,
rounded to the io dtype after each of the three ops (kernels/elementwise.cu ``silu_mul``).
Elementwise: batch-invariant by construction.
"""

import numpy as np

from providers.cuda.module import function
from providers.cuda.ops import grid_threads, is_host
from providers.cuda.ops._binary import EXPRS

OP_TYPE = "SiluMul"
DOMAIN = "lockstep"
_NAMES = {np.dtype(np.float16): "silu_mul<__half>", np.dtype(np.float32): "silu_mul<float>"}


def supports(node) -> bool:
    dts = [d for d in node.input_dtypes[:2] if d is not None]
    return len(node.inputs) == 2 and all(d in (np.float16, np.float32) for d in dts) and len(set(dts)) <= 1


def run(ctx, x, up):
    if is_host(x) or is_host(up) or x.shape != up.shape or x.dtype != up.dtype:
        raise ValueError(f"SiluMul (cuda): needs same-shape device operands, got {getattr(x, 'shape', x)} "
                         f"and {getattr(up, 'shape', up)}")
    y = ctx.output(0, x.shape, x.dtype)
    launch(x, up, y)
    return (y,)


def launch(x, up, y) -> None:
    """y = silu_mul(x, up) for same-shape fp16/fp32 device arrays."""
    kern = function("elementwise", _NAMES[x.dtype], EXPRS)
    kern(grid_threads(x.size, 256, 4096), (256,), (x, up, y, np.int64(x.size)))

"""Launcher of kernels/rms_norm.cu (one 256-thread block per row; see the .cu header)."""

import numpy as np

from providers.cuda.module import ctype, function
from providers.cuda.ops import NULL

_PAIRS = (("__half", "__half"), ("float", "float"), ("float", "__half"), ("__half", "float"))
EXPRS = tuple(f"rms_norm<{a}, {b}>" for a, b in _PAIRS)


def launch(x, skip, bias, gamma, y, sum_out, mean_out, inv_out, d: int, eps: float) -> None:
    rows = x.size // d
    if rows == 0:
        return
    kern = function("rms_norm", f"rms_norm<{ctype(x.dtype)}, {ctype(gamma.dtype)}>", EXPRS)
    def opt(v):
        return NULL if v is None else v

    kern((rows,), (256,), (x, opt(skip), np.int64(0 if skip is None else skip.size), opt(bias), gamma,
                           y, opt(sum_out), opt(mean_out), opt(inv_out), np.int32(d), np.float32(eps)),
         shared_mem=(32 + d) * 4)

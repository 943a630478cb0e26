"""Launcher of kernels/rms_norm.cu: one 256-thread block per row (see the .cu header).

fp16 rows whose length is a multiple of 8 (every fp16 model here) take ``rms_norm_h8``, the
same arithmetic with 16-byte loads in one round trip; everything else ``rms_norm``. The two give
the same bits (tests/cuda/test_norm_kernels.py), so which one runs never changes a result.
"""

import numpy as np

from providers.cuda.module import ctype, function
from providers.cuda.ops import NULL
from providers.cuda.paths import PATHS

_PAIRS = (("__half", "__half"), ("float", "float"), ("float", "__half"), ("__half", "float"))
#: rms_norm_h8's pieces of 8 values per thread, by the most a row needs (a row of D values needs
#: D / 2,048 rounded up).
_H8 = (1, 2, 4)
EXPRS = tuple(f"rms_norm<{a}, {b}>" for a, b in _PAIRS) + tuple(f"rms_norm_h8<{v}>" for v in _H8)
#: Whether fp16 rows may take rms_norm_h8 (tests turn it off to compare the two kernels).
VECTOR = True
#: Launches per kernel since import (eager launches; a captured graph's replays are not counted):
#: the ``norm`` group of :data:`providers.cuda.paths.PATHS`, read with :func:`stats`.
PATHS.declare("norm", ("rms_norm_h8", "rms_norm"))


def stats() -> dict[str, int]:
    """A copy of the launch counters: kernel name -> launches."""
    return PATHS.stats("norm")


def _pieces(d: int, x, skip, gamma, *others) -> int:
    """rms_norm_h8's V for this call, or 0 where it does not apply: not fp16, D not a multiple of
    8 or over 8,192, a skip not broadcast by whole rows, or a pointer of x, skip, gamma or
    ``others`` (bias, y, sum_out; None where absent) not 16-byte aligned."""
    if not VECTOR or x.dtype != np.float16 or gamma.dtype != np.float16 or d % 8 or d > 256 * 8 * _H8[-1]:
        return 0
    if skip is not None and skip.size % d:
        return 0
    if any(a.data.ptr % 16 for a in (x, skip, gamma, *others) if a is not None):
        return 0
    return next(v for v in _H8 if d <= 256 * 8 * v)


def launch(x, skip, bias, gamma, y, sum_out, mean_out, inv_out, d: int, eps: float) -> None:
    """RMSNorm of ``x`` [rows, d] (+ ``skip`` (+ ``bias``)) times ``gamma`` [d] into ``y``
    (docs/ops.md 3.1, 3.2). skip: [.., d] broadcast by flat modulo or None; bias [d] or None;
    sum_out: x + skip (+ bias) rounded to x's dtype, or None; mean_out: fp32 [rows] of zeros, or
    None; inv_out: fp32 [rows] of 1 / sqrt(mean(v^2) + eps), or None. Device arrays, contiguous."""
    rows = x.size // d
    if rows == 0:
        return

    def opt(v):
        return NULL if v is None else v

    args = (x, opt(skip), np.int64(0 if skip is None else skip.size), opt(bias), gamma,
            y, opt(sum_out), opt(mean_out), opt(inv_out), np.int32(d), np.float32(eps))
    v = _pieces(d, x, skip, gamma, bias, y, sum_out)
    if v:
        kern = function("rms_norm", f"rms_norm_h8<{v}>", EXPRS)
        PATHS.add("norm", "rms_norm_h8")
    else:
        kern = function("rms_norm", f"rms_norm<{ctype(x.dtype)}, {ctype(gamma.dtype)}>", EXPRS)
        PATHS.add("norm", "rms_norm")
    kern((rows,), (256,), args, shared_mem=(32 + d) * 4)

"""Helpers shared by the cpu_reference op modules (no OP_TYPE: not an op).

``int_list``, ``int_scalar`` and ``normalize_axis`` are :mod:`core.opdefs` (shared by every
provider), re-exported here for the op modules.

fp16 is computed in fp32 and rounded to fp16 at the op output, like ORT's CPU kernels;
fp32/fp64 and integer tensors are computed in their own dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from core.opdefs import int_list, int_scalar, normalize_axis  # noqa: F401 - re-exported
from core.ops import memo


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype an op computes in for inputs of ``dtype`` (fp16 -> fp32, others unchanged)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def as_compute(ctx, x: np.ndarray, slot: str) -> np.ndarray:
    """``x`` in :func:`compute_dtype`. A read-only fp16 ``x`` (a plan constant: the executor
    freezes host constants) is converted once and kept (:func:`core.ops.memo` under ``slot``) while the same
    array object comes back; converting the [576, 49152] fp16 LM head on every call cost 10x the
    product itself."""
    work = compute_dtype(x.dtype)
    if x.dtype == work:
        return x
    if x.flags.writeable:
        return x.astype(work)
    return memo(ctx, slot, (x,), lambda: x.astype(work))


def elementwise(fn: Callable[..., np.ndarray], *xs: np.ndarray) -> np.ndarray:
    """``fn(*xs)`` computed in :func:`compute_dtype` of the first input, cast back to its dtype."""
    dtype = np.asarray(xs[0]).dtype
    work = compute_dtype(dtype)
    args = [np.asarray(x).astype(work, copy=False) if np.asarray(x).dtype.kind == "f" else np.asarray(x)
            for x in xs]
    return np.asarray(fn(*args)).astype(dtype, copy=False)

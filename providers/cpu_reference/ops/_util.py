"""Helpers shared by the cpu_reference op modules (no OP_TYPE: not an op).

fp16 is computed in fp32 and rounded to fp16 at the op output, like ORT's CPU kernels;
fp32/fp64 and integer tensors are computed in their own dtype.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype an op computes in for inputs of ``dtype`` (fp16 -> fp32, others unchanged)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def as_compute(ctx, x: np.ndarray, slot: str) -> np.ndarray:
    """``x`` in :func:`compute_dtype`. A read-only fp16 ``x`` (a plan constant: the executor
    freezes host constants) is converted once and cached in ``ctx.cache[slot]`` while the same
    array object comes back; converting the [576, 49152] fp16 LM head on every call cost 10x the
    product itself."""
    work = compute_dtype(x.dtype)
    if x.dtype == work:
        return x
    if x.flags.writeable:
        return x.astype(work)
    hit = ctx.cache.get(slot)
    if hit is not None and hit[0] is x:
        return hit[1]
    out = x.astype(work)
    ctx.cache[slot] = (x, out)
    return out


def elementwise(fn: Callable[..., np.ndarray], *xs: np.ndarray) -> np.ndarray:
    """``fn(*xs)`` computed in :func:`compute_dtype` of the first input, cast back to its dtype."""
    dtype = np.asarray(xs[0]).dtype
    work = compute_dtype(dtype)
    args = [np.asarray(x).astype(work, copy=False) if np.asarray(x).dtype.kind == "f" else np.asarray(x)
            for x in xs]
    return np.asarray(fn(*args)).astype(dtype, copy=False)


def int_list(x) -> list[int]:
    """A host integer tensor (scalar or 1-D, any int dtype) as a list of Python ints."""
    return [int(v) for v in np.asarray(x).reshape(-1)]


def int_scalar(x) -> int:
    """A host integer scalar or 1-element tensor as a Python int."""
    values = int_list(x)
    if len(values) != 1:
        raise ValueError(f"expected a scalar or 1-element tensor, got {len(values)} elements")
    return values[0]


def normalize_axis(axis: int, rank: int) -> int:
    """``axis`` in [-rank, rank) as a non-negative axis; raises ValueError when out of range."""
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} out of range for rank {rank}")
    return axis % rank

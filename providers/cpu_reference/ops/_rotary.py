"""Rotary position embedding math shared by GroupQueryAttention and RotaryEmbedding (docs/ops.md 1.3.1, 4).

With r = rotary_dim, c = cos[pos, i], n = sin[pos, i] for i < r/2:
non-interleaved: x[i]' = x[i]c - x[i+r/2]n, x[i+r/2]' = x[i+r/2]c + x[i]n;
interleaved: the pairs are (x[2i], x[2i+1]); dims >= r pass through.
"""

from __future__ import annotations

import numpy as np


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotate the first ``2 * cos.shape[-1]`` dims of the last axis of fp32 ``x``.

    Args:
        x: float32 [..., S, N, H] (any leading dims).
        cos, sin: float32 [..., S, r/2], the cache rows at each position (broadcast over N).
        interleaved: pairs (2i, 2i+1) instead of (i, i + r/2).

    Returns:
        A new float32 array shaped like ``x``.
    """
    half = cos.shape[-1]
    r = 2 * half
    if r > x.shape[-1]:
        raise ValueError(f"rotary dim {r} exceeds head size {x.shape[-1]}")
    c, n = cos[..., None, :], sin[..., None, :]
    out = x.copy()
    if interleaved:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
        out[..., 0:r:2] = x1 * c - x2 * n
        out[..., 1:r:2] = x2 * c + x1 * n
    else:
        x1, x2 = x[..., :half], x[..., half:r]
        out[..., :half] = x1 * c - x2 * n
        out[..., half:r] = x2 * c + x1 * n
    return out


def cache_rows(cache: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """fp32 rows of a cos/sin cache [max_pos, r/2] at int ``positions``; raises if out of range."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= cache.shape[0]):
        raise ValueError(f"rotary position out of range [0, {cache.shape[0]}): "
                         f"{int(positions.min())}..{int(positions.max())}")
    return np.asarray(cache, dtype=np.float32)[positions]

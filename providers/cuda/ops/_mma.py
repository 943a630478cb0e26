"""Launchers of kernels/linear_mma.cu (tensor-core fp16 linear, see the .cu header).

Used for every M of an fp16 layer (never switched by batch size); NJ (n8 token tiles per
block) follows M freely: token columns are independent inside an mma.
"""

from __future__ import annotations

import functools

import numpy as np

from providers.cuda.module import function

SEG_K = 256
MAX_K = 8 * SEG_K  # one warp per K segment, at most 8 warps per block
EXPRS = tuple(f"mma_dense<{nj}>" for nj in (1, 2, 4)) + tuple(
    f"mma_nbits4<{nj}, {s}>" for nj in (1, 2, 4) for s in ("__half", "float"))


@functools.lru_cache(maxsize=4096)
def config(m: int, n: int, k: int) -> tuple[int, tuple, tuple, int]:
    """(NJ, grid, block, shared bytes)."""
    nj = 1 if m <= 8 else 2 if m <= 16 else 4
    nseg = -(-k // SEG_K)
    return nj, (-(-n // 16), -(-m // (8 * nj))), (32 * nseg,), nseg * 16 * 8 * nj * 4


@functools.lru_cache(maxsize=None)
def _pack_index(kp: int, np_: int):
    nt, kt, lane, e = np.meshgrid(np.arange(np_ // 16), np.arange(kp // 16), np.arange(32), np.arange(8),
                                  indexing="ij")
    g, t = lane >> 2, lane & 3
    n = nt * 16 + g + 8 * ((e >> 1) & 1)
    # 64-wide chunk kc, virtual tile v: slots (2t, 2t+1, 2t+8, 2t+9) <- k 16t + 4v + (0, 1, 2, 3)
    k = (kt // 4) * 64 + 16 * t + 4 * (kt % 4) + (e & 1) + 2 * (e >> 2)
    return (k * np_ + n).reshape(-1).astype(np.int64)


def packed(ctx, w):
    """W [K, N] fp16 in fragment order (K padded to 64, k slots permuted as in nbits4) (cached per node by device pointer: W is a weight)."""
    import cupy

    key = ("mma_packed", w.data.ptr, w.shape)
    hit = ctx.cache.get("mma_packed")
    if hit is not None and hit[0] == key:
        return hit[1]
    k, n = w.shape
    kp, np_ = -(-k // 64) * 64, -(-n // 16) * 16
    pad = cupy.zeros((kp, np_), cupy.float16)
    pad[:k, :n] = w
    idx = cupy.asarray(_pack_index(kp, np_))
    out = cupy.ascontiguousarray(pad.reshape(-1)[idx])
    ctx.cache["mma_packed"] = (key, out)
    return out


def dense(ctx, a, w, bias, y, m, n, k, null):
    wp = packed(ctx, w)
    nj, grid, block, shared = config(m, n, k)
    function("linear_mma", f"mma_dense<{nj}>", EXPRS)(
        grid, block, (a, wp, null if bias is None else bias, y, np.int32(m), np.int32(n), np.int32(k)),
        shared_mem=shared)


def nbits4(a, b, scales, zp, zp_mode, zp_stride, bias, y, m, n, k, bs, s_type, null):
    nj, grid, block, shared = config(m, n, k)
    function("linear_mma", f"mma_nbits4<{nj}, {s_type}>", EXPRS)(
        grid, block, (a, b, scales, zp, np.int32(zp_mode), np.int32(zp_stride),
                      null if bias is None else bias, y, np.int32(m), np.int32(n), np.int32(k), np.int32(bs)),
        shared_mem=shared)

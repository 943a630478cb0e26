"""Launches of kernels/linear_gemv4.cu (``gemv4``): the int4 GEMV for launches of 1 to
:data:`MAX_ROWS` rows on the packed int4 layout (:class:`~providers.cuda.ops._mma_layout.Int4Weights`),
bitwise ``mma_nbits4`` (the .cu header), taken by :func:`providers.cuda.ops._mma.nbits4` where
``tuning.gemm_gemv`` is on (:func:`applies`).

Batch invariance: the kernel runs mma_nbits4's instructions on the same values for every output,
and token columns of an mma are independent, so an output's bits depend neither on M nor on which
int4 kernel serves a launch; the dispatcher may take this kernel for 1-8 rows and the others
above. The launch shape (warps, tiles per block, units in flight) changes no bit either.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from providers.cuda.module import ctype, function, multiprocessors
from providers.cuda.ops import _mma_layout as layout
from providers.cuda.ops._mma_layout import SEG_K
from providers.cuda.paths import PATHS
from providers.cuda.tuning import Tuning

#: Most rows of a launch (one m16n8k16 token tile).
MAX_ROWS = 8
#: Warps per block of the default shape (:func:`config`), and the most a block may have.
WARPS, MAX_WARPS = 8, 16
#: Default units of 4 chunks (2 KiB of codes a warp) in flight per warp: 1 or 2 (template UP).
UNITS = 2
#: Shared memory a default launch may use for its partials (bytes; no opt-in needed).
SHARED_DEFAULT = 48 * 1024
#: Shared memory any launch may use (the H100's and H200's per-block opt-in limit, bytes).
SHARED_MAX = 227 * 1024
#: Blocks per multiprocessor the default grid should still reach before it takes more tiles a block.
FILL = 4
BOOL = ("false", "true")
EXPRS = tuple(f"gemv4<{s}, {glu}, {zp}, {up}>" for s in ("__half", "float") for glu in BOOL for zp in BOOL
              for up in (1, 2))
PATHS.declare("gemv4", ("launches",))
_opted: dict = {}


def stats() -> dict:
    """A copy of the launcher counters: ``launches``, calls of :func:`launch` (a captured graph's
    replays and eager launch replay do not pass the launcher and are not counted)."""
    return PATHS.stats("gemv4")


def applies(m: int, *, tuning: Tuning) -> bool:
    """Whether an int4 launch of ``m`` rows takes ``gemv4``: ``tuning.gemm_gemv`` on and
    1 <= m <= :data:`MAX_ROWS`."""
    return tuning.gemm_gemv and 1 <= m <= MAX_ROWS


def shared_bytes(tb: int, k: int) -> int:
    """Shared memory of a block of ``tb`` tiles for K = ``k``: the [tb][nseg][16][8] float partials."""
    return tb * -(-k // SEG_K) * 16 * 8 * 4


def config(n: int, k: int, warps: int | None = None, tb: int | None = None,
           resident: Callable[[int], int] | None = None) -> tuple[tuple, tuple, int, int]:
    """(grid, block, shared bytes, tiles per block) of a launch over ``n`` weight rows and K = ``k``.

    Defaults: the most tiles per block of (8, 4, 2) whose partials fit :data:`SHARED_DEFAULT` and
    whose grid still has :data:`FILL` blocks per multiprocessor, else 1 (more tiles a block keep a
    segment's activations in registers for longer and each warp's weight stream longer; fewer keep
    the multiprocessors evenly loaded); :data:`WARPS` warps (fewer where K has fewer segments), or
    half as many where only the smaller blocks run the grid in one wave (``resident(threads)``:
    blocks of that many threads a multiprocessor holds, the compiled kernel's count; None: no
    such rule). A grid of few blocks that spills into a second wave runs two round trips of
    weight loads instead of one (Llama-3.1-8B's packed qkv: 384 blocks).

    Raises:
        ValueError: ``warps`` outside 1..:data:`MAX_WARPS`, ``tb`` < 1, or partials past
            :data:`SHARED_MAX`.
    """
    nseg, tiles = -(-k // SEG_K), -(-n // 16)
    if tb is None:
        tb = next((t for t in (8, 4, 2) if shared_bytes(t, k) <= SHARED_DEFAULT
                   and -(-tiles // t) >= FILL * multiprocessors()), 1)
    blocks = -(-tiles // max(tb, 1))
    if warps is None:
        warps = min(WARPS, nseg)
        half = max(1, warps // 2)
        if resident is not None and blocks > resident(32 * warps) * multiprocessors() \
                and blocks <= resident(32 * half) * multiprocessors():
            warps = half
    if not 1 <= warps <= MAX_WARPS or tb < 1 or shared_bytes(tb, k) > SHARED_MAX:
        raise ValueError(f"gemv4: {warps} warps (1..{MAX_WARPS}), {tb} tiles a block with K={k} "
                         f"({shared_bytes(tb, k)} bytes of partials, at most {SHARED_MAX})")
    return (blocks,), (32 * warps,), shared_bytes(tb, k), tb


def shape(w: layout.Int4Weights, glu_out: int = 0, warps: int | None = None, tb: int | None = None,
          units: int | None = None) -> tuple[str, tuple[tuple, tuple, int, int]]:
    """(kernel expression, :func:`config`) of a launch over ``w`` (compiles the kernel: its
    resident count picks the warps). ``units`` None: :data:`UNITS`, 1 for fp32 scales with zero
    points (whose two-unit form spills registers on sm_90)."""
    if units is None:
        units = 1 if w.zq is not None and w.scales.dtype == np.float32 else UNITS
    expr = f"gemv4<{ctype(w.scales.dtype)}, {BOOL[glu_out > 0]}, {BOOL[w.zq is not None]}, {units}>"
    kern = function("linear_gemv4", expr, EXPRS)
    return expr, config(w.n, w.k, warps, tb, kern.blocks_per_multiprocessor)


def launch(a, w: layout.Int4Weights, bias, y, m: int, null, glu_out: int = 0, *,
           warps: int | None = None, tb: int | None = None, units: int | None = None) -> None:
    """y = a @ dequant(w)^T (+ bias), or with ``glu_out`` > 0 y = silu_mul(gate, up) of a
    gate/up pair in ``_mma_layout.glu_rows`` order, as :func:`providers.cuda.ops._mma.nbits4`.
    a: fp16 [m, K] contiguous; y: fp16 [m, N or glu_out]. ``warps``, ``tb`` (:func:`config`) and
    ``units`` (1 or 2 in flight per warp, :func:`shape`) pick the launch shape, never a bit.

    Raises:
        ValueError: m outside 1..:data:`MAX_ROWS`, ``units`` not 1 or 2, or a shape
            :func:`config` refuses.
    """
    if not 1 <= m <= MAX_ROWS or units not in (None, 1, 2):
        raise ValueError(f"gemv4: {m} rows (1..{MAX_ROWS}), {units} units in flight (1 or 2)")
    n, k = w.n, w.k
    expr, (grid, block, shared, tb) = shape(w, glu_out, warps, tb, units)
    kern = function("linear_gemv4", expr, EXPRS)
    if shared > SHARED_DEFAULT and _opted.get(expr, 0) < shared:
        kern.max_dynamic_shared_size_bytes = shared
        _opted[expr] = shared
    PATHS.add("gemv4", "launches")
    kern(grid, block, (a, w.codes, w.scales, null if w.zq is None else w.zq,
                       np.int32(layout.int4_blocks(k, w.bs)), np.int32(w.bs.bit_length() - 1),
                       null if bias is None else bias, y, np.int32(m), np.int32(n), np.int32(k),
                       np.int32(glu_out), np.int32(tb)),
         shared_mem=shared)

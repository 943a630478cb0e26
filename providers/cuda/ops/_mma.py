"""Launches of kernels/linear_mma.cu (tensor-core fp16 linear, see the .cu header): the
dense and int4 GEMMs of every M of an fp16 layer, on the kernel and grid
:mod:`providers.cuda.ops._mma_schedule` picks, over the weight layouts of
:mod:`providers.cuda.ops._mma_layout`. The choice never changes a bit (the .cu header).
"""

from __future__ import annotations

import numpy as np

from providers.cuda.module import ctype, function
from providers.cuda.ops import _gemv4 as gemv4
from providers.cuda.ops import _mma_layout as layout
from providers.cuda.ops import _mma_schedule as schedule
from providers.cuda.ops import row_slices, rows_of
from providers.cuda.paths import PATHS
from providers.cuda.tuning import Tuning

#: The split-K workspace, one per device and process (allocated on the first split launch, kept
#: for the process's life: captured graphs hold its pointers; zeroed tickets, and every launch
#: leaves them at zero).
_split_workspace: dict[int, tuple] = {}
PATHS.declare("mma", ("split_launches",))
#: Dynamic shared memory above this needs the kernel's opt-in attribute.
_DEFAULT_SHARED = 48 * 1024
_opted: dict = {}


def _launch(expr: str, grid, block, args, shared: int) -> None:
    kern = function("linear_mma", expr, schedule.MODULE_OF[expr])
    if shared > _DEFAULT_SHARED and _opted.get(expr, 0) < shared:
        kern.max_dynamic_shared_size_bytes = shared
        _opted[expr] = shared
    kern(grid, block, args, shared_mem=shared)


def stats() -> dict:
    """A copy of the launcher counters: ``split_launches``, calls of the int4 launcher that
    split K (a captured graph's replays and eager launch replay do not pass the launcher and are
    not counted)."""
    return PATHS.stats("mma")


def _split_args(grid: tuple, spb: int, null) -> tuple:
    """The split-K kernel arguments (workspace partials, tickets, segments per block) of a row
    launch over ``grid``; the workspace (``_mma_schedule.SPLIT_BYTES``) is allocated on the
    first split."""
    if grid[2] == 1:
        return (null, null, np.int32(spb))
    import cupy

    device = cupy.cuda.Device().id
    ws = _split_workspace.get(device)
    if ws is None:
        ws = _split_workspace[device] = (cupy.empty(schedule.SPLIT_BYTES // 4, np.float32),
                                         cupy.zeros(schedule.SPLIT_TICKETS, np.int32))
    PATHS.add("mma", "split_launches")
    return (*ws, np.int32(spb))


def split_workspace_bytes() -> int:
    """Device bytes of the split-K workspaces this process holds (0 before the first split)."""
    return sum(a.nbytes for ws in _split_workspace.values() for a in ws)


def contiguous(ctx, a):
    """``a`` when C-contiguous, else a copy in the node's scratch buffer "a_contiguous" (the
    tensor-core kernels read A densely; activations are contiguous in practice)."""
    if a.flags.c_contiguous:
        return a
    import cupy

    from providers.cuda import replay

    replay.not_replayable()  # a CuPy copy, not a recorded Kernel launch
    buf = ctx.output("a_contiguous", a.shape, a.dtype)
    cupy.copyto(buf, a)
    return buf


def dense(a, wp, bias, y, m, n, k, null, glu: bool = False, *, tuning: Tuning):
    """y = a @ w (+ bias) for the packed weight ``wp`` (:func:`_mma_layout.pack`); with ``glu``:
    wp packs a gate/up pair and y = silu_mul(a @ w_gate, a @ w_up) (GLU, n = y's width).
    ``tuning``: the provider's switches (:class:`~providers.cuda.tuning.Tuning`)."""
    rows = layout.glu_width(n) if glu else n
    for r0, r1 in row_slices(m, 32):
        args = (rows_of(a, r0, r1, k), wp, null if bias is None else bias, rows_of(y, r0, r1, n),
                np.int32(r1 - r0), np.int32(rows), np.int32(k), np.int32(n))
        wide, tw = schedule.wide32_config(r1 - r0, rows, k, tuning=tuning), 1
        if wide is None and schedule.wide_dense_applies(r1 - r0, k, tuning=tuning):
            wide, tw = schedule.wide_config(r1 - r0, rows), 2
        if wide is not None:
            f, grid, block, shared = wide
            _launch(f"mma_wide<{f}, {schedule.BOOL[glu]}, {tw}>", grid, block, args, shared)
            continue
        pipe = schedule.pipelined(rows, False, r1 - r0, tuning=tuning)
        nj = schedule.row_nj(r1 - r0, rows, tuning=tuning)
        warps = (schedule.pipe2_warps(rows, r1 - r0) or 8) if pipe and nj == 2 else 8  # PIPE forced ("all"): 8
        grid, block, shared, _ = schedule.config(r1 - r0, rows, k, nj, pipe, warps=warps, tuning=tuning)
        _launch(f"mma_dense<{nj}, {schedule.BOOL[glu]}, {schedule.BOOL[pipe]}>", grid, block, args, shared)


def nbits4(a, w: layout.Int4Weights, bias, y, m, null, glu_out: int = 0, *, tuning: Tuning):
    """y = a @ dequant(w)^T (+ bias) for packed int4 weights ``w`` (:func:`_mma_layout.pack_int4`).
    ``glu_out`` > 0: w holds gate/up rows in :func:`_mma_layout.glu_rows` order and
    y [m, glu_out] = silu_mul(gate, up). a: fp16 [m, K] contiguous; y: fp16 [m, N or glu_out].
    ``tuning``: the provider's switches (:class:`~providers.cuda.tuning.Tuning`); with
    ``tuning.gemm_gemv`` on, 1-8 rows take ``gemv4`` (:mod:`providers.cuda.ops._gemv4`, the same bits)."""
    if gemv4.applies(m, tuning=tuning):
        gemv4.launch(a, w, bias, y, m, null, glu_out)
        return
    n, k = w.n, w.k
    s_type, zp = ctype(w.scales.dtype), schedule.BOOL[w.zq is not None]
    blocks = (np.int32(layout.int4_blocks(k, w.bs)), np.int32(w.bs.bit_length() - 1))
    width = glu_out if glu_out > 0 else n
    pipe = schedule.pipelined(n, True, tuning=tuning)
    for r0, r1 in row_slices(m, 32):
        args = (rows_of(a, r0, r1, k), w.codes, w.scales, null if w.zq is None else w.zq, *blocks,
                null if bias is None else bias, rows_of(y, r0, r1, width), np.int32(r1 - r0),
                np.int32(n), np.int32(k), np.int32(glu_out))
        wide = schedule.wide_config(r1 - r0, n, True) if schedule.wide_int4_applies(r1 - r0, k, tuning=tuning) else None
        if wide is not None:
            f, grid, block, shared = wide
            _launch(f"mma_wide4<{f}, {s_type}, {schedule.BOOL[glu_out > 0]}, {zp}>", grid, block, args, shared)
        else:
            nj = schedule.row_nj(r1 - r0, n, True, tuning=tuning)
            expr = f"mma_nbits4<{nj}, {s_type}, {schedule.BOOL[glu_out > 0]}, {schedule.BOOL[pipe]}, {zp}>"
            grid, block, shared, spb = schedule.config(r1 - r0, n, k, nj, pipe, schedule.per_multiprocessor(expr),
                                                       tuning=tuning)
            _launch(expr, grid, block, (*args, *_split_args(grid, spb, null)), shared)

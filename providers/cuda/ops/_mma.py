"""Launchers of kernels/linear_mma.cu (tensor-core fp16 linear, see the .cu header).

Used for every M of an fp16 layer (never switched by batch size); NJ (n8 token tiles per
block) follows M freely: token columns are independent inside an mma.

Dense weights are packed (:func:`pack`) once, at plan time, by the prepare hooks of MatMul,
SiluGatedMatMul and GatherColumns (:func:`prepare_dense`, core.ops): the packed form is the
one resident copy of the weight (the tied embedding's lookup gathers from it too);
:func:`unprepared` packs raw weights passed to a kernel directly.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from core.ops import PREPARE_SHARED, storage_name
from providers.cuda import env
from providers.cuda.module import ctype, function, multiprocessors
from providers.cuda.ops import MAX_GRID_Y, array_module, row_slices, rows_of

SEG_K = 256
#: Largest K of the tensor-core kernels: 64 segments (a block of at most 8 warps, each walking
#: every 8th segment; the segment partials, 64 x 16 x 32 floats at NJ = 4, fit shared memory).
MAX_K = 64 * SEG_K
_BOOL = ("false", "true")


def _schedule_exprs(pipe: str) -> tuple[str, ...]:
    return (tuple(f"mma_dense<{nj}, {glu}, {pipe}>" for nj in (1, 2, 4) for glu in _BOOL)
            + _nbits4_exprs(pipe, "false"))


def _nbits4_exprs(pipe: str, zp: str) -> tuple[str, ...]:
    return tuple(f"mma_nbits4<{nj}, {s}, {glu}, {pipe}, {zp}>" for nj in (1, 2, 4)
                 for s in ("__half", "float") for glu in _BOOL)


#: The kernels' instantiations in four modules of kernels/linear_mma.cu, each compiled on its
#: first launch: the plain schedule, the PIPE schedule, the tiled kernels, and the int4 kernels
#: with zero points (so a schedule no launch uses costs no compile time).
MODULES = (_schedule_exprs("false"), _schedule_exprs("true"),
           tuple(f"mma_wide<{f}, {glu}, {tw}>" for f in (1, 2) for glu in _BOOL for tw in (1, 2))
           + tuple(f"mma_wide4<{f}, {s}, {glu}, false>" for f in (1, 2) for s in ("__half", "float") for glu in _BOOL),
           _nbits4_exprs("false", "true") + _nbits4_exprs("true", "true")
           + tuple(f"mma_wide4<{f}, {s}, {glu}, true>" for f in (1, 2) for s in ("__half", "float") for glu in _BOOL))
EXPRS = tuple(e for module in MODULES for e in module)
_MODULE_OF = {e: module for module in MODULES for e in module}
#: Which launches take the PIPE weight-load schedule (kernels/linear_mma.cu ``PIPE``: a whole K
#: segment of weights in flight per lane, the warp's next segment loaded while the current one's
#: mmas issue, token-major grid; one-tile kernels also load the segment's activations up front):
#: "auto" (default: every int4 launch, and dense launches of one token tile per block
#: (:func:`row_nj`) or of two in one wave, :func:`pipelined`), "all" or
#: "off" (``LOCKSTEP_CUDA_GEMM_PIPELINE``). The schedule never changes an output bit. "auto"
#: because the whole segment in flight costs registers: it pays where latency bounds the launch
#: (int4, one token tile, one wave) and loses on multi-tile dense kernels.
PIPELINE = env.switch("LOCKSTEP_CUDA_GEMM_PIPELINE")
#: Which projections take the tiled kernels for launches of at least :data:`WIDE_ROWS` rows
#: (kernels/linear_mma.cu ``mma_wide`` for dense fp16, ``mma_wide4`` for int4: 64-token x
#: 64/128-feature block tiles staged in shared memory), bitwise the row kernels' results:
#: "auto" (default: dense launches, and int4 launches of at least :data:`WIDE4_ROWS` rows),
#: "dense", "all" or "off" (``LOCKSTEP_CUDA_GEMM_WIDE``). A tile reads its weights once per 64
#: rows instead of once per 8-32, which pays once the batch is large; int4 tiles start at 64
#: rows, where they measured faster than ``mma_nbits4`` on the packed layout.
WIDE = env.switch("LOCKSTEP_CUDA_GEMM_WIDE")
WIDE_ROWS = 32
#: Fewest rows of an int4 launch that takes ``mma_wide4`` under "auto" (measured from 64).
WIDE4_ROWS = 64
#: Launches of more than WIDE32_MIN_ROWS and at most 32 rows take the one-token-warp tiles
#: (``mma_wide<F, GLU, 1>``: 32 tokens x 16 F features a warp) where K is at least WIDE32_MIN_K
#: and the grid has at least WIDE32_FILL x 4 feature warps per multiprocessor (:func:`wide32_config`).
WIDE32_MIN_ROWS, WIDE32_MIN_K, WIDE32_FILL = 16, 768, 1.5
#: kernels/linear_mma.cu WIDE_STAGES, WIDE32_STAGES (``mma_wide<1, GLU, 1>``), WIDE_XS and
#: WIDE_XS4 (shared memory of mma_wide / mma_wide4).
_WIDE_STAGES, _WIDE32_STAGES, _WIDE_XS, _WIDE_XS4 = 3, 4, 72, 80
#: kernels/linear_mma.cu WIDE32_FW: feature warps of ``mma_wide<1, GLU, 1>`` (8: 128 features a
#: block, 16 a warp); the other forms have 4.
_WIDE32_FW = 8
#: Split-K of the int4 row kernel (kernels/linear_mma.cu split_last): "auto" (default) or "off"
#: (``LOCKSTEP_CUDA_GEMM_SPLIT``). Under "auto" a launch of at most 8 rows with more than 8 K
#: segments (more than one per warp) is cut into as many blocks per tile as still run in one
#: wave, at most ceil(nseg / 8) (:func:`split_count`): Llama-3.2-1B's down projection (K = 8192,
#: 32 segments, 128 tiles) at batch 1-8 gets 512 blocks, one segment per warp, instead of 128.
#: Split or not, every output bit is the same.
SPLIT = env.switch("LOCKSTEP_CUDA_GEMM_SPLIT")
#: n8 token tiles per block of the row kernels (``LOCKSTEP_CUDA_GEMM_TOKEN_TILES``): "auto"
#: (default, :func:`row_nj`'s measured rule) or "1", "2", "4" (the most per block, each up to
#: the rows' own 1 / 2 / 4). Fewer tiles per block means more blocks per weight tile, each reading
#: the tile again (from L2 when the token blocks of a tile run together, the PIPE grid); token
#: columns are independent, so this never changes a bit.
TOKEN_TILES = env.switch("LOCKSTEP_CUDA_GEMM_TOKEN_TILES")
#: Blocks per multiprocessor a row launch must still fill before :func:`row_nj` puts more token
#: tiles in a block, dense and int4 (an int4 block dequantises its weights again, so int4 needs
#: more blocks before splitting pays; the values are the measured crossovers).
FILL = {False: 1.9, True: 5.0}
#: The split-K workspace, one per device and process (allocated on the first split launch, kept
#: for the process's life: captured graphs hold its pointers): partials of at most
#: SPLIT_BYTES and SPLIT_TICKETS tile tickets (zeroed once; every launch leaves them at zero).
SPLIT_BYTES, SPLIT_TICKETS = 4 << 20, 4096
_split_workspace: dict[int, tuple] = {}
_counts = {"split_launches": 0}
#: Dynamic shared memory above this needs the kernel's opt-in attribute.
_DEFAULT_SHARED = 48 * 1024
_opted: dict = {}


def _launch(expr: str, grid, block, args, shared: int) -> None:
    kern = function("linear_mma", expr, _MODULE_OF[expr])
    if shared > _DEFAULT_SHARED and _opted.get(expr, 0) < shared:
        kern.max_dynamic_shared_size_bytes = shared
        _opted[expr] = shared
    kern(grid, block, args, shared_mem=shared)


def stats() -> dict:
    """A copy of the launcher counters: ``split_launches``, calls of the int4 launcher that
    split K (a captured graph's replays and eager launch replay do not pass the launcher and are
    not counted)."""
    return dict(_counts)


def split_count(blocks: int, nseg: int, nj: int, per_sm: int) -> int:
    """Blocks per (feature tile, token block) of an ``mma_nbits4`` launch of ``blocks`` such
    pairs over ``nseg`` K segments with NJ token tiles, of a kernel that fits ``per_sm`` blocks
    on a multiprocessor (0: never split), under :data:`SPLIT`: for NJ = 1, the most blocks that
    still run in one wave (per_sm x multiprocessors), at most ceil(nseg / 8) (one segment per
    warp), when that is at least 2 and the partials (nseg x 16 x 8 floats per pair) and tickets
    fit the workspace (:data:`SPLIT_BYTES`, :data:`SPLIT_TICKETS`); else 1.

    Only one token tile and int4: a long-K GEMV otherwise leaves most multiprocessors idle,
    while multi-tile and dense launches already fill the device and measured slower split."""
    if SPLIT == "off" or nj != 1 or nseg <= 8 or per_sm < 1:
        return 1
    splits = min(-(-nseg // 8), per_sm * multiprocessors() // blocks)
    if splits < 2 or blocks > SPLIT_TICKETS or blocks * nseg * 16 * 8 * 4 > SPLIT_BYTES:
        return 1
    return splits


def row_nj(m: int, n: int, int4: bool = False) -> int:
    """n8 token tiles per block (1, 2 or 4: 8, 16 or 32 rows) of a row-kernel launch of ``m``
    rows over ``n`` weight rows (``int4``: ``mma_nbits4``, else ``mma_dense``).

    Under "auto" (:data:`TOKEN_TILES`): the most tiles the rows fill (1 up to 8 rows, 2 up to 16,
    else 4) whose grid, ceil(n / 16) feature tiles x ceil(m / 8 NJ) token blocks, still has
    :data:`FILL` blocks per multiprocessor; where none has, 1 tile dense and 2 int4 (each int4
    block dequantises its weights again, a dense one only reads them again from L2). Why: narrow
    projections need more blocks to fill the device, wide ones read their weights fewer times
    with more tiles a block (``benchmarks/token_tiles.py`` measures the crossover)."""
    most = 1 if m <= 8 else 2 if m <= 16 else 4
    if TOKEN_TILES != "auto":
        return min(int(TOKEN_TILES), most)
    least = min(2 if int4 else 1, most)
    tiles, need = -(-n // 16), FILL[int4] * multiprocessors()
    for nj in (4, 2):
        if least <= nj <= most and tiles * -(-m // (8 * nj)) >= need:
            return nj
    return least


@functools.cache
def _per_multiprocessor(expr: str, threads: int = 256) -> int:
    """Blocks of ``threads`` threads of row kernel ``expr`` one multiprocessor holds (compiles it;
    0 where no device answers, so host-side launches never split). Once per expression and block
    size: launch paths call it on every eager launch."""
    try:
        return function("linear_mma", expr, _MODULE_OF[expr]).blocks_per_multiprocessor(threads)
    except Exception:  # noqa: BLE001 - no CuPy or no device (host-side tests)
        return 0


def config(m: int, n: int, k: int, nj: int, pipe: bool = False, per_sm: int = 0,
           warps: int = 8) -> tuple[tuple, tuple, int, int]:
    """(grid, block, shared bytes, segments per block) of a ``mma_dense`` / ``mma_nbits4`` launch
    of ``m`` rows over ``n`` weight rows and ``k`` with ``nj`` token tiles per block
    (:func:`row_nj`); the grid is (feature tiles, token blocks, splits), or (token blocks,
    feature tiles, splits) for the ``pipe`` schedule (kernels/linear_mma.cu PIPE); splits
    (``mma_nbits4`` only) from :func:`split_count` for a kernel that fits ``per_sm`` blocks per
    multiprocessor (0, the default: unsplit); a block has one warp per K segment, at most ``warps``
    (a warp walks segments w, w + warps, ...). A split launch keeps its partials in the workspace,
    not shared memory. Not cached: it reads switches (:data:`SPLIT`) and the device that tests
    change, and the caller's kernel expression must name the same ``nj``."""
    nseg = -(-k // SEG_K)
    tiles, blocks = -(-n // 16), -(-m // (8 * nj))
    splits = split_count(tiles * blocks, nseg, nj, per_sm)
    spb = -(-nseg // splits)
    grid = (blocks, tiles, splits) if pipe else (tiles, blocks, splits)
    return grid, (32 * min(spb, warps),), 0 if splits > 1 else nseg * 16 * 8 * nj * 4, spb


def _split_args(grid: tuple, spb: int, null) -> tuple:
    """The split-K kernel arguments (workspace partials, tickets, segments per block) of a row
    launch over ``grid``; the workspace (:data:`SPLIT_BYTES`) is allocated on the first split."""
    if grid[2] == 1:
        return (null, null, np.int32(spb))
    import cupy

    device = cupy.cuda.Device().id
    ws = _split_workspace.get(device)
    if ws is None:
        ws = _split_workspace[device] = (cupy.empty(SPLIT_BYTES // 4, np.float32),
                                         cupy.zeros(SPLIT_TICKETS, np.int32))
    _counts["split_launches"] += 1
    return (*ws, np.int32(spb))


def split_workspace_bytes() -> int:
    """Device bytes of the split-K workspaces this process holds (0 before the first split)."""
    return sum(a.nbytes for ws in _split_workspace.values() for a in ws)


def wide_worth(m: int, blocks: int) -> bool:
    """Whether a tiled launch of m rows over ``blocks`` blocks beats the row kernels: a tiled
    block walks all of K (about 0.6 us per 64-wide chunk on the H200), so the tiles need most
    of the multiprocessors busy (at least 0.7 blocks each), and under 64 rows only a very wide
    projection (2.25 blocks each, the lm_head) gains from reading its weights once per 64 rows
    instead of once per 32."""
    sms = multiprocessors()
    return blocks >= 0.7 * sms and (m >= 64 or blocks >= 2.25 * sms)


@functools.lru_cache(maxsize=4096)
def wide_config(m: int, n: int, int4: bool = False) -> tuple[int, tuple, tuple, int] | None:
    """(F, grid, block, shared bytes) of ``mma_wide`` (``mma_wide4`` with ``int4``) for m rows
    and n weight rows: F = 2 (128-feature blocks) when that still gives two blocks per
    multiprocessor, else F = 1; None when the tiles would not beat the row kernels
    (:func:`wide_worth`) or the feature blocks exceed the grid's y. Shared memory: WIDE_STAGES
    chunks of the activations (64 rows of WIDE_XS halves, WIDE_XS4 for int4) and of the weights
    (the packed fragments of 4 F tiles, or 32 code bytes of 64 F rows)."""
    tokens = -(-m // 64)
    f = 2 if tokens * -(-n // 128) >= 2 * multiprocessors() else 1
    features = -(-n // (64 * f))
    if features > MAX_GRID_Y or not wide_worth(m, tokens * features):
        return None
    weights, xs = (2 * 64 * f, _WIDE_XS4) if int4 else (4 * f * 128, _WIDE_XS)
    return f, (tokens, features), (256,), _WIDE_STAGES * (weights + 64 * xs // 8) * 16


def wide32_config(m: int, n: int, k: int) -> tuple[int, tuple, tuple, int] | None:
    """(F, grid, block, shared bytes) of ``mma_wide<F, GLU, 1>`` (one token warp: 32 tokens x 16 F
    features a warp; F = 1 blocks have :data:`_WIDE32_FW` feature warps, F = 2 blocks 4) for a
    dense launch of m rows over n weight rows and K = k, or None where it does not apply:
    :data:`WIDE` "off", m outside (:data:`WIDE32_MIN_ROWS`, 32], K under :data:`WIDE32_MIN_K` or
    not a multiple of 8, or fewer than :data:`WIDE32_FILL` x 4 feature warps per multiprocessor.
    F = 2 where that still gives 4 blocks per multiprocessor. Each block stages its 32 rows of
    activations once for all its features, where the row kernel's blocks read them once per 16.
    The K floor: under K = 768 the staging costs more than it saves (SmolLM2-135M's lm_head,
    K = 576, measured slower)."""
    if WIDE == "off" or not WIDE32_MIN_ROWS < m <= 32 or k < WIDE32_MIN_K or k % 8:
        return None
    sms = multiprocessors()
    f = 2 if -(-n // 128) >= 4 * sms else 1
    fw = _WIDE32_FW if f == 1 else 4
    features = -(-n // (16 * fw * f))
    if features > MAX_GRID_Y or features * fw < 4 * WIDE32_FILL * sms:
        return None
    stages = _WIDE32_STAGES if f == 1 else _WIDE_STAGES
    return f, (1, features), (32 * fw,), stages * (fw * f * 128 + 32 * _WIDE_XS // 8) * 16


def wide_dense_applies(m: int, k: int) -> bool:
    """Whether a dense launch of m rows takes ``mma_wide``: :data:`WIDE` "auto", "dense" or "all", at
    least :data:`WIDE_ROWS` rows and K a multiple of 8."""
    return WIDE != "off" and m >= WIDE_ROWS and k % 8 == 0


def wide_int4_applies(m: int, k: int) -> bool:
    """Whether an int4 launch of m rows takes ``mma_wide4``: at least :data:`WIDE_ROWS` rows
    under :data:`WIDE` "all", :data:`WIDE4_ROWS` under "auto", and K a multiple of 16 (the
    packed codes are whole 16-row x 64-k chunks)."""
    least = {"all": WIDE_ROWS, "auto": WIDE4_ROWS}.get(WIDE)
    return least is not None and m >= least and k % 16 == 0


def pipelined(n: int, int4: bool, m: int = 1) -> bool:
    """Whether a launch of ``m`` rows over ``n`` weight rows takes the PIPE schedule:
    :data:`PIPELINE` covers it ("auto": int4; dense of one token tile per block
    (:func:`row_nj`), or of two whose grid fits one wave of the PIPE kernel) and
    the feature tiles fit the grid's y (MAX_GRID_Y).

    Two tiles only in one wave: PIPE's registers halve the blocks a multiprocessor holds, so a
    grid that spills into a second wave loses more than the overlap gains (blocks of 4 warps,
    :func:`pipe2_warps`, keep more grids in one wave)."""
    if PIPELINE == "off" or -(-n // 16) > MAX_GRID_Y:
        return False
    if PIPELINE == "all" or int4:
        return True
    nj = row_nj(m, n)
    if nj > 2:
        return False
    return nj == 1 or pipe2_warps(n, m) > 0


#: Warps per block of a dense two-tile PIPE launch, most first: a launch takes the first count
#: whose grid fits one wave (:func:`pipe2_warps`). With fewer warps than K segments a warp walks
#: several, the PIPE refill loading the next while the last computes.
PIPE2_WARPS = (8, 4)
#: The two-tile PIPE row kernel (one of :data:`EXPRS`).
PIPE2_EXPR = "mma_dense<2, false, true>"


def pipe2_warps(n: int, m: int) -> int:
    """Warps per block of the two-tile PIPE row kernel for ``m`` rows (two token tiles a block)
    over ``n`` weight rows: the first of :data:`PIPE2_WARPS` whose ceil(n / 16) x ceil(m / 16)
    blocks fit one wave, or 0 where none does (the launch then takes the plain schedule)."""
    blocks = -(-n // 16) * -(-m // 16)
    for warps in PIPE2_WARPS:
        if blocks <= pipe2_per_multiprocessor(32 * warps) * multiprocessors():
            return warps
    return 0


def pipe2_per_multiprocessor(threads: int = 256) -> int:
    """Blocks of ``threads`` threads of the two-tile PIPE row kernel (``mma_dense<2, false, true>``,
    124 registers on sm_90) that fit a multiprocessor: the compiled kernel's count, or
    512 / threads where no device answers (the H200's count)."""
    return _per_multiprocessor(PIPE2_EXPR, threads) or max(1, 512 // threads)


def glu_width(n: int) -> int:
    """Rows of an interleaved gate/up pair of N features: 2 N rounded up to 16."""
    return 2 * (-(-n // 8) * 8)


def glu_rows(n: int) -> np.ndarray:
    """Row order of a gate/up pair for the GLU kernels: index i of the packed rows takes row
    ``order[i]`` of concatenate([gate, up, zero row]) (N rounded up to 8; the zero row pads).
    Rows 16b..16b+7 are gate rows 8b..8b+7 and rows 16b+8..16b+15 the same up rows. (The
    definition of the order; :func:`glu_interleave` and :func:`pack` produce it without an
    index array.)"""
    i = np.arange(glu_width(n))
    feature = (i // 16) * 8 + i % 8
    row = np.where(i % 16 < 8, feature, n + feature)
    return np.where(feature < n, row, 2 * n)


def _padded(xp, w, shape: tuple[int, ...]):
    """``w`` zero-padded at the end of each axis to ``shape``; ``w`` itself when it has that
    shape already (no copy)."""
    if tuple(w.shape) == tuple(shape):
        return w
    out = xp.zeros(shape, w.dtype)
    out[tuple(slice(0, d) for d in w.shape)] = w
    return out


def glu_interleave(xp, gate, up):
    """gate, up [N, X] (one row per output feature) -> [glu_width(N), X] in :func:`glu_rows`
    order, padding rows zero. ``xp`` is the array module (cupy on the GPU, numpy on the host).

    One output allocation and one strided copy per input (no concatenated or indexed
    intermediate), so interleaving a pair holds at most the pair and its result."""
    n, x = gate.shape[0], int(np.prod(gate.shape[1:]))
    n8 = -(-n // 8) * 8
    out = xp.empty((n8 // 8, 2, 8, x), gate.dtype)
    for half, rows in enumerate((gate, up)):
        out[:, half] = _padded(xp, rows.reshape(n, x), (n8, x)).reshape(n8 // 8, 8, x)
    return out.reshape(2 * n8, x)


#: The fragment order of :func:`pack` as axes of a reshaped weight: a K index is
#: (kc, t, v, e2, e0) = kc*64 + 16 t + 4 v + 2 e2 + e0 and an N index (nt, e1, g) =
#: nt*16 + 8 e1 + g; the packed array runs over (nt, kc, v, g, t, e2, e1, e0), last fastest:
#: 16-column tile nt, 64-row chunk kc, virtual k16 tile v, then lane 4 g + t and element
#: e = e0 + 2 e1 + 4 e2 of an m16n8k16 A fragment.
FRAGMENT_AXES = ("nt", "kc", "v", "g", "t", "e2", "e1", "e0")


def packed_size(k: int, n: int, glu: bool = False) -> int:
    """Elements of :func:`pack` for a weight [K, N] (a gate/up pair of [K, N] with ``glu``)."""
    cols = glu_width(n) if glu else -(-n // 16) * 16
    return -(-k // 64) * 64 * cols


def pack(xp, w, up=None):
    """W [K, N] fp16 in fragment order (:data:`FRAGMENT_AXES`): K padded to 64 and N to 16 with
    zeros; returns a 1-D fp16 array of :func:`packed_size` elements. With ``up`` (the up
    projection [K, N]) the columns of W and up are interleaved in :func:`glu_rows` order
    (N' = glu_width(N)): tile column 8 e1 + g is gate feature 8 nt + g for e1 = 0, the same up
    feature for e1 = 1. ``xp`` is the array module of W (numpy packs on the host, cupy on the
    device; the same reshapes and one strided copy per input on both, no index array), so
    packing holds at most the raw weight, a padded copy when K or N is not aligned, and the
    result."""
    k, n = w.shape
    kp = -(-k // 64) * 64
    if up is None:
        np_ = -(-n // 16) * 16
        src = _padded(xp, w, (kp, np_)).reshape(kp // 64, 4, 4, 2, 2, np_ // 16, 2, 8)
        return xp.ascontiguousarray(src.transpose(5, 0, 2, 7, 1, 3, 6, 4)).reshape(-1)
    n8 = -(-n // 8) * 8
    out = xp.empty((n8 // 8, kp // 64, 4, 8, 4, 2, 2, 2), xp.float16)
    for e1, half in enumerate((w, up)):
        src = _padded(xp, half, (kp, n8)).reshape(kp // 64, 4, 4, 2, 2, n8 // 8, 8)
        out[:, :, :, :, :, :, e1, :] = src.transpose(5, 0, 2, 6, 1, 3, 4)
    return out.reshape(-1)


#: ctx.cache key of a dense node whose weight prepare() packed: (K, N) of the raw weight.
PREPARED = "mma_prepared"


def prepare_dense(ctx, w, up=None, names: tuple[str, ...] = ()):
    """The prepare hook's work for MatMul (``up`` None), SiluGatedMatMul and GatherColumns: the
    packed weight where the tensor-core kernel applies to every call (fp16 W [K, N],
    K <= MAX_K, ``up`` of W's shape and dtype), recording (K, N) in ctx.cache[PREPARED]; else
    None. ``names``: the constants W (and up) are; while the plan's prepare pass shares a dict
    (``ctx.cache[core.ops.PREPARE_SHARED]``) the packing of those names is made once and the
    same object returned to every node that asks (the tied embedding and the lm_head)."""
    if (w is None or w.ndim != 2 or w.dtype != np.float16 or w.shape[0] > MAX_K
            or (up is not None and (up.shape != w.shape or up.dtype != w.dtype))):
        return None
    ctx.cache[PREPARED] = tuple(int(d) for d in w.shape)
    shared = ctx.cache.get(PREPARE_SHARED)
    key = ("mma.pack", *names) if names and all(names) and shared is not None else None
    packed = None if key is None else shared.get(key)
    if packed is None:
        packed = pack(array_module(w), w, up)
        if key is not None:
            shared[key] = packed
    return packed


def packed_offset(xp, k, n, k_total: int):
    """Offsets in :func:`pack`'s output of elements (k, n) of a dense W [K, N] (``k_total`` = K;
    broadcasting integer arrays ``k``, ``n``): the formula the column gather of
    kernels/gather.cu (``gather_packed_columns``) reads with."""
    kc_total = -(-k_total // 64)
    k, n = xp.asarray(k, xp.int64), xp.asarray(n, xp.int64)
    kc, t, v, e2, e0 = k >> 6, (k >> 4) & 3, (k >> 2) & 3, (k >> 1) & 1, k & 1
    nt, e1, g = n >> 4, (n >> 3) & 1, n & 7
    return ((((((nt * kc_total + kc) * 4 + v) * 8 + g) * 4 + t) * 2 + e2) * 2 + e1) * 2 + e0


def per_call(ctx, key: str, weights: tuple, make):
    """``make()``, the kernel's form of raw weights passed to it (no prepare: direct calls, fed
    weights), kept in ctx.cache[key] while the same objects come back: by identity, with
    references held so the ids stay unique; never by device pointer. A plan prepares its
    constant weights, so streamed weights never come here."""
    hit = ctx.cache.get(key)
    if hit is not None and len(hit[0]) == len(weights) and all(a is b for a, b in zip(hit[0], weights)):
        return hit[1]
    out = make()
    ctx.cache[key] = (weights, out)
    return out


def unprepared(ctx, w, up=None):
    """:func:`pack` of raw weights passed to the kernel (:func:`per_call`)."""
    return per_call(ctx, "mma_unprepared", (w, up), lambda: pack(array_module(w), w, up))


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


def dense(a, wp, bias, y, m, n, k, null, glu: bool = False):
    """y = a @ w (+ bias) for the packed weight ``wp`` (:func:`pack`); with ``glu``: wp packs a
    gate/up pair and y = silu_mul(a @ w_gate, a @ w_up) (GLU, n = y's width)."""
    rows = glu_width(n) if glu else n
    for r0, r1 in row_slices(m, 32):
        args = (rows_of(a, r0, r1, k), wp, null if bias is None else bias, rows_of(y, r0, r1, n),
                np.int32(r1 - r0), np.int32(rows), np.int32(k), np.int32(n))
        wide, tw = wide32_config(r1 - r0, rows, k), 1
        if wide is None and wide_dense_applies(r1 - r0, k):
            wide, tw = wide_config(r1 - r0, rows), 2
        if wide is not None:
            f, grid, block, shared = wide
            _launch(f"mma_wide<{f}, {_BOOL[glu]}, {tw}>", grid, block, args, shared)
            continue
        pipe, nj = pipelined(rows, False, r1 - r0), row_nj(r1 - r0, rows)
        warps = (pipe2_warps(rows, r1 - r0) or 8) if pipe and nj == 2 else 8  # PIPE forced ("all"): 8
        grid, block, shared, _ = config(r1 - r0, rows, k, nj, pipe, warps=warps)
        _launch(f"mma_dense<{nj}, {_BOOL[glu]}, {_BOOL[pipe]}>", grid, block, args, shared)


def int4_layout_applies(bs: int, zp_mode: int) -> bool:
    """Whether the int4 kernels compute weights of quantisation block ``bs`` and zero-point mode
    ``zp_mode`` (``matmul_nbits.zero_point_mode``): block_size at least 32 (a 32-wide k group
    has one scale) and integer zero points, absent (0) or packed uint8 (1), so q - z is an exact
    fp16 integer (kernels/linear_mma.cu, the int4 section)."""
    return bs >= 32 and zp_mode in (0, 1)


class Int4Weights(NamedTuple):
    """An int4 weight in the packed layout the tensor-core kernels read (:func:`pack_int4`;
    kernels/linear_mma.cu, the int4 section), for ``n`` weight rows (output features, or the
    glu_width(N) interleaved rows of a gate/up pair), ``k`` input features and quantisation
    block ``bs``.

    Attributes:
        codes: uint8 [16 ceil(n/16), 32 ceil(k/64)]: 512 bytes per 16-row x 64-k chunk, 16 per lane.
        scales: fp16 or fp32 (the model's) [16 ceil(n/16), :func:`int4_blocks`], per row and block.
        zq: fp16 of the scales' shape, 1024 + the zero point; None without zero points (8).
        n, k, bs: the weight's rows, K and block_size.

    The arrays are contiguous and their elements run in the packed order, not row-major: the
    kernels take them as flat pointers. Their 2-D shapes (padded rows x bytes or blocks per row)
    keep per-row byte counts right for whoever divides by rows (the kernel profile's gathered
    rows of a lookup table).
    """

    codes: Any
    scales: Any
    zq: Any
    n: int
    k: int
    bs: int


def int4_blocks(k: int, bs: int) -> int:
    """Scale blocks per row of :func:`pack_int4`'s layout: ceil(K / bs), raised to cover K
    rounded up to 64 (the model's n_blocks whenever K is a multiple of 64 and of bs)."""
    return max(-(-k // bs), -(-(-(-k // 64) * 64) // bs))


#: Rows of int4 codes :func:`pack_int4` unpacks at a time (its temporaries: 2 x rows x K bytes).
_PACK_ROWS = 4096


def pack_int4(xp, q, scales, zp, n: int, k: int, bs: int) -> Int4Weights:
    """MatMulNBits weights -> :class:`Int4Weights` (kernels/linear_mma.cu's packed layout).

    Args:
        xp: the array module of the weights (cupy on the device, numpy on the host; the same
            reshapes and copies on both).
        q: uint8 codes [n, n_blocks, bs / 2] (or [n, n_blocks * bs / 2]), two per byte, LSB first.
        scales: [n, n_blocks] (or flat), fp16 or fp32.
        zp: packed uint8 zero points [n, ceil(n_blocks / 2)] (or flat), or None (8).
        n, k, bs: rows, K and block_size (a power of two >= 32, :func:`int4_layout_applies`).

    Codes: tile nt (rows 16 nt ..), chunk c (k 64 c ..), lane (g, t), word v, nibble
    p = hi + 2 i1 + 4 i0 holds row 16 nt + 8 hi + g at k = 64 c + 16 v + 4 t + 2 i1 + i0.
    Scales and zq: [tile][block][g][hi]. Rows past n and k past K are zero codes; rows past n
    and blocks past n_blocks have zero scales (a block ending past K keeps its scale: its codes
    there are zero, and so are the activations the kernels pair them with). The codes are
    unpacked :data:`_PACK_ROWS` rows at a time, so packing holds the raw weight, the result and
    about 2 x 4,096 x K bytes more.

    Raises:
        ValueError: a layout the kernels do not compute: block_size not a power of two >= 32,
            zero points other than packed uint8 (:func:`int4_layout_applies`), or K not a
            multiple of 16.
    """
    nb, nbp = -(-k // bs), int4_blocks(k, bs)
    if bs & (bs - 1) or not int4_layout_applies(bs, 0 if zp is None else 1 if zp.dtype == np.uint8 else 2) \
            or k % 16 or (zp is not None and zp.size != n * -(-nb // 2)):
        raise ValueError(f"int4 tensor-core kernel: block_size {bs} (needs a power of two >= 32), zero points "
                         f"{None if zp is None else f'{zp.dtype}{tuple(zp.shape)}'} (needs none or packed uint8 "
                         f"[{n}, {-(-nb // 2)}]), K {k} (needs a multiple of 16)")
    tiles, chunks = -(-n // 16), -(-k // 64)
    q = q.reshape(n, nb * bs // 2)
    codes = xp.empty((tiles, chunks, 8, 4, 4, 2, 2), xp.uint8)  # (tile, chunk, g, t, v, i0, i1)
    step = _PACK_ROWS // 16
    for t0 in range(0, tiles, step):
        t1 = min(tiles, t0 + step)
        r0, r1 = 16 * t0, min(n, 16 * t1)
        block = q[r0:r1]
        nib = xp.stack((block & 15, block >> 4), axis=-1).reshape(r1 - r0, -1)  # codes in k order
        c = xp.zeros((16 * (t1 - t0), 64 * chunks), xp.uint8)
        c[:r1 - r0, :k] = nib[:, :k]
        # row 16 tile + 8 hi + g, k 64 chunk + 16 v + 4 t + 2 i1 + i0 -> (tile, chunk, g, t, v, i0, i1, hi)
        c = c.reshape(t1 - t0, 2, 8, chunks, 4, 4, 2, 2).transpose(0, 3, 2, 5, 4, 7, 6, 1)
        codes[t0:t1] = c[..., 0] | (c[..., 1] << 4)

    def per_block(values, fill):
        out = xp.full((16 * tiles, nbp), fill, values.dtype)
        out[:n, :nb] = values
        # row 16 tile + 8 hi + g, block b -> (tile, b, g, hi)
        return xp.ascontiguousarray(out.reshape(tiles, 2, 8, nbp).transpose(0, 3, 2, 1)).reshape(-1)

    zq = None
    if zp is not None:
        blk = xp.arange(nb)
        z = (zp.reshape(n, -1)[:, blk // 2] >> (4 * (blk % 2)).astype(xp.uint8)) & 15
        zq = per_block((z.astype(xp.float32) + 1024).astype(xp.float16), 1032)
    rows = 16 * tiles
    return Int4Weights(codes.reshape(rows, -1), per_block(scales.reshape(n, nb), 0).reshape(rows, -1),
                       None if zq is None else zq.reshape(rows, -1), n, k, bs)


#: ctx.cache key of an int4 node whose weights prepare() packed: (K, N, block_size) (N: the output features).
INT4_PREPARED = "int4_prepared"


def prepare_int4(ctx, q, scales, zp, n: int, k: int, bs: int, names: tuple[str, ...]) -> Int4Weights:
    """The prepare hooks' packing of raw int4 weights (MatMulNBits, the tied embedding's
    GatherBlockQuantized): :func:`pack_int4`, made once per prepare pass for one set of
    constants and the same objects returned to every hook that asks (the lm_head and the
    lookup of a tied table, whose codes are one storage under two names), so the table is
    resident once. ``names``: the constants q, scales and zp are ("" for absent zero points),
    keyed by the constants they view (``core.ops.storage_name``), never by object ids or device
    pointers (a weight a hook replaced is freed during the pass, and its id reused)."""
    shared = ctx.cache.get(PREPARE_SHARED)
    key = ("int4.pack", *(storage_name(ctx, x) if x else "" for x in names), n, k, bs)
    packed = None if shared is None else shared.get(key)
    if packed is None:
        packed = pack_int4(array_module(q), q, scales, zp, n, k, bs)
        if shared is not None:
            shared[key] = packed
    return packed


def unprepared_int4(ctx, q, scales, zp, n: int, k: int, bs: int) -> Int4Weights:
    """:func:`pack_int4` of raw weights passed to a kernel (:func:`per_call`; n, k and bs are
    the node's attributes, fixed with its weights)."""
    return per_call(ctx, "int4_unprepared", (q, scales, zp),
                    lambda: pack_int4(array_module(q), q, scales, zp, n, k, bs))


def nbits4(a, w: Int4Weights, bias, y, m, null, glu_out: int = 0):
    """y = a @ dequant(w)^T (+ bias) for packed int4 weights ``w`` (:func:`pack_int4`).
    ``glu_out`` > 0: w holds gate/up rows in :func:`glu_rows` order and y [m, glu_out] =
    silu_mul(gate, up). a: fp16 [m, K]
    contiguous; y: fp16 [m, N or glu_out]."""
    n, k = w.n, w.k
    s_type, zp = ctype(w.scales.dtype), _BOOL[w.zq is not None]
    blocks = (np.int32(int4_blocks(k, w.bs)), np.int32(w.bs.bit_length() - 1))
    width = glu_out if glu_out > 0 else n
    pipe = pipelined(n, True)
    for r0, r1 in row_slices(m, 32):
        args = (rows_of(a, r0, r1, k), w.codes, w.scales, null if w.zq is None else w.zq, *blocks,
                null if bias is None else bias, rows_of(y, r0, r1, width), np.int32(r1 - r0),
                np.int32(n), np.int32(k), np.int32(glu_out))
        wide = wide_config(r1 - r0, n, True) if wide_int4_applies(r1 - r0, k) else None
        if wide is not None:
            f, grid, block, shared = wide
            _launch(f"mma_wide4<{f}, {s_type}, {_BOOL[glu_out > 0]}, {zp}>", grid, block, args, shared)
        else:
            nj = row_nj(r1 - r0, n, True)
            expr = f"mma_nbits4<{nj}, {s_type}, {_BOOL[glu_out > 0]}, {_BOOL[pipe]}, {zp}>"
            grid, block, shared, spb = config(r1 - r0, n, k, nj, pipe, _per_multiprocessor(expr))
            _launch(expr, grid, block, (*args, *_split_args(grid, spb, null)), shared)

"""Which kernel of kernels/linear_mma.cu a tensor-core launch takes, and its grid: the
switches (``tuning``: the provider's :class:`~providers.cuda.tuning.Tuning`, passed in), the
kernel set compiled, and the measured rules (token tiles, split-K, the tiled kernels, the
pipelined schedule). Every choice computes the same arithmetic in the same order, so none changes an output bit.
"""

from __future__ import annotations

import functools

from providers.cuda.module import function, multiprocessors
from providers.cuda.ops import MAX_GRID_Y
from providers.cuda.ops._mma_layout import SEG_K
from providers.cuda.tuning import Tuning

#: A bool template argument as C++ spells it, by Python truth (``BOOL[flag]``).
BOOL = ("false", "true")


def _schedule_exprs(pipe: str) -> tuple[str, ...]:
    return (tuple(f"mma_dense<{nj}, {glu}, {pipe}>" for nj in (1, 2, 4) for glu in BOOL)
            + _nbits4_exprs(pipe, "false"))


def _nbits4_exprs(pipe: str, zp: str) -> tuple[str, ...]:
    return tuple(f"mma_nbits4<{nj}, {s}, {glu}, {pipe}, {zp}>" for nj in (1, 2, 4)
                 for s in ("__half", "float") for glu in BOOL)


#: The kernels' instantiations in four modules of kernels/linear_mma.cu, each compiled on its
#: first launch: the plain schedule, the PIPE schedule, the tiled kernels, and the int4 kernels
#: with zero points (so a schedule no launch uses costs no compile time).
MODULES = (_schedule_exprs("false"), _schedule_exprs("true"),
           tuple(f"mma_wide<{f}, {glu}, {tw}>" for f in (1, 2) for glu in BOOL for tw in (1, 2))
           + tuple(f"mma_wide4<{f}, {s}, {glu}, false>" for f in (1, 2) for s in ("__half", "float") for glu in BOOL),
           _nbits4_exprs("false", "true") + _nbits4_exprs("true", "true")
           + tuple(f"mma_wide4<{f}, {s}, {glu}, true>" for f in (1, 2) for s in ("__half", "float") for glu in BOOL))
EXPRS = tuple(e for module in MODULES for e in module)
MODULE_OF = {e: module for module in MODULES for e in module}
#: The switches (PIPE, the tiled kernels, split-K, token tiles) come from the provider's
#: :class:`~providers.cuda.tuning.Tuning` (``tuning``, passed in; its docstring says what each
#: does). None of them changes an output bit.

#: Fewest rows of a launch that takes the tiled kernels (``tuning.gemm_wide``).
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
#: Split-K (``tuning.gemm_split`` "auto"): a launch of at most 8 rows with more than 8 K
#: segments is cut into as many blocks per tile as still run in one wave, at most ceil(nseg / 8)
#: (:func:`split_count`): Llama-3.2-1B's down projection (K = 8192, 32 segments, 128 tiles) at
#: batch 1-8 gets 512 blocks, one segment per warp, instead of 128.
#: Blocks per multiprocessor a row launch must still fill before :func:`row_nj` puts more token
#: tiles in a block, dense and int4 (an int4 block dequantises its weights again, so int4 needs
#: more blocks before splitting pays; the values are the measured crossovers).
FILL = {False: 1.9, True: 5.0}
#: Size of the split-K workspace (``_mma._split_args``): partials of at most SPLIT_BYTES and
#: SPLIT_TICKETS tile tickets.
SPLIT_BYTES, SPLIT_TICKETS = 4 << 20, 4096


def split_count(blocks: int, nseg: int, nj: int, per_sm: int, *, tuning: Tuning) -> int:
    """Blocks per (feature tile, token block) of an ``mma_nbits4`` launch of ``blocks`` such
    pairs over ``nseg`` K segments with NJ token tiles, of a kernel that fits ``per_sm`` blocks
    on a multiprocessor (0: never split), under ``tuning.gemm_split``: for NJ = 1, the most blocks that
    still run in one wave (per_sm x multiprocessors), at most ceil(nseg / 8) (one segment per
    warp), when that is at least 2 and the partials (nseg x 16 x 8 floats per pair) and tickets
    fit the workspace (:data:`SPLIT_BYTES`, :data:`SPLIT_TICKETS`); else 1.

    Only one token tile and int4: a long-K GEMV otherwise leaves most multiprocessors idle,
    while multi-tile and dense launches already fill the device and measured slower split."""
    if tuning.gemm_split == "off" or nj != 1 or nseg <= 8 or per_sm < 1:
        return 1
    splits = min(-(-nseg // 8), per_sm * multiprocessors() // blocks)
    if splits < 2 or blocks > SPLIT_TICKETS or blocks * nseg * 16 * 8 * 4 > SPLIT_BYTES:
        return 1
    return splits


def row_nj(m: int, n: int, int4: bool = False, *, tuning: Tuning) -> int:
    """n8 token tiles per block (1, 2 or 4: 8, 16 or 32 rows) of a row-kernel launch of ``m``
    rows over ``n`` weight rows (``int4``: ``mma_nbits4``, else ``mma_dense``).

    Under "auto" (``tuning.gemm_token_tiles``): the most tiles the rows fill (1 up to 8 rows, 2 up to 16,
    else 4) whose grid, ceil(n / 16) feature tiles x ceil(m / 8 NJ) token blocks, still has
    :data:`FILL` blocks per multiprocessor; where none has, 1 tile dense and 2 int4 (each int4
    block dequantises its weights again, a dense one only reads them again from L2). Why: narrow
    projections need more blocks to fill the device, wide ones read their weights fewer times
    with more tiles a block (``benchmarks/token_tiles.py`` measures the crossover)."""
    most = 1 if m <= 8 else 2 if m <= 16 else 4
    if tuning.gemm_token_tiles != "auto":
        return min(int(tuning.gemm_token_tiles), most)
    least = min(2 if int4 else 1, most)
    tiles, need = -(-n // 16), FILL[int4] * multiprocessors()
    for nj in (4, 2):
        if least <= nj <= most and tiles * -(-m // (8 * nj)) >= need:
            return nj
    return least


@functools.cache
def per_multiprocessor(expr: str, threads: int = 256) -> int:
    """Blocks of ``threads`` threads of row kernel ``expr`` one multiprocessor holds (compiles it;
    0 where no device answers, so host-side launches never split). Once per expression and block
    size: launch paths call it on every eager launch."""
    try:
        return function("linear_mma", expr, MODULE_OF[expr]).blocks_per_multiprocessor(threads)
    except Exception:  # noqa: BLE001 - no CuPy or no device (host-side tests)
        return 0


def config(m: int, n: int, k: int, nj: int, pipe: bool = False, per_sm: int = 0,
           warps: int = 8, *, tuning: Tuning) -> tuple[tuple, tuple, int, int]:
    """(grid, block, shared bytes, segments per block) of a ``mma_dense`` / ``mma_nbits4`` launch
    of ``m`` rows over ``n`` weight rows and ``k`` with ``nj`` token tiles per block
    (:func:`row_nj`); the grid is (feature tiles, token blocks, splits), or (token blocks,
    feature tiles, splits) for the ``pipe`` schedule (kernels/linear_mma.cu PIPE); splits
    (``mma_nbits4`` only) from :func:`split_count` for a kernel that fits ``per_sm`` blocks per
    multiprocessor (0, the default: unsplit); a block has one warp per K segment, at most ``warps``
    (a warp walks segments w, w + warps, ...). A split launch keeps its partials in the workspace,
    not shared memory. Not cached: it reads ``tuning.gemm_split`` and the device that tests
    change, and the caller's kernel expression must name the same ``nj``."""
    nseg = -(-k // SEG_K)
    tiles, blocks = -(-n // 16), -(-m // (8 * nj))
    splits = split_count(tiles * blocks, nseg, nj, per_sm, tuning=tuning)
    spb = -(-nseg // splits)
    grid = (blocks, tiles, splits) if pipe else (tiles, blocks, splits)
    return grid, (32 * min(spb, warps),), 0 if splits > 1 else nseg * 16 * 8 * nj * 4, spb


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


def wide32_config(m: int, n: int, k: int, *, tuning: Tuning) -> tuple[int, tuple, tuple, int] | None:
    """(F, grid, block, shared bytes) of ``mma_wide<F, GLU, 1>`` (one token warp: 32 tokens x 16 F
    features a warp; F = 1 blocks have :data:`_WIDE32_FW` feature warps, F = 2 blocks 4) for a
    dense launch of m rows over n weight rows and K = k, or None where it does not apply:
    ``tuning.gemm_wide`` "off", m outside (:data:`WIDE32_MIN_ROWS`, 32], K under :data:`WIDE32_MIN_K` or
    not a multiple of 8, or fewer than :data:`WIDE32_FILL` x 4 feature warps per multiprocessor.
    F = 2 where that still gives 4 blocks per multiprocessor. Each block stages its 32 rows of
    activations once for all its features, where the row kernel's blocks read them once per 16.
    The K floor: under K = 768 the staging costs more than it saves (SmolLM2-135M's lm_head,
    K = 576, measured slower)."""
    if tuning.gemm_wide == "off" or not WIDE32_MIN_ROWS < m <= 32 or k < WIDE32_MIN_K or k % 8:
        return None
    sms = multiprocessors()
    f = 2 if -(-n // 128) >= 4 * sms else 1
    fw = _WIDE32_FW if f == 1 else 4
    features = -(-n // (16 * fw * f))
    if features > MAX_GRID_Y or features * fw < 4 * WIDE32_FILL * sms:
        return None
    stages = _WIDE32_STAGES if f == 1 else _WIDE_STAGES
    return f, (1, features), (32 * fw,), stages * (fw * f * 128 + 32 * _WIDE_XS // 8) * 16


def wide_dense_applies(m: int, k: int, *, tuning: Tuning) -> bool:
    """Whether a dense launch of m rows takes ``mma_wide``: ``tuning.gemm_wide`` "auto", "dense" or "all", at
    least :data:`WIDE_ROWS` rows and K a multiple of 8."""
    return tuning.gemm_wide != "off" and m >= WIDE_ROWS and k % 8 == 0


def wide_int4_applies(m: int, k: int, *, tuning: Tuning) -> bool:
    """Whether an int4 launch of m rows takes ``mma_wide4``: at least :data:`WIDE_ROWS` rows
    under ``tuning.gemm_wide`` "all", :data:`WIDE4_ROWS` under "auto", and K a multiple of 16 (the
    packed codes are whole 16-row x 64-k chunks)."""
    least = {"all": WIDE_ROWS, "auto": WIDE4_ROWS}.get(tuning.gemm_wide)
    return least is not None and m >= least and k % 16 == 0


def pipelined(n: int, int4: bool, m: int = 1, *, tuning: Tuning) -> bool:
    """Whether a launch of ``m`` rows over ``n`` weight rows takes the PIPE schedule:
    ``tuning.gemm_pipeline`` covers it ("auto": int4; dense of one token tile per block
    (:func:`row_nj`), or of two whose grid fits one wave of the PIPE kernel) and
    the feature tiles fit the grid's y (MAX_GRID_Y).

    Two tiles only in one wave: PIPE's registers halve the blocks a multiprocessor holds, so a
    grid that spills into a second wave loses more than the overlap gains (blocks of 4 warps,
    :func:`pipe2_warps`, keep more grids in one wave)."""
    if tuning.gemm_pipeline == "off" or -(-n // 16) > MAX_GRID_Y:
        return False
    if tuning.gemm_pipeline == "all" or int4:
        return True
    nj = row_nj(m, n, tuning=tuning)
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
    return per_multiprocessor(PIPE2_EXPR, threads) or max(1, 512 // threads)



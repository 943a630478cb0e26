"""The weight layouts of the tensor-core kernels (kernels/linear_mma.cu): dense fp16 weights
packed in mma fragment order (:func:`pack`), gate/up pairs interleaved (:func:`glu_rows`), int4
MatMulNBits weights packed for the tensor cores (:func:`pack_int4`).

Weights are packed once, at plan time, by the prepare hooks of MatMul, SiluGatedMatMul,
GatherColumns, MatMulNBits and the tied embedding's lookup (:func:`prepare_dense`,
:func:`prepare_int4`, core.ops): the packed form is the one resident copy of the weight (the
tied embedding's lookup gathers from it too); :func:`unprepared` and :func:`unprepared_int4`
pack raw weights passed to a kernel directly.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from core.ops import PREPARE_SHARED, Spec, memo, storage_name
from providers.cuda.ops import array_module

#: K segment of the tensor-core kernels (kernels/linear_mma.cu SEG_K): each output's partial
#: sums run per segment, a function of K alone.
SEG_K = 256
#: Largest K of the tensor-core kernels: 64 segments (a block of at most 8 warps, each walking
#: every 8th segment; the segment partials, 64 x 16 x 32 floats at NJ = 4, fit shared memory).
MAX_K = 64 * SEG_K


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


#: Rows of a packed tile (the tensor-core kernels' 16 output features per warp tile; a gate/up
#: pair's tile holds 8 features of each).
ROW_TILE = 16


def packed_shape(k: int, n: int, glu: bool = False) -> tuple[int, ...]:
    """The shape :func:`prepare_dense` gives :func:`pack`'s elements for a weight [K, N] (a
    gate/up pair with ``glu``): ``(R, ceil(K / 64), 64)`` when N is a multiple of
    :data:`ROW_TILE`, R the packed rows (N, or the 2 N interleaved gate/up rows), so a block of
    whole 16-row tiles is a range of the leading axis, contiguous, and that axis gives N (the
    row-block pages, providers/cuda/streaming.dense_rows); else flat (:func:`packed_size`).
    Row r of the 3-D form is not weight row r: the elements of tile r // 16 run in fragment
    order over its 16 rows (:data:`FRAGMENT_AXES`); only whole tiles are ranges of rows."""
    if n % ROW_TILE:
        return (packed_size(k, n, glu),)
    return (glu_width(n) if glu else n, -(-k // 64), 64)


def packed_rows(w, glu: bool = False) -> int | None:
    """The output features N of a packed weight in the 3-D form of :func:`packed_shape` (the
    interleaved rows / 2 with ``glu``), None for a flat one (N not a multiple of 16: the
    node's N is in ctx.cache[PREPARED])."""
    if w is None or w.ndim != 3:
        return None
    return int(w.shape[0]) // 2 if glu else int(w.shape[0])


def pack(xp, w, up=None):
    """W [K, N] fp16 in fragment order (:data:`FRAGMENT_AXES`): K padded to 64 and N to 16 with
    zeros; returns a 1-D fp16 array of :func:`packed_size` elements. With ``up`` (the up
    projection [K, N]) the columns of W and up are interleaved in :func:`glu_rows` order
    (N' = glu_width(N)): tile column 8 e1 + g is gate feature 8 nt + g for e1 = 0, the same up
    feature for e1 = 1. ``xp`` is the array module of W (numpy packs on the host, cupy on the
    device; the same reshapes and strided copies on both, no index array), so packing holds at
    most the raw weight, a padded copy when K or N is not aligned, and the result (on the host,
    written once: :func:`pack_into`)."""
    k, n = w.shape
    out = xp.empty(packed_size(k, n, up is not None), xp.float16)
    pack_into(xp, w, up, out)
    return out


#: Tiles (16 output rows) one host gather of :func:`pack_into` packs: its index is this many
#: tiles' 1024 elements (8 bytes each), small enough to stay in cache beside the block.
HOST_TILES = 16


@functools.lru_cache(maxsize=8)
def _fragment_index(tiles: int, glu: bool) -> np.ndarray:
    """The source element of each packed element of ``tiles`` tiles of one 64-row chunk of K,
    into the block ``(half, k row, column)`` those tiles read (one half, or gate and up with
    ``glu``; ``16 tiles`` columns a half, or 8 tiles with ``glu``), in packed order
    ``(nt, v, g, t, e2, e1, e0)`` (:data:`FRAGMENT_AXES`): column 8 nt + g of half e1 for a
    gate/up pair, else column 16 nt + 8 e1 + g."""
    width = (8 if glu else 16) * tiles
    nt, v, g, t, e2, e1, e0 = np.ix_(*(np.arange(d) for d in (tiles, 4, 8, 4, 2, 2, 2)))
    row = 16 * t + 4 * v + 2 * e2 + e0
    column = e1 * 64 * width + 8 * nt + g if glu else 16 * nt + 8 * e1 + g
    return (row * width + column).reshape(-1).astype(np.intp)


def pack_into(xp, w, up, out) -> None:
    """:func:`pack` written into ``out`` (1-D fp16, :func:`packed_size` elements, the caller's:
    a pinned buffer would let a streamed weight be written once; the hooks do not pass one
    yet, docs/large-models.md Limits). On the device one
    strided copy per input. On the host (``xp`` numpy) per 64-row chunk of K and
    :data:`HOST_TILES` tiles: the tiles' columns copied into a small block (runs of 128 or 256
    contiguous elements), one gather of the block in packed order (``np.take`` over a fixed
    index, :func:`_fragment_index`), one copy of those whole 2 KiB tiles into ``out``; the
    chunks spread over threads (NumPy's take and copies release the GIL), so the
    host holds the result and a few small temporaries. Every element is
    copied, never computed: the bits are the transpose's whatever the split."""
    k, n = w.shape
    kp = -(-k // 64) * 64
    kc = kp // 64
    cols = -(-n // 8) * 8 if up is not None else -(-n // 16) * 16
    srcs = [_padded(xp, half, (kp, cols)) for half in ((w,) if up is None else (w, up))]
    dst = out.reshape(-1, kc, 1024)  # (tile, chunk, its 16 x 64 elements in fragment order)
    if xp is not np:  # one strided copy per input, into the fragment axes of ``out``
        frag = out.reshape(-1, kc, 4, 8, 4, 2, 2, 2)
        for e1, src in enumerate(srcs):
            if up is None:  # (kc, t, v, e2, e0, nt, e1, g) -> (nt, kc, v, g, t, e2, e1, e0)
                frag[...] = src.reshape(kc, 4, 4, 2, 2, cols // 16, 2, 8).transpose(5, 0, 2, 7, 1, 3, 6, 4)
            else:  # (kc, t, v, e2, e0, nt, g) -> (nt, kc, v, g, t, e2, e0) at e1
                frag[:, :, :, :, :, :, e1, :] = src.reshape(kc, 4, 4, 2, 2, cols // 8, 8).transpose(5, 0, 2, 6, 1, 3, 4)
        return
    width = 8 if up is not None else 16  # columns of one half a tile holds

    def chunk(c: int) -> None:
        rows = [src[64 * c:64 * (c + 1)] for src in srcs]
        block = np.empty((len(rows), 64, HOST_TILES * width), np.uint16)
        for t0 in range(0, cols // width, HOST_TILES):
            m = min(HOST_TILES, cols // width - t0)
            part = block[:, :, :m * width] if m == HOST_TILES else np.empty((len(rows), 64, m * width), np.uint16)
            for half, r in zip(part, rows):  # the tiles' columns, contiguous and in cache
                half[...] = np.asarray(r[:, t0 * width:(t0 + m) * width]).view(np.uint16)
            # every index is in range ("wrap" skips the bounds pass)
            got = np.take(part.reshape(-1), _fragment_index(m, up is not None), mode="wrap")
            dst[t0:t0 + m, c] = got.view(np.float16).reshape(m, 1024)

    workers = min(kc, os.cpu_count() or 1, 16)
    if workers <= 1:
        for c in range(kc):
            chunk(c)
        return
    with ThreadPoolExecutor(workers) as pool:
        for _ in pool.map(chunk, range(kc)):
            pass


#: ctx.cache key of a dense node whose weight prepare() packed: (K, N) of the raw weight.
PREPARED = "mma_prepared"


def prepare_dense(ctx, w, up=None, names: tuple[str, ...] = ()):
    """The prepare hook's work for MatMul (``up`` None), SiluGatedMatMul and GatherColumns: the
    packed weight where the tensor-core kernel applies to every call (fp16 W [K, N],
    K <= MAX_K, ``up`` of W's shape and dtype), recording (K, N) in ctx.cache[PREPARED]; else
    None. The packed weight has :func:`packed_shape` (3-D when N is a multiple of 16: its
    leading axis gives N, and whole 16-row tiles are row blocks). ``names``: the constants W
    (and up) are; while the plan's prepare pass shares a dict (``ctx.cache[core.ops.PREPARE_SHARED]``)
    the packing of those names is made once and the same object returned to every node that
    asks (the tied embedding and the lm_head)."""
    if not dense_applies(w, up):
        return None
    k, n = (int(d) for d in w.shape)
    ctx.cache[PREPARED] = (k, n)
    shared = ctx.cache.get(PREPARE_SHARED)
    key = dense_key(names) if shared is not None else None
    packed = None if key is None else shared.get(key)
    if packed is None:
        packed = pack(array_module(w), w, up).reshape(packed_shape(k, n, up is not None))
        if key is not None:
            shared[key] = packed
    return packed


def dense_applies(w, up=None) -> bool:
    """Whether :func:`prepare_dense` packs ``w`` (and ``up``): an fp16 W [K, N] with K <=
    MAX_K, ``up`` of its shape and dtype (arrays or :class:`core.ops.Spec`)."""
    return not (w is None or w.ndim != 2 or w.dtype != np.float16 or w.shape[0] > MAX_K
                or (up is not None and (tuple(up.shape) != tuple(w.shape) or up.dtype != w.dtype)))


def dense_key(names: tuple[str, ...]) -> tuple | None:
    """The key under which a prepare pass shares the packing of constants ``names`` (None: the
    packing is not shared, a name is absent)."""
    return ("mma.pack", *names) if names and all(names) else None


def dense_spec(w, up=None, names: tuple[str, ...] = ()) -> Spec | None:
    """What :func:`prepare_dense` returns for W (and ``up``) described by their
    :class:`core.ops.Spec`: the packed weight's Spec (keyed as the pass shares it), or None."""
    if not dense_applies(w, up):
        return None
    k, n = w.shape
    return Spec(packed_shape(k, n, up is not None), np.float16, dense_key(names))


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
    weights), kept (:func:`core.ops.memo` under ``key``) while the same objects come back. A plan prepares its
    constant weights, so streamed weights never come here."""
    return memo(ctx, key, weights, make)


def unprepared(ctx, w, up=None):
    """:func:`pack` of raw weights passed to the kernel (:func:`per_call`)."""
    return per_call(ctx, "mma_unprepared", (w, up), lambda: pack(array_module(w), w, up))


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
    if not int4_packs(zp, n, k, bs):
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


def int4_packs(zp, n: int, k: int, bs: int) -> bool:
    """Whether :func:`pack_int4` packs weights of ``n`` rows, K ``k`` and block_size ``bs`` with
    zero points ``zp`` (an array, a :class:`core.ops.Spec` or None): block_size a power of two
    >= 32, zero points absent or packed uint8 [n, ceil(n_blocks / 2)], K a multiple of 16."""
    nb = -(-k // bs)
    return not (bs & (bs - 1) or not int4_layout_applies(bs, 0 if zp is None else 1 if zp.dtype == np.uint8 else 2)
                or k % 16 or (zp is not None and zp.size != n * -(-nb // 2)))


def int4_specs(scale_dtype, zp, n: int, k: int, bs: int, key: tuple | None = None) -> Int4Weights:
    """The :class:`core.ops.Spec` of each array :func:`pack_int4` makes (shapes and dtypes from
    its layout; keys ``(*key, part)``, None without ``key``), or ValueError where it raises."""
    if not int4_packs(zp, n, k, bs):
        raise ValueError(f"int4 tensor-core kernel: no packed layout for block_size {bs}, K {k}")
    rows, nbp = 16 * -(-n // 16), int4_blocks(k, bs)

    def part(name: str):
        return None if key is None else (*key, name)

    return Int4Weights(Spec((rows, 32 * -(-k // 64)), np.uint8, part("codes")), Spec((rows, nbp), scale_dtype,
                       part("scales")), None if zp is None else Spec((rows, nbp), np.float16, part("zq")), n, k, bs)


def int4_key(storage: tuple[str, ...], n: int, k: int, bs: int) -> tuple:
    """The key under which a prepare pass shares the packing of the constants whose storages
    are ``storage`` (codes, scales, zero points; "" for absent ones)."""
    return ("int4.pack", *storage, n, k, bs)


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
    key = int4_key(tuple(storage_name(ctx, x) if x else "" for x in names), n, k, bs)
    packed = None if shared is None else shared.get(key)
    if packed is None:
        packed = pack_int4(array_module(q), q, scales, zp, n, k, bs)
        if shared is not None:
            shared[key] = packed
    return packed


def int4_form(names: tuple[str, ...], specs, n: int, k: int, bs: int) -> Int4Weights:
    """What :func:`prepare_int4` returns, from the :class:`core.ops.Spec` of the codes, scales
    and zero points (``specs``; None for absent zero points) read through constants ``names``:
    their Specs, keyed as the pass shares them (each Spec's key is its constant's storage name).

    Raises:
        ValueError: where :func:`pack_int4` raises."""
    storage = tuple((spec.key or name) if name and spec is not None else "" for name, spec in zip(names, specs))
    return int4_specs(specs[1].dtype, specs[2], n, k, bs, int4_key(storage, n, k, bs))


def unprepared_int4(ctx, q, scales, zp, n: int, k: int, bs: int) -> Int4Weights:
    """:func:`pack_int4` of raw weights passed to a kernel (:func:`per_call`; n, k and bs are
    the node's attributes, fixed with its weights)."""
    return per_call(ctx, "int4_unprepared", (q, scales, zp),
                    lambda: pack_int4(array_module(q), q, scales, zp, n, k, bs))



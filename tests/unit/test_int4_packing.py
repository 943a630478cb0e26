"""The packed int4 layout of the cuda provider (``_mma_layout.pack_int4``), checked on the host: what the
tensor-core kernels and the packed lookup read from it is the raw MatMulNBits weight.

The kernels' reads are emulated in NumPy with their own index arithmetic
(kernels/linear_mma.cu ``load_chunk4`` / ``mma4_chunk``, kernels/gather.cu
``gather_packed_int4``); the GPU tests (tests/cuda/test_gemm_pipeline.py) check the kernels'
results against a float64 product."""

import numpy as np
import pytest

from core.executor import storage
from core.ops import PREPARE_SHARED, STORAGE_NAMES
from core.protocol import KernelContext, NodeInfo
from providers.cuda.ops import _mma_layout, gather_block_quantized, matmul_nbits


def _raw(rng, n, k, bs, zp):
    nb = -(-k // bs)
    q = rng.integers(0, 256, (n, nb, bs // 2), dtype=np.uint8)
    s = (rng.random((n, nb)) * 0.02 + 0.001).astype(np.float16)
    z = rng.integers(0, 256, (n, -(-nb // 2)), dtype=np.uint8) if zp else None
    return q, s, z


def _codes(q, n):
    """[n, n_blocks * bs] codes of raw MatMulNBits bytes (two per byte, LSB first)."""
    return np.stack((q & 15, q >> 4), -1).reshape(n, -1).astype(np.int64)


def _zero_points(z, n, nb):
    return np.full((n, nb), 8) if z is None else _codes(z, n)[:, :nb]


def _fragments(w: _mma_layout.Int4Weights):
    """What each lane's registers hold, read as the kernel reads them: {(tile, chunk, lane, v, j):
    (a[j] low half, a[j] high half)} as codes (the 0x6400 exponent bits taken off)."""
    chunks = -(-w.k // 64)
    words = w.codes.view(np.uint32).reshape(-1, chunks, 32, 4)
    halves = {}
    for j in range(4):
        b = ((words >> np.uint32(4 * j)) & np.uint32(0x000F000F)) | np.uint32(0x64006400)
        halves[j] = ((b & 0xFFFF) - 0x6400, (b >> 16) - 0x6400)
    return halves


@pytest.mark.parametrize("n,k,bs,zp", [(48, 256, 32, False), (40, 352, 32, True), (33, 576, 64, False),
                                       (16, 320, 128, True), (24, 64, 32, False), (33, 96, 64, True),
                                       (20, 80, 64, False), (48, 320, 256, True)])
def test_the_kernels_fragments_are_the_raw_codes_scales_and_zero_points(n, k, bs, zp):
    rng = np.random.default_rng(n + k + bs)
    q, s, z = _raw(rng, n, k, bs, zp)
    w = _mma_layout.pack_int4(np, q, s, z, n, k, bs)
    tiles, chunks, nb, nbp = -(-n // 16), -(-k // 64), -(-k // bs), _mma_layout.int4_blocks(k, bs)
    codes = np.zeros((16 * tiles, 64 * chunks), np.int64)
    codes[:n, :k] = _codes(q, n)[:, :k]
    halves = _fragments(w)
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    for v in range(4):
        k0 = 64 * np.arange(chunks)[None, :, None] + 16 * v + 4 * t[None, None, :]  # [1, chunk, lane]
        rows = 16 * np.arange(tiles)[:, None, None] + g[None, None, :]  # [tile, 1, lane]
        # a[0], a[2]: row g at k (+0, +1), (+2, +3); a[1], a[3]: row g + 8 (mma m16n8k16 A fragment)
        for j, (dr, dk) in enumerate(((0, 0), (8, 0), (0, 2), (8, 2))):
            lo, hi = (h[:, :, :, v] for h in halves[j])
            assert np.array_equal(lo, codes[rows + dr, k0 + dk]) and np.array_equal(hi, codes[rows + dr, k0 + dk + 1])
    # scales and zero points of group h of chunk c for lane (g, t): load_scales4's index
    scales = w.scales.reshape(tiles, nbp, 8, 2)
    zq = None if w.zq is None else w.zq.reshape(tiles, nbp, 8, 2)
    want_z = _zero_points(z, n, nb)
    for c in range(chunks):
        for h in range(2):
            blk = (64 * c + 32 * h) // bs
            for hi in range(2):
                rows = 16 * np.arange(tiles)[:, None] + 8 * hi + np.arange(8)[None, :]
                live = (rows < n) & (blk < nb)  # a block ending past K keeps its scale (zero codes there)
                got = scales[:, blk, :, hi]
                assert not got[~live].any()  # padding rows and blocks: zero scales
                if blk >= nb:
                    continue
                assert np.array_equal(got[live], s[rows[live], blk])
                if zq is not None:
                    assert np.array_equal(zq[:, blk, :, hi][live].astype(np.int64) - 1024, want_z[rows[live], blk])


def test_an_emulated_kernel_product_is_the_dequantised_product():
    """y = sum over 32-wide groups of (sum of (q - z) x) * s, read through the fragments: the
    kernels' arithmetic on the packed layout (float64 here) equals x @ dequant(W)^T."""
    rng = np.random.default_rng(5)
    n, k, bs = 40, 352, 32
    q, s, z = _raw(rng, n, k, bs, True)
    w = _mma_layout.pack_int4(np, q, s, z, n, k, bs)
    x = rng.standard_normal(k)
    nb = -(-k // bs)
    dq = (_codes(q, n) - np.repeat(_zero_points(z, n, nb), bs, 1)) * np.repeat(s.astype(np.float64), bs, 1)
    want = dq[:, :k] @ x
    tiles, chunks, nbp = -(-n // 16), -(-k // 64), _mma_layout.int4_blocks(k, bs)
    xp = np.zeros(64 * chunks)
    xp[:k] = x
    halves = _fragments(w)
    scales = w.scales.reshape(tiles, nbp, 8, 2).astype(np.float64)
    zq = w.zq.reshape(tiles, nbp, 8, 2).astype(np.float64) - 1024
    y = np.zeros(16 * tiles)
    for tile in range(tiles):
        for c in range(chunks):
            for lane in range(32):
                g, t = divmod(lane, 4)
                for v in range(4):
                    blk = (64 * c + 16 * v) // bs
                    kk = 64 * c + 16 * v + 4 * t
                    for j, (hi, dk) in enumerate(((0, 0), (1, 0), (0, 2), (1, 2))):
                        lo, hi_half = (h[tile, c, lane, v] for h in halves[j])
                        zero = zq[tile, blk, g, hi]
                        d = (lo - zero) * xp[kk + dk] + (hi_half - zero) * xp[kk + dk + 1]
                        y[16 * tile + 8 * hi + g] += d * scales[tile, blk, g, hi]
    assert np.allclose(y[:n], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("zp", [False, True])
def test_the_packed_lookup_reads_the_raw_rows(zp):
    """kernels/gather.cu gather_packed_int4's index arithmetic on the packed table gives the raw
    table's dequantised rows (gather_block_quantized's values)."""
    rng = np.random.default_rng(7)
    v, d, bs = 70, 192, 64
    q, s, z = _raw(rng, v, d, bs, zp)
    w = _mma_layout.pack_int4(np, q, s, z, v, d, bs)
    nbp, lbs, nc = _mma_layout.int4_blocks(d, bs), bs.bit_length() - 1, -(-d // 64)
    rows = np.array([0, 9, 17, 69, 33])
    col = np.arange(d)
    r = rows[:, None]
    nt, hi, g = r >> 4, (r >> 3) & 1, r & 7
    t, vt, i0, i1 = (col >> 2) & 3, (col >> 4) & 3, col & 1, (col >> 1) & 1
    codes, scales = w.codes.reshape(-1), w.scales.reshape(-1)  # the kernel reads flat pointers
    byte = codes[((nt * nc + (col >> 6)) * 32 + g * 4 + t) * 16 + vt * 4 + 2 * i0 + i1]
    code = (byte >> (4 * hi)) & 15
    si = ((nt * nbp + (col >> lbs)) * 8 + g) * 2 + hi
    zero = 8.0 if w.zq is None else w.zq.reshape(-1)[si].astype(np.float32) - 1024
    got = ((code.astype(np.float32) - zero) * scales[si].astype(np.float32)).astype(np.float16)
    nb = -(-d // bs)
    want = ((_codes(q, v)[rows, :d] - np.repeat(_zero_points(z, v, nb), bs, 1)[rows, :d]).astype(np.float32)
            * np.repeat(s.astype(np.float32), bs, 1)[rows, :d]).astype(np.float16)
    assert np.array_equal(got, want)


def test_aligned_weights_pack_to_their_own_bytes():
    """One resident copy: for K a multiple of 64 and of the block, N of 16, the packed codes,
    scales and zero points take exactly the raw bytes (zq: one fp16 per block per row, for the
    raw half byte)."""
    rng = np.random.default_rng(1)
    for n, k, bs in ((64, 2048, 32), (32, 576, 64), (16, 1024, 128)):
        q, s, z = _raw(rng, n, k, bs, True)
        w = _mma_layout.pack_int4(np, q, s, z, n, k, bs)
        assert w.codes.nbytes == q.nbytes and w.scales.nbytes == s.nbytes and w.zq.size == s.size
        assert _mma_layout.int4_blocks(k, bs) == k // bs
        # shaped rows x per-row bytes, so a lookup's rows are counted at their size
        assert w.codes.shape == (n, k // 2) and w.scales.shape == s.shape and w.codes.flags.c_contiguous


def _ctx(op, inputs, attrs, dtypes, shared):
    node = NodeInfo(name=op, op_type=op, domain="com.microsoft", attrs=attrs, inputs=tuple(inputs), outputs=("y",),
                    input_dtypes=tuple(dtypes))
    ctx = KernelContext(node, None, "head_major")
    ctx.cache[PREPARE_SHARED] = shared
    return ctx


def test_a_tied_table_and_its_lm_head_share_one_packed_weight():
    """The builder's tied int4 embedding: the lookup reads a reshaped view of the lm_head's codes
    and the same scales. Both hooks of one prepare pass return the same packed objects (keyed by
    the names of the constants viewed), so the executor keeps one table; another weight of the
    same shape, freed and replaced during the pass, never finds it."""
    rng = np.random.default_rng(3)
    v, d, bs = 64, 128, 32
    q, s, _ = _raw(rng, v, d, bs, False)
    table = q.reshape(v, d // 2)  # a view: the folded Reshape of a device provider
    assert storage(table) is storage(q)
    # the pass's storage names (core.executor: the view is named by the constant it views)
    shared: dict = {STORAGE_NAMES: {"q": "q", "q2": "q", "s": "s", "q3": "q3"}}
    attrs = {"K": d, "N": v, "bits": 4, "block_size": bs}
    head = matmul_nbits.prepare(_ctx("MatMulNBits", ("x", "q", "s"), attrs, (np.float16,), shared), None, q, s)
    lookup_ctx = _ctx("GatherBlockQuantized", ("q2", "ids", "s"), {"bits": 4, "block_size": bs}, (np.uint8,), shared)
    lookup = gather_block_quantized.prepare(lookup_ctx, table, None, s)
    assert head[1] is lookup[0] and head[2] is lookup[2]
    assert lookup_ctx.cache[gather_block_quantized.PREPARED] == (v, d, bs)
    # a table of another storage is packed on its own
    other = gather_block_quantized.prepare(
        _ctx("GatherBlockQuantized", ("q3", "ids", "s"), {"bits": 4, "block_size": bs}, (np.uint8,), shared),
        table.copy(), None, s)
    assert other[0] is not head[1] and np.array_equal(other[0], head[1])
    # 8-bit tables and fp32 scales keep the raw layout
    for attrs8, scales in (({"bits": 8, "block_size": bs}, s), ({"bits": 4, "block_size": bs}, s.astype(np.float32))):
        ctx = _ctx("GatherBlockQuantized", ("q4", "ids", "s"), attrs8, (np.uint8,), shared)
        assert gather_block_quantized.prepare(ctx, table, None, scales) is None

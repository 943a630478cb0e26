"""The opt-in GEMM schedules of kernels/linear_mma.cu on the GPU, each bitwise the default kernels
and each seen to run:

- PIPE (``Tuning.gemm_pipeline``, set to "all": whole segments of weights in flight, token-major grid) for dense,
  gate/up (GLU) and int4 kernels, at row counts of every token tiling (NJ = 1,
  2, 4) and K that end inside a segment, fill it, and take several segments per warp; the
  two-tile dense kernel also in blocks of 8, 4 and 2 warps (``sched.PIPE2_WARPS``);
- mma_wide / mma_wide4 (``Tuning.gemm_wide``, set to "all": 64-token tiles staged in shared memory) for dense, GLU
  and int4 launches of 64 rows and more (int4: zero points absent or packed, fp16 and fp32 scales,
  quantisation blocks of 32 to 128), both feature widths (F = 1, 2), rows and features that do
  not fill a tile;

- split-K (``Tuning.gemm_split``: a tile's K segments over several blocks, the last one folding the
  partials from the workspace) for int4 and int4 gate/up launches of 1-8 rows, under both
  schedules, back to back (the tickets are left at zero), and captured in a CUDA graph and
  replayed, with programmatic dependent launch off and on;

and all agree with a float64 product within fp16 rounding."""

import numpy as np
import pytest
from _gpu import require_gpu
from attrs import evolve

cupy = require_gpu()

from providers.cuda.ops import NULL, _mma, _mma_layout  # noqa: E402
from providers.cuda.ops import _mma_schedule as sched  # noqa: E402
from providers.cuda.tuning import Tuning  # noqa: E402

#: The switches the launches of the running test take (``TUNED["t"]``, a
#: :class:`~providers.cuda.tuning.Tuning` each test constructs from the defaults).
TUNED: dict[str, Tuning] = {"t": Tuning()}

SHAPES = [(1, 64, 40), (3, 576, 72), (8, 2048, 48), (9, 2304, 32), (17, 4864, 16), (40, 8192, 24), (256, 1024, 80)]
#: K that end inside a 64-wide chunk (the dense kernels' zero tails; int4 needs K % 16 == 0 and
#: takes 352 = 11 x 32: a partial chunk and an odd number of quantisation blocks)
DENSE_TAILS = [(5, 200, 24), (2, 40, 16), (130, 328, 40)]
INT4_TAILS = [(5, 352, 24), (70, 352, 40)]


@pytest.fixture(autouse=True)
def _default_tuning():
    """Every test starts from the default switches."""
    TUNED["t"] = Tuning()


@pytest.fixture
def ran(monkeypatch):
    """Expressions of the tensor-core kernels launched, in order; the opt-in schedules start off
    whatever the environment says (each test turns on the one it checks)."""
    TUNED["t"] = evolve(TUNED["t"], gemm_pipeline="off")
    TUNED["t"] = evolve(TUNED["t"], gemm_wide="off")
    seen = []
    launch = _mma._launch

    def recording(expr, *args, **kw):
        seen.append(expr)
        launch(expr, *args, **kw)

    monkeypatch.setattr(_mma, "_launch", recording)
    return seen


def _both(monkeypatch, ran, call):
    """``call()``'s result under the plain and the pipelined schedule, checking which ran."""
    out = []
    for pipe in (False, True):
        TUNED["t"] = evolve(TUNED["t"], gemm_pipeline="all" if pipe else "off")
        del ran[:]
        out.append(call().get())
        assert ran and all(_pipe_of(e) == sched.BOOL[pipe] for e in ran)
    return out


def _pipe_of(expr: str) -> str:
    """The PIPE template argument of a row-kernel expression (mma_dense's 3rd, mma_nbits4's 4th)."""
    args = expr[expr.index("<") + 1:-1].split(", ")
    return args[2] if expr.startswith("mma_dense<") else args[3]


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("m,k,n", SHAPES + DENSE_TAILS)
def test_pipelined_dense_is_bitwise_the_plain_schedule(monkeypatch, ran, m, k, n, glu):
    rng = np.random.default_rng(k + n)
    a = rng.standard_normal((m, k)).astype(np.float16)
    w, up = (rng.standard_normal((k, n)).astype(np.float16) * np.float16(k ** -0.5) for _ in range(2))
    wp = cupy.asarray(_mma_layout.pack(np, w, up if glu else None))
    da = cupy.asarray(a)

    def call():
        y = cupy.full((m, n), np.nan, np.float16)
        _mma.dense(da, wp, None, y, m, n, k, NULL, glu=glu, tuning=TUNED["t"])
        return y

    plain, piped = _both(monkeypatch, ran, call)
    assert np.array_equal(plain.view(np.uint16), piped.view(np.uint16))
    if not glu:
        ref = a.astype(np.float64) @ w.astype(np.float64)
        assert np.allclose(piped, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("m,k,n", [(9, 2304, 32), (17, 4864, 16), (32, 8192, 24), (13, 200, 24), (20, 100, 16),
                                   (30, 1000, 40), (25, 36, 16)])
def test_token_tiles_and_schedules_of_the_row_kernel_are_bitwise_one_tile(monkeypatch, ran, m, k, n, glu):
    """The dense row kernel with 1, 2 and 4 token tiles a block, plain and PIPE (the launcher takes
    PIPE for two tiles where the grid fits one wave, sched.pipelined): bitwise the one-tile plain
    kernel, for rows that do not fill a tile, K that ends inside a chunk and K % 8 != 0."""
    rng = np.random.default_rng(k + n + m)
    a = cupy.asarray(rng.standard_normal((m, k)).astype(np.float16))
    w, up = (rng.standard_normal((k, n)).astype(np.float16) * np.float16(k ** -0.5) for _ in range(2))
    wp = cupy.asarray(_mma_layout.pack(np, w, up if glu else None))
    out = []
    for nj, pipeline in (("1", "off"), ("2", "off"), ("4", "off"), ("2", "all"), ("4", "all")):
        TUNED["t"] = evolve(TUNED["t"], gemm_token_tiles=nj)
        TUNED["t"] = evolve(TUNED["t"], gemm_pipeline=pipeline)
        del ran[:]
        y = cupy.full((m, n), np.nan, np.float16)
        _mma.dense(a, wp, None, y, m, n, k, NULL, glu=glu, tuning=TUNED["t"])
        tiles = min(int(nj), 1 if m <= 8 else 2 if m <= 16 else 4)
        assert ran == [f"mma_dense<{tiles}, {sched.BOOL[glu]}, {sched.BOOL[pipeline == 'all']}>"]
        out.append(y.get().view(np.uint16))
    assert all(np.array_equal(out[0], o) for o in out[1:])
    assert not np.isnan(out[0].view(np.float16)).any()


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("m,k,n", [(32, 8192, 24), (20, 2304, 40), (17, 1000, 16), (30, 200, 24)])
def test_two_tile_pipe_blocks_of_fewer_warps_than_segments_are_bitwise_the_plain_kernel(monkeypatch, ran, m, k, n, glu):
    """The two-tile PIPE row kernel in blocks of 8, 4 and 2 warps (``sched.PIPE2_WARPS``; the
    launcher gives Llama-3.2-1B's qkv at 32 rows 4): with fewer warps than K segments each warp
    walks several, its PIPE refill loading the next; bitwise the plain two-tile kernel, and each
    block size seen to run."""
    rng = np.random.default_rng(k + n + m + 1)
    a = cupy.asarray(rng.standard_normal((m, k)).astype(np.float16))
    w, up = (rng.standard_normal((k, n)).astype(np.float16) * np.float16(k ** -0.5) for _ in range(2))
    wp = cupy.asarray(_mma_layout.pack(np, w, up if glu else None))
    TUNED["t"] = evolve(TUNED["t"], gemm_token_tiles="2")
    blocks, inner = [], _mma._launch

    def launch(expr, grid, block, args, shared):
        blocks.append(block[0])
        inner(expr, grid, block, args, shared)

    monkeypatch.setattr(_mma, "_launch", launch)
    nseg, out = -(-k // _mma_layout.SEG_K), []
    for pipeline, warps in (("off", 8), ("auto", 8), ("auto", 4), ("auto", 2)):
        TUNED["t"] = evolve(TUNED["t"], gemm_pipeline=pipeline)
        monkeypatch.setattr(sched, "PIPE2_WARPS", (warps,))
        del ran[:], blocks[:]
        y = cupy.full((m, n), np.nan, np.float16)
        _mma.dense(a, wp, None, y, m, n, k, NULL, glu=glu, tuning=TUNED["t"])
        assert ran == [f"mma_dense<2, {sched.BOOL[glu]}, {sched.BOOL[pipeline == 'auto']}>"]
        assert blocks == [32 * min(nseg, warps)]
        out.append(y.get().view(np.uint16))
    assert all(np.array_equal(out[0], o) for o in out[1:])
    assert not np.isnan(out[0].view(np.float16)).any()


class Int4Case:
    """Random MatMulNBits operands (codes 2 per byte, low nibble first; scales; zero points
    absent = 8 or packed 2 per byte, the layouts of the tensor-core kernels) on the device, and
    ``a @ w^T`` in float64."""

    def __init__(self, rng, m, k, n, bs, scale_dtype, zp_mode):
        nb = -(-k // bs)
        codes = rng.integers(0, 256, (n, nb, bs // 2), dtype=np.uint8)
        scales = (rng.random((n, nb)) * 0.02).astype(scale_dtype)
        q = np.stack([codes & 15, codes >> 4], -1).reshape(n, nb, bs).astype(np.float64)
        if zp_mode == 0:
            zps, z = None, np.full((n, nb, 1), 8.0)
        else:
            zps = rng.integers(0, 256, (n, -(-nb // 2)), dtype=np.uint8)
            z = np.stack([zps & 15, zps >> 4], -1).reshape(n, -1)[:, :nb, None].astype(np.float64)
        w = ((q - z) * scales.astype(np.float64)[:, :, None]).reshape(n, -1)[:, :k]
        a = rng.standard_normal((m, k)).astype(np.float16)
        self.ref = a.astype(np.float64) @ w.T
        self.m, self.k, self.n, self.bs, self.zp_mode = m, k, n, bs, zp_mode
        self.a, self.codes, self.scales = cupy.asarray(a), cupy.asarray(codes), cupy.asarray(scales)
        self.zp = NULL if zps is None else cupy.asarray(zps)
        self.s_type = "__half" if scale_dtype == np.float16 else "float"
        #: the operands packed on the device, as the prepare hooks do (_mma_layout.pack_int4)
        self.w = _mma_layout.pack_int4(cupy, self.codes, self.scales, None if zps is None else self.zp, n, k, bs)
        self.zp_flag = sched.BOOL[zps is not None]

    def __call__(self):
        """y = a @ dequant(codes)^T through ``_mma.nbits4`` (fp16 [m, n], NaN-poisoned first)."""
        y = cupy.full((self.m, self.n), np.nan, np.float16)
        _mma.nbits4(self.a, self.w, None, y, self.m, NULL, tuning=TUNED["t"])
        return y

    def close(self, y) -> bool:
        return np.allclose(y, self.ref, rtol=2e-2, atol=2e-2 * np.abs(self.ref).max())


@pytest.mark.parametrize("zp", [0, 1])
@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("m,k,n", SHAPES + INT4_TAILS)
def test_pipelined_int4_is_bitwise_the_plain_schedule(monkeypatch, ran, m, k, n, scale_dtype, zp):
    case = Int4Case(np.random.default_rng(k * 3 + n), m, k, n, 32, scale_dtype, zp)
    plain, piped = _both(monkeypatch, ran, case)
    assert np.array_equal(plain.view(np.uint16), piped.view(np.uint16))
    assert case.close(piped)


def _rows_and_wide(monkeypatch, ran, f, call, wide_expr, row_prefix):
    """``call()``'s result by the row kernels and by the tiled one at feature width ``f``,
    checking which kernels ran: the multiprocessor count decides F (0 makes every launch F = 2,
    a huge count F = 1), and the tiles are taken even where they would be slower."""
    monkeypatch.setattr(sched, "multiprocessors", lambda: 0 if f == 2 else 1 << 30)
    monkeypatch.setattr(sched, "wide_worth", lambda m, blocks: True)  # tiles wherever they apply
    sched.wide_config.cache_clear()
    out = []
    try:
        for wide in (False, True):
            TUNED["t"] = evolve(TUNED["t"], gemm_wide="all" if wide else "off")
            del ran[:]
            out.append(call().get())
            if wide:
                assert ran == [wide_expr]
            else:
                assert ran and all(e.startswith(row_prefix) for e in ran)
    finally:
        sched.wide_config.cache_clear()
    return out


@pytest.mark.parametrize("f", [1, 2])
@pytest.mark.parametrize("glu,bias", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("m,k,n", [(64, 64, 16), (100, 576, 200), (256, 2048, 136), (300, 4864, 72), (130, 328, 40),
                                   (17, 64, 16), (24, 576, 200), (32, 2048, 136), (32, 4864, 72), (29, 328, 40)])
def test_wide_kernel_is_bitwise_the_row_kernel(monkeypatch, ran, m, k, n, glu, bias, f):
    """mma_wide against the row kernels of the same rows: the 64-token blocks (TW = 2) from 64
    rows, the one-token-warp blocks (TW = 1, sched.wide32_config, taken here wherever they apply)
    for 17 to 32 rows."""
    tw = 1 if m <= 32 else 2
    if tw == 1:
        monkeypatch.setattr(sched, "WIDE32_FILL", 0)
        monkeypatch.setattr(sched, "WIDE32_MIN_K", 0)
    rng = np.random.default_rng(m + k + n + (tw == 1))
    a = rng.standard_normal((m, k)).astype(np.float16)
    w, up = (rng.standard_normal((k, n)).astype(np.float16) * np.float16(k ** -0.5) for _ in range(2))
    b = rng.standard_normal(n).astype(np.float16) if bias else None
    wp = cupy.asarray(_mma_layout.pack(np, w, up if glu else None))
    da, db = cupy.asarray(a), None if b is None else cupy.asarray(b)

    def call():
        y = cupy.full((m, n), np.nan, np.float16)
        _mma.dense(da, wp, db, y, m, n, k, NULL, glu=glu, tuning=TUNED["t"])
        return y

    out = _rows_and_wide(monkeypatch, ran, f, call, f"mma_wide<{f}, {sched.BOOL[glu]}, {tw}>", "mma_dense<")
    assert np.array_equal(out[0].view(np.uint16), out[1].view(np.uint16))
    if not glu:
        ref = a.astype(np.float64) @ w.astype(np.float64) + (0 if b is None else b.astype(np.float64))
        assert np.allclose(out[1], ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("f", [1, 2])
@pytest.mark.parametrize("zp,scale_dtype", [(0, np.float16), (1, np.float16), (1, np.float32)])
@pytest.mark.parametrize("m,k,n,bs", [(64, 64, 16, 32), (100, 576, 200, 128), (256, 2048, 136, 32),
                                      (300, 4864, 72, 64), (70, 352, 40, 32)])
def test_wide_int4_kernel_is_bitwise_the_row_kernel(monkeypatch, ran, m, k, n, bs, zp, scale_dtype, f):
    case = Int4Case(np.random.default_rng(m + k + n + zp), m, k, n, bs, scale_dtype, zp)
    wide = f"mma_wide4<{f}, {case.s_type}, false, {case.zp_flag}>"
    out = _rows_and_wide(monkeypatch, ran, f, case, wide, "mma_nbits4<")
    assert np.array_equal(out[0].view(np.uint16), out[1].view(np.uint16))
    assert case.close(out[1])


@pytest.mark.parametrize("f", [1, 2])
@pytest.mark.parametrize("glu", [False, True])
def test_wide_int4_gate_up_and_bias_are_bitwise_the_row_kernel(monkeypatch, ran, f, glu):
    m, k, n, bs = 100, 576, 40, 32
    rows = _mma_layout.glu_width(n) if glu else n  # GLU: gate and up rows interleaved, as prepared
    case = Int4Case(np.random.default_rng(11 + glu), m, k, rows, bs, np.float16, 1)
    bias = None if glu else cupy.asarray(np.random.default_rng(3).standard_normal(n).astype(np.float16))

    def call():
        y = cupy.full((m, n), np.nan, np.float16)
        _mma.nbits4(case.a, case.w, bias, y, m, NULL, glu_out=n if glu else 0, tuning=TUNED["t"])
        return y

    out = _rows_and_wide(monkeypatch, ran, f, call, f"mma_wide4<{f}, __half, {sched.BOOL[glu]}, true>", "mma_nbits4<")
    assert np.array_equal(out[0].view(np.uint16), out[1].view(np.uint16))
    if not glu:
        assert case.close(out[1] - bias.get().astype(np.float64))


def _bitwise(outs) -> bool:
    return all(np.array_equal(outs[0].view(np.uint16), o.view(np.uint16)) for o in outs[1:])


def _split_and_unsplit(monkeypatch, ran, call):
    """``call()``'s results with split-K off, then on (twice: the second launch finds the
    tickets the first left), checking that every launch with it on was split."""
    out = []
    for split in ("off", "auto", "auto"):
        TUNED["t"] = evolve(TUNED["t"], gemm_split=split)
        before = _mma.stats()["split_launches"]
        del ran[:]
        out.append(call().get())
        assert ran and _mma.stats()["split_launches"] - before == (len(ran) if split == "auto" else 0)
    return out


#: (m, k, n): 9, 18 and 32 K segments (2, 3 and 4 blocks per tile, the last one short), rows of
#: the one-tile launches (NJ = 1), a K ending inside a chunk.
SPLIT_SHAPES = [(1, 2304, 40), (5, 4608, 24), (8, 8192, 16), (3, 4400, 24)]


@pytest.mark.parametrize("pipe", [False, True])
@pytest.mark.parametrize("zp", [0, 1])
@pytest.mark.parametrize("m,k,n", SPLIT_SHAPES)
def test_split_k_int4_is_bitwise_the_unsplit_kernel(monkeypatch, ran, m, k, n, zp, pipe):
    TUNED["t"] = evolve(TUNED["t"], gemm_pipeline="all" if pipe else "off")
    case = Int4Case(np.random.default_rng(k * 5 + n), m, k, n, 32, np.float16, zp)
    outs = _split_and_unsplit(monkeypatch, ran, case)
    assert _bitwise(outs)
    assert case.close(outs[0])


def test_split_k_int4_gate_up_is_bitwise_the_unsplit_kernel(monkeypatch, ran):
    n, k = 40, 4608
    rows = _mma_layout.glu_width(n)
    case = Int4Case(np.random.default_rng(11), 1, k, rows, 32, np.float32, 0)

    def call():
        y = cupy.full((1, n), np.nan, np.float16)
        _mma.nbits4(case.a, case.w, None, y, 1, NULL, glu_out=n, tuning=TUNED["t"])
        return y

    assert _bitwise(_split_and_unsplit(monkeypatch, ran, call))



@pytest.mark.parametrize("pdl", [False, True])
def test_split_k_int4_captured_and_replayed_is_bitwise_the_unsplit_kernel(monkeypatch, ran, pdl):
    """Split launches captured in a CUDA graph, after an eager warm-up has made the workspace
    (as the capture policy does), and replayed three times give the unsplit kernel's bits each
    time: the tickets are reset inside the graph too. With ``pdl`` the captured launches go
    through cuLaunchKernelEx with the programmatic attribute (counted)."""
    from providers.cuda import replay

    n, k = 48, 8192
    case = Int4Case(np.random.default_rng(23), 1, k, n, 32, np.float16, 1)
    TUNED["t"] = evolve(TUNED["t"], gemm_pipeline="all")
    stream = cupy.cuda.Stream(non_blocking=True)
    y = cupy.full((1, n), np.nan, np.float16)

    def launch():
        _mma.nbits4(case.a, case.w, None, y, 1, NULL, tuning=TUNED["t"])

    monkeypatch.setattr(replay, "_rows", 1)  # launches as a one-row node makes them (the PDL rows rule)
    rule = replay.pdl_rows(evolve(TUNED["t"], pdl=pdl))  # the launching provider's rule under that Tuning
    if pdl and rule is None:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 and cuda-bindings")
    before_pdl = replay.use_pdl(rule)
    try:
        with stream:
            TUNED["t"] = evolve(TUNED["t"], gemm_split="off")
            launch()
            unsplit = y.get()
            TUNED["t"] = evolve(TUNED["t"], gemm_split="auto")
            launch()  # the eager warm-up: allocates the workspace
            splits, pdl_launches = _mma.stats()["split_launches"], replay.stats()["pdl_launches"]
            stream.begin_capture()
            launch()
            graph = stream.end_capture()
            assert _mma.stats()["split_launches"] == splits + 1
            assert (replay.stats()["pdl_launches"] > pdl_launches) == pdl
            replays = []
            for _ in range(3):
                y.fill(np.nan)
                graph.launch(stream)
                replays.append(y.get())
    finally:
        replay.use_pdl(before_pdl)
    assert _bitwise([unsplit, *replays])
    assert case.close(unsplit)

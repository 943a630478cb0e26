"""The cuda ops' plan-time prepare hooks, checked without a GPU: the hooks run on numpy
arrays, and a launch recorder stands in for the kernels, so the prepared path is seen to
launch the same kernel with the same (packed) arguments as the unprepared path. The GPU tests
(tests/cuda) check the kernels' results."""

import numpy as np
import pytest
from attrs import evolve

from core.protocol import KernelContext, NodeInfo
from providers.cuda.ops import _mma, _mma_layout, matmul, matmul_nbits, silu_gated_matmul, silu_gated_matmul_nbits
from providers.cuda.ops import _mma_schedule as sched
from providers.cuda.tuning import Tuning

#: The default switches; a test that needs others constructs them (``evolve(DEFAULT, ...)``).
DEFAULT = Tuning()


class HostMemory:
    """Just enough provider for KernelContext.output (zero-filled numpy buffers) and the
    launchers (its ``tuning``)."""

    def __init__(self, tuning: Tuning):
        self.tuning = tuning

    def allocate(self, shape, dtype, zero=False):
        return np.zeros(shape, dtype)


def _ctx(op, inputs, attrs=None, dtypes=(), tuning=DEFAULT):
    node = NodeInfo(name=op, op_type=op, domain="", attrs=attrs or {}, inputs=tuple(inputs), outputs=("y",),
                    input_dtypes=tuple(dtypes))
    return KernelContext(node, HostMemory(tuning), "head_major")


@pytest.fixture
def launches(monkeypatch):
    """Launches of _mma kernels as (expression, grid, block, args, shared)."""
    record = []

    def function(name, expression, expressions):
        return lambda grid, block, args, shared_mem=0: record.append((expression, grid, block, args, shared_mem))

    monkeypatch.setattr(_mma, "function", function)
    monkeypatch.setattr(silu_gated_matmul, "is_host", lambda x: x is None)  # numpy stands in for device arrays
    return record


def _same_launch(a, b):
    assert a[0] == b[0] and a[1] == b[1] and a[2] == b[2] and a[4] == b[4]
    assert len(a[3]) == len(b[3])
    for x, y in zip(a[3], b[3]):
        assert np.array_equal(np.asarray(x), np.asarray(y)) and np.asarray(x).dtype == np.asarray(y).dtype


def test_matmul_prepare_packs_fp16_weights_only():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((100, 37)).astype(np.float16)
    ctx = _ctx("MatMul", ("a", "w"))
    changes = matmul.prepare(ctx, None, w)
    assert set(changes) == {1} and np.array_equal(changes[1], _mma_layout.pack(np, w))
    assert changes[1].shape == (128 * 48,) and ctx.cache[_mma_layout.PREPARED] == (100, 37)
    for other in (w.astype(np.float32), np.zeros((_mma_layout.MAX_K + 1, 8), np.float16), None):
        ctx = _ctx("MatMul", ("a", "w"))
        assert matmul.prepare(ctx, None, other) is None and _mma_layout.PREPARED not in ctx.cache


@pytest.mark.parametrize("m", [1, 5, 33])
def test_prepared_matmul_launches_what_the_unprepared_one_does(launches, m):
    rng = np.random.default_rng(m)
    a = rng.standard_normal((1, m, 100)).astype(np.float16)
    w = rng.standard_normal((100, 37)).astype(np.float16)
    (y_raw,) = matmul.run(_ctx("MatMul", ("a", "w")), a, w)
    ctx = _ctx("MatMul", ("a", "w"))
    (y,) = matmul.run(ctx, a, matmul.prepare(ctx, None, w)[1])
    assert y.shape == y_raw.shape == (1, m, 37) and launches[0][0].startswith("mma_dense<")
    _same_launch(launches[0], launches[1])


def test_prepared_gated_matmul_launches_what_the_unprepared_one_does(launches):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 64)).astype(np.float16)
    wg, wu = (rng.standard_normal((64, 52)).astype(np.float16) for _ in range(2))
    silu_gated_matmul.run(_ctx("SiluGatedMatMul", ("x", "wg", "wu")), x, wg, wu)
    ctx = _ctx("SiluGatedMatMul", ("x", "wg", "wu"))
    changes = silu_gated_matmul.prepare(ctx, None, wg, wu)
    assert set(changes) == {1, 2} and changes[2] is None
    assert np.array_equal(changes[1], _mma_layout.pack(np, wg, wu))
    silu_gated_matmul.run(ctx, x, changes[1], None)
    pipe = sched.pipelined(_mma_layout.glu_width(52), False, 3, tuning=DEFAULT)
    assert launches[0][0] == f"mma_dense<1, true, {sched.BOOL[pipe]}>"
    _same_launch(launches[0], launches[1])


def _nbits(rng, n, k, bs, zp):
    nb = k // bs
    b = rng.integers(0, 256, (n, nb, bs // 2), dtype=np.uint8)
    s = (rng.random((n, nb)) * 0.02).astype(np.float16)
    z = rng.integers(0, 256, (n, -(-nb // 2)), dtype=np.uint8) if zp else None
    return b, s, z


@pytest.mark.parametrize("zp", [False, True])
def test_prepared_gated_nbits_interleaves_once_and_launches_what_the_unprepared_one_does(launches, zp):
    rng = np.random.default_rng(2)
    n, k, bs = 52, 128, 32
    gate, up = _nbits(rng, n, k, bs, zp), _nbits(rng, n, k, bs, zp)
    names = ("x", "bg", "sg", "zg" if zp else "", "bu", "su", "zu" if zp else "")
    attrs = {"K": k, "N": n, "bits": 4, "block_size": bs}
    x = rng.standard_normal((4, k)).astype(np.float16)
    op = "SiluGatedMatMulNBits"
    silu_gated_matmul_nbits.run(_ctx(op, names, attrs, (np.float16,)), x, *gate, *up)
    ctx = _ctx(op, names, attrs, (np.float16,))
    changes = silu_gated_matmul_nbits.prepare(ctx, None, *gate, *up)
    assert set(changes) == ({1, 2, 3, 4, 5, 6} if zp else {1, 2, 4, 5})
    assert all(changes[j] is None for j in changes if j > 3)
    # the pair interleaved in glu_rows order, then packed for the kernel
    b, sc, z = (None if g is None else _mma_layout.glu_interleave(np, g.reshape(n, -1), u.reshape(n, -1))
                for g, u in zip(gate, up))
    want = _mma_layout.pack_int4(np, b, sc, z, _mma_layout.glu_width(n), k, bs)
    for j, field in ((1, want.codes), (2, want.scales)) + (((3, want.zq),) if zp else ()):
        assert np.array_equal(changes[j], field) and changes[j].dtype == field.dtype
    assert ctx.cache[silu_gated_matmul_nbits.PREPARED] == (k, n, bs)
    prepared = [changes.get(j) for j in (1, 2, 3)]
    silu_gated_matmul_nbits.run(ctx, x, *prepared, None, None, None)
    pipe = sched.BOOL[sched.pipelined(2 * n, True, tuning=DEFAULT)]
    assert launches[0][0] == f"mma_nbits4<1, __half, true, {pipe}, {sched.BOOL[zp]}>"
    _same_launch(launches[0], launches[1])


@pytest.mark.parametrize("zp", [False, True])
def test_prepared_nbits_packs_once_and_launches_what_the_unprepared_one_does(launches, zp):
    rng = np.random.default_rng(12)
    n, k, bs = 48, 256, 64
    b, sc, z = _nbits(rng, n, k, bs, zp)
    names = ("a", "b", "s", "z" if zp else "")
    attrs = {"K": k, "N": n, "bits": 4, "block_size": bs}
    a = rng.standard_normal((3, k)).astype(np.float16)
    matmul_nbits.run(_ctx("MatMulNBits", names, attrs, (np.float16,)), a, b, sc, z)
    ctx = _ctx("MatMulNBits", names, attrs, (np.float16,))
    changes = matmul_nbits.prepare(ctx, None, b, sc, z)
    want = _mma_layout.pack_int4(np, b, sc, z, n, k, bs)
    assert set(changes) == ({1, 2, 3} if zp else {1, 2}) and ctx.cache[_mma_layout.INT4_PREPARED] == (k, n, bs)
    assert np.array_equal(changes[1], want.codes) and np.array_equal(changes[2], want.scales)
    # the packed bytes are the raw bytes (K a multiple of 64 and bs, N of 16: nothing padded)
    assert changes[1].nbytes == b.nbytes and changes[2].nbytes == sc.nbytes
    matmul_nbits.run(ctx, a, changes[1], changes[2], changes.get(3))
    assert launches[0][0].startswith("mma_nbits4<1, __half, false, ")
    _same_launch(launches[0], launches[1])
    # fed weights, fp32 activations and g_idx are left alone
    assert matmul_nbits.prepare(_ctx("MatMulNBits", names, attrs, (np.float16,)), None, None, sc, z) is None
    assert matmul_nbits.prepare(_ctx("MatMulNBits", names, attrs, (np.float32,)), None, b, sc, z) is None
    with_g_idx = ("a", "b", "s", "z" if zp else "", "g")
    assert matmul_nbits.prepare(_ctx("MatMulNBits", with_g_idx, attrs, (np.float16,)), None, b, sc, z, None) is None


def test_gated_nbits_prepare_leaves_fed_weights_and_fp32_activations_alone():
    rng = np.random.default_rng(3)
    gate, up = _nbits(rng, 16, 64, 32, False), _nbits(rng, 16, 64, 32, False)
    attrs = {"K": 64, "N": 16, "bits": 4, "block_size": 32}
    names = ("x", "bg", "sg", "", "bu", "su", "")
    fed = (None, *gate[1:], *up)
    assert silu_gated_matmul_nbits.prepare(_ctx("G", names, attrs, (np.float16,)), None, *fed) is None
    assert silu_gated_matmul_nbits.prepare(_ctx("G", names, attrs, (np.float32,)), None, *gate, *up) is None
    undeclared = silu_gated_matmul_nbits.prepare(_ctx("G", names, attrs), None, *gate, *up)  # fp16 scales
    assert set(undeclared) == {1, 2, 4, 5}


@pytest.mark.parametrize("pipeline", [False, True])
def test_the_load_schedule_flag_picks_the_kernel_and_every_launch_is_compiled(launches, monkeypatch, pipeline):
    t = evolve(DEFAULT, gemm_pipeline="all" if pipeline else "off")
    t = evolve(t, gemm_token_tiles="4")  # NJ by rows alone (these narrow grids would take 1)
    rng = np.random.default_rng(4)
    for m in (1, 9, 40):  # NJ = 1, 2, 4
        a = rng.standard_normal((m, 96)).astype(np.float16)
        matmul.run(_ctx("MatMul", ("a", "w"), tuning=t), a, rng.standard_normal((96, 48)).astype(np.float16))
        gate, up = _nbits(rng, 24, 128, 32, True), _nbits(rng, 24, 128, 32, True)
        attrs = {"K": 128, "N": 24, "bits": 4, "block_size": 32}
        x = rng.standard_normal((m, 128)).astype(np.float16)
        silu_gated_matmul_nbits.run(_ctx("SiluGatedMatMulNBits", ("x", "bg", "sg", "zg", "bu", "su", "zu"), attrs,
                                         (np.float16,), tuning=t), x, *gate, *up)
    exprs = [launch[0] for launch in launches]
    assert len(exprs) == 6 and all(e in sched.EXPRS for e in exprs)
    # PIPE: mma_dense's last template argument, mma_nbits4's fourth (the zero-point flag is last)
    pipes = [e[e.index("<") + 1:-1].split(", ")[2 if e.startswith("mma_dense") else 3] for e in exprs]
    assert pipes == [sched.BOOL[pipeline]] * 6
    assert all(e.endswith(", true>") for e in exprs if e.startswith("mma_nbits4"))  # packed zero points
    # the PIPE grid is (token blocks, feature tiles, splits): 40 rows are 2 blocks of 32, N = 48 is
    # 3 tiles, K = 96 is one segment (no split)
    assert launches[4][1] == ((2, 3, 1) if pipeline else (3, 2, 1))


@pytest.mark.parametrize("glu", [False, True])
def test_the_wide_flag_routes_launches_of_32_rows_and_more_to_the_tiled_kernel(launches, monkeypatch, glu):
    t = evolve(DEFAULT, gemm_wide="all")
    monkeypatch.setattr(sched, "wide_worth", lambda m, blocks: True)
    sched.wide_config.cache_clear()
    rng = np.random.default_rng(5)
    w, up = (rng.standard_normal((96, 40)).astype(np.float16) for _ in range(2))
    wp = _mma_layout.pack(np, w, up if glu else None)
    for m in (31, 64, 300):
        _mma.dense(np.zeros((m, 96), np.float16), wp, None, np.zeros((m, 40), np.float16), m, 40, 96, None, glu=glu,
                   tuning=t)
    (small, *_), wide64, wide300 = launches
    assert small.startswith("mma_dense<") and wide64[0] == wide300[0] == f"mma_wide<1, {sched.BOOL[glu]}, 2>"
    assert wide64[0] in sched.EXPRS
    rows = _mma_layout.glu_width(40) if glu else 40  # weight rows: 80 (GLU: two 64-feature blocks) or 40
    blocks = -(-rows // 64)
    assert wide64[1] == (1, blocks) and wide300[1] == (5, blocks) and wide300[2] == (256,)
    assert [int(v) for v in wide300[3][4:]] == [300, rows, 96, 40] and wide300[3][0].shape == (300, 96)
    assert wide300[4] == sched._WIDE_STAGES * (4 * 128 + 64 * 72 // 8) * 16


def test_the_wide_flag_routes_int4_launches_that_fit_the_tiled_kernel(launches, monkeypatch):
    t = evolve(DEFAULT, gemm_wide="all")
    monkeypatch.setattr(sched, "wide_worth", lambda m, blocks: True)
    sched.wide_config.cache_clear()
    rng = np.random.default_rng(6)

    def launch(m, k, bs, zp=False):
        w = _mma_layout.pack_int4(np, *_nbits(rng, 40, k, bs, zp), 40, k, bs)
        _mma.nbits4(np.zeros((m, k), np.float16), w, None, np.zeros((m, 40), np.float16), m, None, tuning=t)
        return launches[-1]

    assert launch(31, 128, 32)[0].startswith("mma_nbits4<")
    wide = launch(64, 128, 32)
    assert wide[0] == "mma_wide4<1, __half, false, false>" and wide[0] in sched.EXPRS
    assert wide[1] == (1, 1) and wide[4] == sched._WIDE_STAGES * (2 * 64 + 64 * 80 // 8) * 16
    # the packed codes, scales, zero points (null), blocks per row and log2(block_size)
    assert [int(v) for v in wide[3][4:6]] == [4, 5]
    assert launch(64, 256, 128, zp=True)[0] == "mma_wide4<1, __half, false, true>" in sched.EXPRS



def test_int4_tensor_core_kernels_take_integer_zero_points_and_blocks_of_32_or_more(launches):
    """The tensor-core int4 arithmetic (q - z exact in fp16, one scale per 16-wide k tile) holds
    for zero points absent or packed and block_size >= 32; fp16 zero points and 16-wide blocks
    take the CUDA-core kernel, and a direct launch of them is refused before any work."""
    f16 = np.dtype(np.float16)
    assert matmul_nbits.mma_config(f16, 4, 128, 32, 0) and matmul_nbits.mma_config(f16, 4, 128, 128, 1)
    assert not matmul_nbits.mma_config(f16, 4, 128, 16, 0)
    assert not matmul_nbits.mma_config(f16, 4, 128, 32, 2)
    b, s, _ = _nbits(np.random.default_rng(8), 40, 128, 16, False)
    for bs, zp in ((16, None), (32, np.full((40, 4), 8, np.float16)), (48, None)):
        with pytest.raises(ValueError, match="int4 tensor-core kernel"):
            _mma_layout.pack_int4(np, b, s, zp, 40, 128, bs)
    assert not launches  # refused before any launch
    assert not launches


def test_the_default_switches_pick_the_measured_schedules(launches, monkeypatch):
    """The measured defaults: PIPE for int4 launches and one-tile dense ones, the tiled kernels
    for dense launches; "off" and "all" cover both."""
    t = evolve(DEFAULT, gemm_pipeline="auto")
    t = evolve(t, gemm_wide="dense")
    t = evolve(t, gemm_token_tiles="4")  # NJ by rows alone: the token-tile rule has its own test
    monkeypatch.setattr(sched, "wide_worth", lambda m, blocks: True)
    sched.wide_config.cache_clear()
    rng = np.random.default_rng(7)
    wp = _mma_layout.pack(np, rng.standard_normal((96, 40)).astype(np.float16))
    b, sc, _ = _nbits(rng, 40, 128, 32, False)
    for m in (8, 64):
        _mma.dense(np.zeros((m, 96), np.float16), wp, None, np.zeros((m, 40), np.float16), m, 40, 96, None, tuning=t)
        _mma.nbits4(np.zeros((m, 128), np.float16), _mma_layout.pack_int4(np, b, sc, None, 40, 128, 32), None,
                    np.zeros((m, 40), np.float16), m, None, tuning=t)
    assert [launch[0] for launch in launches] == [
        "mma_dense<1, false, true>", "mma_nbits4<1, __half, false, true, false>",
        "mma_wide<1, false, 2>", "mma_nbits4<4, __half, false, true, false>"]
    for value, one_row, tiles4, int4 in (("off", False, False, False), ("all", True, True, True),
                                         ("auto", True, False, True)):
        t = evolve(t, gemm_pipeline=value)
        assert (sched.pipelined(40, False, 8, tuning=t), sched.pipelined(40, False, 32, tuning=t),
                sched.pipelined(40, True, 32, tuning=t)) == (one_row, tiles4, int4)
    for value, dense, int4, int4_32 in (("off", False, False, False), ("all", True, True, True),
                                        ("dense", True, False, False), ("auto", True, True, False)):
        t = evolve(t, gemm_wide=value)
        assert (sched.wide_dense_applies(64, 96, tuning=t), sched.wide_int4_applies(64, 128, tuning=t)) == (dense, int4)
        assert sched.wide_int4_applies(32, 128, tuning=t) == int4_32  # int4 tiles from 32 rows under "all" only



@pytest.mark.parametrize("name,m,n,wide", [
    # measured per launch on the H200: row kernel vs tiles
    ("Llama qkv", 64, 3072, False), ("Llama qkv", 128, 3072, True), ("Llama o", 128, 2048, False),
    ("Llama o", 256, 2048, True), ("Llama gate/up", 32, 16384, False), ("Llama gate/up", 64, 16384, True),
    ("Llama down", 128, 2048, False), ("Llama lm_head", 32, 128256, True), ("SmolLM2 o", 256, 576, False),
    ("SmolLM2 gate/up", 128, 3072, True), ("SmolLM2 down", 256, 576, False), ("SmolLM2 lm_head", 32, 49152, True)])
def test_the_tiles_are_taken_where_they_measured_faster(monkeypatch, name, m, n, wide):
    monkeypatch.setattr(sched, "multiprocessors", lambda: 132)
    sched.wide_config.cache_clear()
    try:
        assert (sched.wide_config(m, n) is not None) == wide, name
    finally:
        sched.wide_config.cache_clear()



def test_the_launcher_sizes_shared_memory_with_the_kernel_constants():
    import re
    from pathlib import Path

    src = (Path(_mma.__file__).parents[1] / "kernels" / "linear_mma.cu").read_text()
    assert int(re.search(r"#define WIDE_STAGES (\d+)", src).group(1)) == sched._WIDE_STAGES
    assert int(re.search(r"#define WIDE32_STAGES (\d+)", src).group(1)) == sched._WIDE32_STAGES
    assert int(re.search(r"#define WIDE_XS (\d+)", src).group(1)) == sched._WIDE_XS
    assert int(re.search(r"#define WIDE32_FW (\d+)", src).group(1)) == sched._WIDE32_FW



@pytest.mark.parametrize("name,m,n,int4,nj", [
    # the fastest measured per launch on the H200 (benchmarks/token_tiles.py); n counts the packed
    # weight rows (gate and up together)
    ("SmolLM2 qkv", 32, 960, False, 1), ("SmolLM2 o", 32, 576, False, 1), ("SmolLM2 gate/up", 32, 3072, False, 2),
    ("SmolLM2 down", 32, 576, False, 1), ("Qwen0.5B qkv", 32, 1152, False, 1), ("Qwen0.5B down", 32, 896, False, 1),
    ("Llama qkv", 32, 3072, False, 2), ("Llama o", 32, 2048, False, 2), ("Llama gate/up", 32, 16384, False, 4),
    ("Llama down", 32, 2048, False, 2), ("SmolLM2 qkv", 16, 960, False, 1), ("Qwen0.5B gate/up", 16, 9728, False, 2),
    ("Llama o", 16, 2048, False, 1), ("Llama gate/up", 16, 16384, False, 2), ("Llama gate/up", 8, 16384, False, 1),
    ("SmolLM2 qkv", 32, 960, True, 2), ("SmolLM2 gate/up", 32, 3072, True, 2), ("Qwen0.5B gate/up", 32, 9728, True, 2),
    ("Llama qkv", 32, 3072, True, 2), ("Llama gate/up", 32, 16384, True, 4), ("Llama down", 32, 2048, True, 2),
    ("Llama o", 16, 2048, True, 2), ("Llama qkv", 8, 3072, True, 1)])
def test_token_tiles_per_block_follow_the_measured_rule(monkeypatch, name, m, n, int4, nj):
    monkeypatch.setattr(sched, "multiprocessors", lambda: 132)
    t = evolve(DEFAULT, gemm_token_tiles="auto")
    assert sched.row_nj(m, n, int4, tuning=t) == nj, name
    t = evolve(t, gemm_token_tiles="1")  # the switch caps it
    assert sched.row_nj(m, n, int4, tuning=t) == 1


def test_split_k_cuts_long_k_of_few_rows_into_at_most_one_wave(monkeypatch):
    """The int4 launcher's rule (sched.split_count) on the H200's 132 multiprocessors."""
    monkeypatch.setattr(sched, "multiprocessors", lambda: 132)
    t = evolve(DEFAULT, gemm_split="auto")
    # Llama-3.2-1B down at batch 1, the int4 kernel (4 blocks per multiprocessor): 4 x 128 blocks
    grid, block, shared, spb = sched.config(1, 2048, 8192, 1, True, 4, tuning=t)
    assert grid == (1, 128, 4) and block == (256,) and spb == 8 and shared == 0
    assert sched.config(8, 2048, 8192, 1, True, 2, tuning=t)[:2] == ((1, 128, 2), (256,))  # 2 per SM: 2 splits
    assert sched.config(1, 2048, 8192, 1, True, 1, tuning=t)[0] == (1, 128, 1)  # 1 per SM: a second wave, unsplit
    assert sched.config(32, 2048, 8192, 2, True, 4, tuning=t)[0][2] == 1  # NJ > 1: unsplit (measured slower)
    assert sched.config(1, 2048, 8192, 1, True, tuning=t)[0][2] == 1      # per_sm unknown (dense): unsplit
    assert sched.config(1, 2048, 2048, 1, True, 4, tuning=t)[0][2] == 1   # 8 segments: one per warp already
    assert sched.config(1, 896, 4864, 1, True, 4, tuning=t)[:2] == ((1, 56, 3), (224,))  # 19 segments: 7, 7, 5
    t = evolve(t, gemm_split="off")
    assert sched.config(1, 2048, 8192, 1, True, 4, tuning=t)[0][2] == 1


def test_two_token_tiles_take_the_pipe_schedule_where_the_grid_fits_one_wave(monkeypatch):
    """sched.pipelined and sched.pipe2_warps at the
    H200's 132 multiprocessors and 16 PIPE warps each: Llama-3.2-1B's down and o at 32 rows (256
    blocks) take PIPE in blocks of 8 warps, its qkv (384 blocks) in blocks of 4, and a grid that
    fits neither takes the plain schedule; one tile always takes PIPE, four tiles never."""
    t = evolve(DEFAULT, gemm_pipeline="auto")
    t = evolve(t, gemm_token_tiles="auto")
    monkeypatch.setattr(sched, "multiprocessors", lambda: 132)
    monkeypatch.setattr(sched, "pipe2_per_multiprocessor", lambda threads=256: 512 // threads)
    assert sched.row_nj(32, 2048, tuning=t) == 2 and sched.pipelined(2048, False, 32, tuning=t)
    assert sched.pipe2_warps(2048, 32) == 8
    assert sched.row_nj(32, 3072, tuning=t) == 2 and sched.pipelined(3072, False, 32, tuning=t)
    assert sched.pipe2_warps(3072, 32) == 4
    assert sched.row_nj(16, 9600, tuning=t) == 2
    assert not sched.pipelined(9600, False, 16, tuning=t)  # 600 blocks: 528 a wave at 4
    assert sched.pipe2_warps(9600, 16) == 0
    assert sched.pipelined(3072, False, 8, tuning=t)                       # one tile
    assert sched.row_nj(32, 16384, tuning=t) == 4 and not sched.pipelined(16384, False, 32, tuning=t)
    monkeypatch.setattr(sched, "PIPE2_WARPS", (8,))
    assert not sched.pipelined(3072, False, 32, tuning=t) and sched.pipelined(2048, False, 32, tuning=t)
    t = evolve(t, gemm_pipeline="off")
    assert not sched.pipelined(2048, False, 32, tuning=t)


def test_a_two_tile_pipe_launch_takes_the_block_of_pipe2_warps(launches, monkeypatch):
    """The launch itself: Llama-3.2-1B's qkv shape at 32 rows gets blocks of pipe2_warps' 4
    warps (128 threads), its o projection 8; a K of fewer segments than warps, one warp each;
    PIPE forced on a grid that fits no block size, 8."""
    t = evolve(DEFAULT, gemm_pipeline="auto")
    t = evolve(t, gemm_token_tiles="auto")
    monkeypatch.setattr(sched, "multiprocessors", lambda: 132)
    monkeypatch.setattr(sched, "pipe2_per_multiprocessor", lambda threads=256: 512 // threads)
    for k, n, threads in ((2048, 3072, 128), (2048, 2048, 256), (512, 3072, 64)):
        del launches[:]
        wp = _mma_layout.pack(np, np.zeros((k, n), np.float16))
        _mma.dense(np.zeros((32, k), np.float16), wp, None, np.zeros((32, n), np.float16), 32, n, k, None, tuning=t)
        (expr, grid, block, args, shared), = launches
        assert expr == "mma_dense<2, false, true>" and block == (threads,), (k, n, block)
        assert grid == (2, n // 16, 1)
    # PIPE forced where no block size fits one wave (600 blocks at 16 rows): blocks of 8 warps
    t = evolve(t, gemm_pipeline="all")
    del launches[:]
    wp = _mma_layout.pack(np, np.zeros((2048, 9600), np.float16))
    _mma.dense(np.zeros((16, 2048), np.float16), wp, None, np.zeros((16, 9600), np.float16), 16, 9600, 2048, None,
               tuning=t)
    (expr, grid, block, args, shared), = launches
    assert expr == "mma_dense<2, false, true>" and block == (256,)


def test_launches_of_17_to_32_rows_over_wide_projections_take_the_one_token_warp_tiles(monkeypatch):
    """The rule of sched.wide32_config, at the H200's 132
    multiprocessors: only projections wide enough for 1.5 x 4 feature warps (16 features each) per
    multiprocessor (Llama-3.2-1B's gate/up, the lm_heads) with K >= 768 (not SmolLM2's 576), and
    only for 17 to 32 rows."""
    t = evolve(DEFAULT, gemm_wide="dense")
    monkeypatch.setattr(sched, "multiprocessors", lambda: 132)
    one, two = sched._WIDE32_STAGES * 16, sched._WIDE_STAGES * 16  # F = 1 has its own stage count
    fw = sched._WIDE32_FW  # feature warps of the F = 1 blocks
    assert sched.wide32_config(32, 16384, 2048, tuning=t) == (1, (1, 1024 // fw), (32 * fw,),
                                                            one * (fw * 128 + 32 * 72 // 8))
    assert sched.wide32_config(17, 16384, 2048, tuning=t) == sched.wide32_config(32, 16384, 2048, tuning=t)
    assert sched.wide32_config(32, 128256, 2048, tuning=t) == (2, (1, 1002), (128,), two * (8 * 128 + 32 * 72 // 8))
    assert sched.wide32_config(32, 151936, 896, tuning=t) is not None
    for m, n, k in ((16, 16384, 2048), (33, 16384, 2048), (32, 9728, 896), (32, 3072, 2048), (8, 128256, 2048),
                    (32, 49152, 576), (32, 16384, 2052)):
        assert sched.wide32_config(m, n, k, tuning=t) is None, (m, n, k)
    t = evolve(t, gemm_wide="off")
    assert sched.wide32_config(32, 16384, 2048, tuning=t) is None


def test_a_wide32_launch_names_the_one_token_warp_kernel(launches, monkeypatch):
    t = evolve(DEFAULT, gemm_wide="dense")
    monkeypatch.setattr(sched, "WIDE32_FILL", 0)
    rng = np.random.default_rng(3)
    monkeypatch.setattr(sched, "WIDE32_MIN_K", 0)
    wp = _mma_layout.pack(np, rng.standard_normal((96, 40)).astype(np.float16))
    _mma.dense(np.zeros((24, 96), np.float16), wp, None, np.zeros((24, 40), np.float16), 24, 40, 96, None, tuning=t)
    (expr, grid, block, args, shared), = launches
    assert expr == "mma_wide<1, false, 1>" and expr in sched.EXPRS
    assert grid == (1, 1) and block == (32 * sched._WIDE32_FW,) and [int(v) for v in args[4:]] == [24, 40, 96, 40]


def test_strided_int4_activations_take_the_tensor_core_kernel_prepared_or_not(launches, monkeypatch):
    """A strided A is copied (``_mma.contiguous``) and runs the kernel the prepared path runs,
    so preparing a weight never changes which arithmetic a call gets."""
    copied = []

    def contiguous(ctx, a):
        copied.append(a.flags.c_contiguous)
        return np.ascontiguousarray(a)

    monkeypatch.setattr(_mma, "contiguous", contiguous)
    rng = np.random.default_rng(13)
    n, k, bs = 48, 128, 32
    b, sc, _ = _nbits(rng, n, k, bs, False)
    attrs = {"K": k, "N": n, "bits": 4, "block_size": bs}
    a = rng.standard_normal((4, 2 * k)).astype(np.float16)[:, ::2]  # strided rows
    assert not a.flags.c_contiguous
    matmul_nbits.run(_ctx("MatMulNBits", ("a", "b", "s"), attrs, (np.float16,)), a, b, sc)
    ctx = _ctx("MatMulNBits", ("a", "b", "s"), attrs, (np.float16,))
    changes = matmul_nbits.prepare(ctx, None, b, sc)
    matmul_nbits.run(ctx, a, changes[1], changes[2])
    assert copied == [False, False] and len(launches) == 2
    assert launches[0][0].startswith("mma_nbits4<")
    _same_launch(launches[0], launches[1])


def test_int4_zero_points_of_another_size_are_refused_with_their_expected_shape():
    rng = np.random.default_rng(14)
    n, k, bs = 32, 128, 32
    b, sc, z = _nbits(rng, n, k, bs, True)
    short = z[:, :1]  # [32, 1] where [32, 2] is due
    with pytest.raises(ValueError, match=r"zero points uint8\(32, 1\).*\[32, 2\]"):
        _mma_layout.pack_int4(np, b, sc, short, n, k, bs)
    attrs = {"K": k, "N": n, "bits": 4, "block_size": bs}
    ctx = _ctx("MatMulNBits", ("a", "b", "s", "z"), attrs, (np.float16,))
    assert matmul_nbits.prepare(ctx, None, b, sc, short) is None  # left raw: run() raises the error
    assert _mma_layout.INT4_PREPARED not in ctx.cache
    assert matmul_nbits.prepare(ctx, None, b, sc, z) is not None  # the same node with its right zero points


def test_the_occupancy_probe_names_a_kernel_the_module_compiles():
    # an expression outside EXPRS would make the probe fail quietly and fall back to the H200 count
    assert sched.PIPE2_EXPR in sched.EXPRS

"""The residual hand-off (lockstep.MatMulNormMatMul, kernels/linear_mma.cu RES_OUT / RES_IN) on
the GPU: its two launches are bitwise the projection, norm and projection kernels in turn, per
launch (1 to 16 rows, both GEMM schedules, MatMul and gate/up second projections, normalised
widths that do and do not fill a 16-feature group) and per model (decode at batch sizes that
take the hand-off and one that does not, eager and captured); each test also checks that the
hand-off ran. Row 0 of a batch that takes it equals batch 1 and a batch of 17 (three parts)."""

import numpy as np
import pytest
from _gpu import require_gpu

cupy = require_gpu()

from core.session import Session  # noqa: E402
from providers.cuda.ops import NULL, _mma, _norm, matmul_norm_matmul  # noqa: E402
from providers.cuda.provider import CudaProvider  # noqa: E402

EPS = 1e-5


@pytest.fixture
def ran(monkeypatch):
    """Expressions of the tensor-core kernels launched, in order."""
    seen = []
    launch = _mma._launch

    def recording(expr, *args, **kw):
        seen.append(expr)
        launch(expr, *args, **kw)

    monkeypatch.setattr(_mma, "_launch", recording)
    return seen


def _bits(a):
    return a.get().view(np.uint16)


# (rows, K of the first projection, normalised width D, N of the second)
CASES = [(1, 576, 576, 1536), (1, 1536, 576, 960), (5, 64, 200, 40), (8, 2048, 1024, 96), (9, 576, 576, 72),
         (16, 896, 896, 152), (3, 576, 40, 24), (2, 300, 1000, 48)]


@pytest.mark.parametrize("pipeline", ["auto", "off"])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("m,k,d,n", CASES)
def test_the_two_launches_are_bitwise_the_three_kernels(monkeypatch, ran, pipeline, glu, m, k, d, n):
    monkeypatch.setattr(_mma, "PIPELINE", pipeline)
    rng = np.random.default_rng(m * 7 + k + d + n)

    def dev(*shape, scale=1.0):
        return cupy.asarray((rng.standard_normal(shape) * scale).astype(np.float16))

    x, skip, gamma = dev(m, k), dev(m, d), dev(d)
    w1 = rng.standard_normal((k, d)).astype(np.float16) / np.float16(np.sqrt(k))
    wg, wu = (rng.standard_normal((d, n)).astype(np.float16) for _ in range(2))
    wp1 = cupy.asarray(_mma.pack(np, w1))
    wp2 = cupy.asarray(_mma.pack(np, wg, wu if glu else None))

    # three kernels: the projection, SkipSimplifiedLayerNormalization, the projection
    y1, normed, total = (cupy.full((m, d), np.nan, np.float16) for _ in range(3))
    y2 = cupy.full((m, n), np.nan, np.float16)
    _mma.dense(x, wp1, None, y1, m, d, k, NULL)
    _norm.launch(y1, skip, None, gamma, normed, total, None, None, d, EPS)
    _mma.dense(normed, wp2, None, y2, m, n, d, NULL, glu=glu)

    # the hand-off
    del ran[:]
    h1, htotal = (cupy.full((m, d), np.nan, np.float16) for _ in range(2))
    h2 = cupy.full((m, n), np.nan, np.float16)
    sq = cupy.full((m, _mma.res_stride(d)), np.nan, np.float32)
    _mma.dense(x, wp1, None, h1, m, d, k, NULL, res=_mma.Residual(_mma.RES_OUT, skip, None, htotal, sq, EPS))
    _mma.dense(h1, wp2, None, h2, m, n, d, NULL, glu=glu, res=_mma.Residual(_mma.RES_IN, skip, gamma, None, sq, EPS))
    assert len(ran) == 2 and ran[0].endswith(f", {_mma.RES_OUT}>") and ran[1].endswith(f", {_mma.RES_IN}>")

    assert np.array_equal(_bits(h1), _bits(y1))
    assert np.array_equal(_bits(htotal), _bits(total))
    assert np.array_equal(_bits(h2), _bits(y2))
    # and the group sums are those of the residual sum in fp32 (within float rounding)
    v = (y1.get().astype(np.float32) + skip.get().astype(np.float32)).astype(np.float64)
    groups = -(-d // 16)
    want = np.stack([np.sum(v[:, 16 * p:16 * p + 16] ** 2, axis=1) for p in range(groups)], axis=1)
    assert np.allclose(sq.get()[:, :groups], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m,d", [(17, 64), (1, 1032)])
def test_a_launch_the_hand_off_cannot_take_is_refused(m, d):
    x = cupy.zeros((m, 64), np.float16)
    wp = cupy.asarray(_mma.pack(np, np.zeros((64, d), np.float16)))
    res = _mma.Residual(_mma.RES_OUT, cupy.zeros((m, d), np.float16), None, cupy.zeros((m, d), np.float16),
                        cupy.zeros((m, _mma.res_stride(d)), np.float32), EPS)
    with pytest.raises(ValueError, match="residual hand-off"):
        _mma.dense(x, wp, None, cupy.zeros((m, d), np.float16), m, d, 64, NULL, res=res)


class Apart(CudaProvider):
    """The cuda provider without the MatMulNormMatMul pass: every projection and norm apart."""

    def supports(self, node):
        return node.op_type != "MatMulNormMatMul" and super().supports(node)


def _decode(model_dir, provider, rows, steps=8, capture=False):
    s = Session(model_dir, provider, batch=len(rows), capacity=64, capture=capture)
    tokens, logits = [s.prefill(rows).tokens], [np.asarray(s.last_logits(), np.float32)]
    for _ in range(steps):
        tokens.append(s.step().tokens)
        logits.append(np.asarray(s.last_logits(), np.float32))
    return np.stack(tokens), np.stack(logits), s


@pytest.mark.parametrize("batch", [1, 3, 16, 17])
def test_decode_with_the_hand_off_is_bitwise_the_nodes_apart(model_dir, batch, monkeypatch):
    monkeypatch.delenv("LOCKSTEP_CUDA_RESIDUAL_HANDOFF", raising=False)  # default on
    rng = np.random.default_rng(batch)
    rows = [list(rng.integers(3, 200, int(n))) for n in rng.integers(1, 9, batch)]
    before = dict(matmul_norm_matmul.counts)
    tokens, logits, session = _decode(model_dir, CudaProvider(), rows)
    after = {k: matmul_norm_matmul.counts[k] - before[k] for k in before}
    apart_tokens, apart_logits, apart = _decode(model_dir, Apart(), rows)
    dense_fp16 = "fp16" in str(model_dir)  # int4 projections are MatMulNBits; fp32 never fuses
    fused = [n for n in session.plan.nodes if n.op_type == "MatMulNormMatMul"]
    assert bool(fused) == dense_fp16
    assert not any(n.op_type == "MatMulNormMatMul" for n in apart.plan.nodes)
    assert np.array_equal(tokens, apart_tokens)
    assert np.array_equal(logits.view(np.uint32), apart_logits.view(np.uint32))
    if dense_fp16:
        # two nodes a layer: o_proj + norm + gate/up, and down + the next layer's norm + qkv
        assert len(fused) == 2 * len([n for n in session.plan.nodes if n.op_type == "GroupQueryAttention"]) - 1
        if batch <= 16:  # decode steps of at most 16 rows take the two launches
            assert after["handoffs"] > 0
        else:
            assert after["handoffs"] == 0 and after["three_part_runs"] > 0


def test_row_0_is_batch_1_across_the_hand_off_limit(model_dir):
    rng = np.random.default_rng(5)
    rows = [list(rng.integers(3, 200, int(n))) for n in rng.integers(1, 9, 17)]
    _, one, _ = _decode(model_dir, CudaProvider(), rows[:1])
    for batch in (16, 17):
        _, many, _ = _decode(model_dir, CudaProvider(), rows[:batch])
        assert np.array_equal(many[:, 0].view(np.uint32), one[:, 0].view(np.uint32)), batch


def test_the_hand_off_under_capture_is_bitwise_eager(model_dir):
    rows = [[5, 17, 42], [7, 8]]
    before = dict(matmul_norm_matmul.counts)
    eager = _decode(model_dir, CudaProvider(), rows, capture=False)
    captured = _decode(model_dir, CudaProvider(), rows, capture=True)
    assert np.array_equal(eager[0], captured[0]) and np.array_equal(eager[1], captured[1])
    assert captured[2].counters.captures == 1 and captured[2].counters.replays > 0  # the graph replayed
    if "fp16" in str(model_dir):
        assert matmul_norm_matmul.counts["handoffs"] > before["handoffs"]


def test_the_pass_is_off_with_the_switch(model_dir, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CUDA_RESIDUAL_HANDOFF", "0")
    s = Session(model_dir, CudaProvider(), batch=1, capacity=32)
    assert not any(n.op_type == "MatMulNormMatMul" for n in s.plan.nodes)

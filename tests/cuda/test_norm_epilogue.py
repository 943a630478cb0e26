"""The post-norm epilogue on the GPU (lockstep.MatMulRMSNorm, kernels/linear_mma.cu ``post_norm``):
a projection whose output feeds a SkipSimplifiedLayerNormalization normalises in its own launch,
bitwise the projection kernel followed by the norm kernel:

- per launch, dense and int4 (split-K included), both weight schedules, 1 to 16 rows over hidden
  sizes of the builder's models, back to back (the tickets are left at zero) and replayed from a
  CUDA graph;
- per plan, in prefill and decode, eager and captured, at batch sizes that take the one-launch
  path and one that runs the two parts; the fused path seen to run, and row 0 bitwise batch 1."""

import numpy as np
import pytest
from _gpu import require_gpu

cupy = require_gpu()

from core.session import Session  # noqa: E402
from providers.cuda.ops import NULL, _mma, _norm, matmul_rms_norm  # noqa: E402

#: (rows, K, N): SmolLM2's o_proj (576) and down (1,536 -> 576), Qwen2.5-0.5B's (896), Llama's
#: o_proj and down (8,192 -> 2,048; int4 splits K there up to 8 rows)
SHAPES = [(1, 576, 576), (3, 1536, 576), (8, 896, 896), (9, 4864, 896), (16, 2048, 2048), (5, 8192, 2048)]
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


def _operands(rng, m, k, n, int4):
    x = cupy.asarray(rng.standard_normal((m, k)).astype(np.float16) * 0.5)
    residual = cupy.asarray(rng.standard_normal((m, n)).astype(np.float16))
    gamma = cupy.asarray((1 + 0.1 * rng.standard_normal(n)).astype(np.float16))
    if int4:
        bs = 32
        codes = cupy.asarray(rng.integers(0, 256, (n, k // bs, bs // 2), dtype=np.uint8))
        scales = cupy.asarray((0.02 * rng.standard_normal(n * (k // bs))).astype(np.float16))

        def project(y, post=None):
            _mma.nbits4(x, codes, scales, NULL, 0, 0, None, y, m, n, k, bs, "__half", NULL, post=post)
    else:
        wp = _mma.pack(cupy, cupy.asarray((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16)))

        def project(y, post=None):
            _mma.dense(x, wp, None, y, m, n, k, NULL, post=post)
    return residual, gamma, project


def _two_launches(residual, gamma, project, m, n):
    y, out, total = (cupy.empty((m, n), np.float16) for _ in range(3))
    project(y)
    _norm.launch(residual, y, None, gamma, out, total, None, None, n, EPS)  # the builder's order
    return out.get(), total.get(), y.get()


@pytest.mark.parametrize("int4", [False, True], ids=["dense", "int4"])
@pytest.mark.parametrize("pipe", ["off", "all"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_epilogue_is_bitwise_the_projection_then_the_norm(monkeypatch, ran, m, k, n, int4, pipe):
    monkeypatch.setattr(_mma, "PIPELINE", pipe)
    residual, gamma, project = _operands(np.random.default_rng(m * k + n), m, k, n, int4)
    want_out, want_sum, want_y = _two_launches(residual, gamma, project, m, n)
    tickets = cupy.zeros(_mma.POST_TICKETS, np.int32)
    y, out, total = (cupy.full((m, n), np.nan, np.float16) for _ in range(3))
    split_before = _mma.stats()["split_launches"]
    for _ in range(2):  # back to back: the first launch must leave the tickets at zero
        del ran[:]
        project(y, _mma.Post(residual, gamma, out, total, EPS, tickets))
        assert len(ran) == 1 and ran[0].startswith("mma_nbits4<" if int4 else "mma_dense<")
        assert np.array_equal(out.get(), want_out) and np.array_equal(total.get(), want_sum)
        assert np.array_equal(y.get(), want_y)
        assert not tickets.get().any()
    if int4 and m <= 8 and k > 8 * _mma.SEG_K and _mma.SPLIT == "auto":
        assert _mma.stats()["split_launches"] > split_before  # the split-K fold blocks took the tickets


@pytest.mark.parametrize("int4", [False, True], ids=["dense", "int4"])
def test_epilogue_replayed_from_a_cuda_graph(int4):
    m, k, n = 2, 8192, 2048
    residual, gamma, project = _operands(np.random.default_rng(3), m, k, n, int4)
    want_out, want_sum, _ = _two_launches(residual, gamma, project, m, n)
    tickets = cupy.zeros(_mma.POST_TICKETS, np.int32)
    y, out, total = (cupy.zeros((m, n), np.float16) for _ in range(3))
    post = _mma.Post(residual, gamma, out, total, EPS, tickets)
    project(y, post)  # compile and warm up outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        project(y, post)
        graph = stream.end_capture()
    out.fill(0)
    for _ in range(3):
        graph.launch(stream)
    stream.synchronize()
    assert np.array_equal(out.get(), want_out) and np.array_equal(total.get(), want_sum)
    assert not tickets.get().any()


def _decode(model_dir, rows, steps=6, capture=False):
    s = Session(model_dir, "cuda", batch=len(rows), capacity=64, capture=capture)
    tokens, logits = [s.prefill(rows).tokens], [np.asarray(s.last_logits(), np.float32)]
    for _ in range(steps):
        tokens.append(s.step().tokens)
        logits.append(np.asarray(s.last_logits(), np.float32))
    return np.stack(tokens), np.stack(logits), s


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_plan_with_the_epilogue_is_bitwise_the_plan_without(model_dir, batch, monkeypatch):
    rng = np.random.default_rng(batch)
    rows = [list(rng.integers(3, 200, int(n))) for n in rng.integers(1, 9, batch)]
    monkeypatch.setenv("LOCKSTEP_CUDA_NORM_EPILOGUE", "1")
    before = dict(matmul_rms_norm.counts)
    tokens, logits, session = _decode(model_dir, rows)
    ran = {k: matmul_rms_norm.counts[k] - before[k] for k in before}
    monkeypatch.setenv("LOCKSTEP_CUDA_NORM_EPILOGUE", "0")
    plain_tokens, plain_logits, plain = _decode(model_dir, rows)
    fp16_acts = "fp32" not in str(model_dir)
    assert any(n.op_type == "MatMulRMSNorm" for n in session.plan.nodes) == fp16_acts
    assert not any(n.op_type == "MatMulRMSNorm" for n in plain.plan.nodes)
    assert np.array_equal(tokens, plain_tokens) and np.array_equal(logits, plain_logits)
    if fp16_acts:
        # decode steps of up to 16 rows take the one-launch path; 17 rows run the two parts
        assert ran["fused_launches"] > 0 if batch <= _mma.POST_ROWS else ran["two_part_runs"] > 0
        if batch > 1:  # row 0 is its batch-1 run, bit for bit, fused or not
            monkeypatch.setenv("LOCKSTEP_CUDA_NORM_EPILOGUE", "1")
            single_tokens, single_logits, _ = _decode(model_dir, rows[:1])
            assert np.array_equal(tokens[:, :1], single_tokens)
            assert np.array_equal(logits[:, :1], single_logits)


def test_captured_steps_with_the_epilogue_are_bitwise_eager(model_dir, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CUDA_NORM_EPILOGUE", "1")
    rows = [[5, 17, 42], [7]]
    eager = _decode(model_dir, rows, capture=False)
    captured = _decode(model_dir, rows, capture=True)
    assert captured[2].counters.captures >= 1
    assert np.array_equal(eager[0], captured[0]) and np.array_equal(eager[1], captured[1])

"""The fused RMSNorm + projection launch (lockstep.RMSNormMatMul, kernels/linear_mma.cu NORM)
on the GPU: bitwise the unfused norm and projection kernels, at batch sizes that take the
one-launch path (one row) and the two-part path, in prefill and decode; and the one-launch
path actually ran. The pass is opt-in on cuda (LOCKSTEP_CUDA_NORM_FUSION=1), so these tests
turn it on; by default no RMSNormMatMul node is planned (the last test)."""

import numpy as np
import pytest
from _gpu import require_gpu

require_gpu()

from core.session import Session  # noqa: E402
from providers.cuda.ops import rms_norm_matmul  # noqa: E402
from providers.cuda.provider import CudaProvider  # noqa: E402


class Unfused(CudaProvider):
    """The cuda provider without the RMSNormMatMul pass."""

    def supports(self, node):
        return node.op_type != "RMSNormMatMul" and super().supports(node)


def _decode(model_dir, provider, rows, steps=12, capture=False):
    s = Session(model_dir, provider, batch=len(rows), capacity=64, capture=capture)
    tokens, logits = [s.prefill(rows).tokens], [np.asarray(s.last_logits(), np.float32)]
    for _ in range(steps):
        tokens.append(s.step().tokens)
        logits.append(np.asarray(s.last_logits(), np.float32))
    return np.stack(tokens), np.stack(logits), s


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_norm_projection_is_bitwise_the_unfused_kernels(model_dir, batch, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CUDA_NORM_FUSION", "1")  # the pass is opt-in on cuda
    monkeypatch.setenv("LOCKSTEP_CUDA_NORM_FUSION_INT4", "1")  # the opt-in int4 path is checked too
    rng = np.random.default_rng(batch)
    rows = [list(rng.integers(3, 200, int(n))) for n in rng.integers(1, 9, batch)]
    before = dict(rms_norm_matmul.counts)
    fused_tokens, fused_logits, session = _decode(model_dir, CudaProvider(), rows)
    ran = {k: rms_norm_matmul.counts[k] - before[k] for k in before}
    plain_tokens, plain_logits, plain = _decode(model_dir, Unfused(), rows)
    fp16_acts = "fp32" not in str(model_dir)  # fp16 and int4 (fp16 activations) fuse; fp32 never does
    assert any(n.op_type == "RMSNormMatMul" for n in session.plan.nodes) == fp16_acts
    assert not any(n.op_type == "RMSNormMatMul" for n in plain.plan.nodes)
    assert np.array_equal(fused_tokens, plain_tokens)
    assert np.array_equal(fused_logits, plain_logits)
    if fp16_acts:
        # batch-1 decode steps take the one-launch path; more rows (and prompts) the two parts
        # (a prompt group of one 1-token row is a one-row call too)
        assert ran["fused_launches"] > 0 if batch == 1 else ran["two_part_runs"] > 0


def test_fused_norm_projection_under_capture_is_bitwise_eager(model_dir, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CUDA_NORM_FUSION", "1")
    rows = [[5, 17, 42]]
    eager = _decode(model_dir, CudaProvider(), rows, capture=False)
    captured = _decode(model_dir, CudaProvider(), rows, capture=True)
    assert np.array_equal(eager[0], captured[0]) and np.array_equal(eager[1], captured[1])


def test_the_pass_is_off_by_default(model_dir, monkeypatch):
    monkeypatch.delenv("LOCKSTEP_CUDA_NORM_FUSION", raising=False)
    s = Session(model_dir, CudaProvider(), batch=1, capacity=32)
    assert not any(n.op_type == "RMSNormMatMul" for n in s.plan.nodes)

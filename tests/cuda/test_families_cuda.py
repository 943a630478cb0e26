"""The tiny builder families (core.testing.families) in their fp16 and int4 CUDA variants on
the cuda provider (GPU only): each row of a batch is bitwise its batch-1 run on cuda, and the
greedy tokens follow cpu_reference's on the same folder (teacher-forced logits within fp16
tolerance). The builder-default (windowed) folders of the sliding-window families are in
tests/cuda/test_ring_cuda.py.

    pytest -q tests/cuda/test_families_cuda.py           # builds 24 tiny models (~20 s each)
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu import require_gpu

require_gpu()
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai", reason="the builder (the models extra) makes the family folders")

from core.generation.loop import decode  # noqa: E402
from core.models.model import load_model  # noqa: E402
from core.session import Session  # noqa: E402
from core.testing.families import FAMILIES, prepared_family  # noqa: E402

STEPS = 16
CAPACITY = 64
PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 21)), [200, 7, 7, 31, 64, 128, 9, 250, 1, 33, 77, 12, 6]]
TESTED = sorted(FAMILIES)


@pytest.fixture(scope="session")
def cuda_family(tmp_path_factory):
    root = tmp_path_factory.mktemp("families-cuda")
    built: dict[tuple[str, str], object] = {}

    def get(family: str, precision: str = "fp16"):
        if (family, precision) not in built:
            built[(family, precision)] = load_model(prepared_family(family, root / precision, precision, "cuda"))
        return built[(family, precision)]

    return get


def _run(model, provider, rows, force=None):
    session = Session(model, provider, batch=len(rows), capacity=CAPACITY)
    logits = []
    trace = decode(session, rows, STEPS, force=force,
                   observer=lambda *_: logits.append(np.asarray(session.last_logits(), np.float32)))
    return trace.tokens.T, np.stack(logits, 1)


@pytest.mark.parametrize("precision", ["fp16", "int4"])
@pytest.mark.parametrize("family", TESTED)
def test_cuda_rows_are_bitwise_their_batch1_runs(cuda_family, family, precision):
    model = cuda_family(family, precision)
    tokens, logits = _run(model, "cuda", PROMPTS)
    for b, ids in enumerate(PROMPTS):
        t1, l1 = _run(model, "cuda", [ids])
        assert np.array_equal(tokens[b], t1[0]) and np.array_equal(logits[b], l1[0]), f"{family} row {b}"


@pytest.mark.parametrize("precision", ["fp16", "int4"])
@pytest.mark.parametrize("family", TESTED)
def test_cuda_follows_cpu_reference_on_the_same_folder(cuda_family, family, precision):
    """Teacher-forced on cpu_reference's greedy tokens: logits within fp16 tolerance of the
    reference's (relative to the logit spread), top-1 equal on at least 90% of the steps."""
    model = cuda_family(family, precision)
    ref_tokens, ref_logits = _run(model, "cpu_reference", PROMPTS)
    force = [[int(t) for t in row[:STEPS]] for row in ref_tokens]  # force[b][t] replaces token t
    _, got = _run(model, "cuda", PROMPTS, force=force)
    spread = ref_logits.max(-1) - ref_logits.min(-1)
    assert (np.abs(got - ref_logits).max(-1) <= 0.02 * spread + 1e-2).all(), family
    assert (got.argmax(-1) == ref_logits.argmax(-1)).mean() >= 0.9, family


def test_cuda_qwen3_runs_the_fused_qk_norm_and_follows_cpu_reference(cuda_family):
    """Qwen3's fp16 CUDA graph passes q_norm/k_norm into GroupQueryAttention (inputs 14, 15,
    docs/ops.md 1.3.0): the cuda launcher takes its q/k-norm path, the teacher-forced logits stay
    within fp16 tolerance of cpu_reference's, and a decode step gives the bits of a prefill of its
    history (the norm is the same device function in both)."""
    from core.executor import node_infos
    from providers.cuda.ops import group_query_attention as gqa

    model = cuda_family("qwen3")
    nodes = [n for n in node_infos(model.graph) if n.op_type == "GroupQueryAttention"]
    assert nodes and all(len(n.inputs) > 15 and n.inputs[14] and n.inputs[15] for n in nodes)
    ref_tokens, ref_logits = _run(model, "cpu_reference", PROMPTS)
    before = gqa.stats()["qk_norm"]
    force = [[int(t) for t in row[:STEPS]] for row in ref_tokens]
    _, got = _run(model, "cuda", PROMPTS, force=force)
    assert gqa.stats()["qk_norm"] > before, "the q/k-norm launches ran"
    spread = ref_logits.max(-1) - ref_logits.min(-1)
    assert (np.abs(got - ref_logits).max(-1) <= 0.02 * spread + 1e-2).all()
    prompt = PROMPTS[1]
    run = decode(Session(model, "cuda", batch=1, capacity=CAPACITY), [prompt], STEPS, keep_logits=True)
    for k in (1, STEPS // 2, STEPS):
        history = prompt + [int(t) for t in run.tokens[:k, 0]]
        fresh = decode(Session(model, "cuda", batch=1, capacity=CAPACITY), [history], 0, keep_logits=True)
        assert np.array_equal(fresh.logits[0, 0], run.logits[k, 0]), f"step {k}"

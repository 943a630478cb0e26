"""Split-K of the int4 GEMV end to end (GPU only): a tiny llama built by the real builder in its
int4 CUDA variant, with an MLP of 2,304 (the down projection has 9 K segments of 256, so at
1-8 rows it splits in two, kernels/linear_mma.cu split_last). Captured decode steps with the
split are bitwise the same steps with ``LOCKSTEP_CUDA_GEMM_SPLIT`` off, every row of a batch is
bitwise its batch-1 run, and the tokens follow cpu_reference's.

    pytest -q tests/cuda/test_split_k_model.py           # builds one tiny model (~20 s)
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from _gpu import require_gpu

require_gpu()
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai", reason="the builder (the models extra) makes the folder")

from core.generation.loop import decode  # noqa: E402
from core.models.model import load_model  # noqa: E402
from core.session import Session  # noqa: E402
from core.testing.families import prepared_family  # noqa: E402
from providers.cuda.ops import _mma  # noqa: E402
from providers.cuda.tuning import Tuning  # noqa: E402

STEPS = 12
PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 21)), [200, 7, 7, 31, 64, 128, 9, 250, 1, 33, 77, 12, 6]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = prepared_family("llama", tmp_path_factory.mktemp("split-k"), "int4", "cuda",
                             overrides={"intermediate_size": 2304})
    return load_model(folder)


def _run(model, provider, rows, force=None):
    session = Session(model, provider, batch=len(rows), capacity=64)
    logits = []
    trace = decode(session, rows, STEPS, force=force,
                   observer=lambda *_: logits.append(np.asarray(session.last_logits(), np.float32)))
    return trace.tokens.T, np.stack(logits, 1), session.counters


def test_split_steps_are_bitwise_the_unsplit_ones_and_rows_their_batch1_runs(model, monkeypatch):
    from providers.cuda.provider import CudaProvider

    tuning = Tuning.from_env()
    before = _mma.stats()["split_launches"]
    off_tokens, off_logits, _ = _run(model, CudaProvider(attrs.evolve(tuning, gemm_split="off")), PROMPTS)
    assert _mma.stats()["split_launches"] == before
    tokens, logits, counters = _run(model, CudaProvider(attrs.evolve(tuning, gemm_split="auto")), PROMPTS)
    assert _mma.stats()["split_launches"] > before  # the split path ran (warm-up, capture)
    assert counters.replays > 0  # and the decode steps were captured graphs
    assert np.array_equal(tokens, off_tokens) and np.array_equal(logits, off_logits)
    for b, ids in enumerate(PROMPTS):
        t1, l1, _ = _run(model, CudaProvider(attrs.evolve(tuning, gemm_split="auto")), [ids])
        assert np.array_equal(tokens[b], t1[0]) and np.array_equal(logits[b], l1[0]), f"row {b}"


def test_split_model_follows_cpu_reference(model):
    """Teacher-forced on cpu_reference's greedy tokens: logits within int4/fp16 tolerance of the
    reference's (relative to the logit spread), top-1 equal on at least 90% of the steps."""
    ref_tokens, ref_logits, _ = _run(model, "cpu_reference", PROMPTS)
    force = [[int(t) for t in row[:STEPS]] for row in ref_tokens]
    _, got, _ = _run(model, "cuda", PROMPTS, force=force)
    spread = ref_logits.max(-1) - ref_logits.min(-1)
    assert (np.abs(got - ref_logits).max(-1) <= 0.02 * spread + 1e-2).all()
    assert (got.argmax(-1) == ref_logits.argmax(-1)).mean() >= 0.9

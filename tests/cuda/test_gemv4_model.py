"""``gemv4`` end to end (GPU only): a tiny llama built by the real builder in its int4 CUDA variant
(MLP of 2,304: the down projection has 9 K segments of 256). Captured decode steps with
``LOCKSTEP_CUDA_GEMM_GEMV`` on are bitwise the same steps with it off, and every row of a batch of
3 is bitwise its batch-1 run with it on.

    pytest -q tests/cuda/test_gemv4_model.py           # builds one tiny model (~20 s)
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
from providers.cuda.ops import _gemv4  # noqa: E402
from providers.cuda.tuning import Tuning  # noqa: E402

STEPS = 12
PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 21)), [200, 7, 7, 31, 64, 128, 9, 250, 1, 33, 77, 12, 6]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = prepared_family("llama", tmp_path_factory.mktemp("gemv4"), "int4", "cuda",
                             overrides={"intermediate_size": 2304})
    return load_model(folder)


def _run(model, gemv: bool, rows):
    from providers.cuda.provider import CudaProvider

    provider = CudaProvider(attrs.evolve(Tuning.from_env(), gemm_gemv=gemv))
    session = Session(model, provider, batch=len(rows), capacity=64)
    logits = []
    trace = decode(session, rows, STEPS,
                   observer=lambda *_: logits.append(np.asarray(session.last_logits(), np.float32)))
    return trace.tokens.T, np.stack(logits, 1), session.counters


def test_gemv4_steps_are_bitwise_the_default_and_rows_their_batch1_runs(model):
    off_tokens, off_logits, _ = _run(model, False, PROMPTS)
    before = _gemv4.stats()["launches"]
    tokens, logits, counters = _run(model, True, PROMPTS)
    assert _gemv4.stats()["launches"] > before  # gemv4 ran (warm-up, capture)
    assert counters.replays > 0  # and the decode steps were captured graphs
    assert np.array_equal(tokens, off_tokens) and np.array_equal(logits, off_logits)
    for b, ids in enumerate(PROMPTS):
        t1, l1, _ = _run(model, True, [ids])
        assert np.array_equal(tokens[b], t1[0]) and np.array_equal(logits[b], l1[0]), f"row {b}"

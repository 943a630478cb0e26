"""Sliding-window rings (sliding_window_cache=1, docs/kv-geometry.md) on the cuda provider (GPU only).

The windowed families built with the builder's defaults for CUDA (fp16 and int4): the launcher
runs its ring path (decode blocks over the row's window, slots p mod ring; prompts staged and
copied into the ring), rows are bitwise their batch-1 runs, a captured step is bitwise the eager
one, a decode step is bitwise a prefill of its history (past the ring's size), and teacher-forced
logits follow cpu_reference on the same folder within the fp16 tolerance of
tests/cuda/test_families_cuda.py. The op-level ring cases (``GroupQueryAttention/ring-*``) run in
tests/cuda/test_ops.py with the rest of the kit.

    pytest -q tests/cuda/test_ring_cuda.py        # builds 8 tiny folders (~15 s each)
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
from core.testing.families import build_family  # noqa: E402
from providers.cuda.ops import group_query_attention as gqa  # noqa: E402

STEPS = 24
CAPACITY = 96
#: the last prompt is longer than the 40-slot ring (window 24): its prefill is staged
PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 21)), list(range(30, 75))]
WINDOWED = ["gemma2", "gemma3", "mistral", "smollm3"]
VARIANTS = [(f, p) for f in WINDOWED for p in ("fp16", "int4")]


@pytest.fixture(scope="session")
def cuda_default(tmp_path_factory):
    root = tmp_path_factory.mktemp("ring-cuda")
    built: dict[tuple[str, str], object] = {}

    def get(family: str, precision: str):
        if (family, precision) not in built:
            built[(family, precision)] = load_model(build_family(family, root / f"{family}-{precision}", precision,
                                                                 "cuda"))
        return built[(family, precision)]

    return get


def _run(model, provider, rows, force=None, **kw):
    session = Session(model, provider, batch=len(rows), capacity=CAPACITY, **kw)
    logits = []
    trace = decode(session, rows, STEPS, force=force,
                   observer=lambda *_: logits.append(np.asarray(session.last_logits(), np.float32)))
    return trace.tokens.T, np.stack(logits, 1), session


@pytest.mark.parametrize("family,precision", VARIANTS)
def test_ring_rows_are_bitwise_their_batch1_runs_and_capture_is_eager(cuda_default, family, precision):
    model = cuda_default(family, precision)
    before = gqa.stats()["ring"]
    tokens, logits, session = _run(model, "cuda", PROMPTS)
    assert gqa.stats()["ring"] > before, "the ring launches ran"
    assert any(session.state.kv.windows) and session.counters.replays > 0
    for b, ids in enumerate(PROMPTS):
        t1, l1, _ = _run(model, "cuda", [ids])
        assert np.array_equal(tokens[b], t1[0]) and np.array_equal(logits[b], l1[0]), f"{family} row {b}"
    t_e, l_e, eager = _run(model, "cuda", PROMPTS, capture=False)
    assert eager.counters.replays == 0
    assert np.array_equal(t_e, tokens) and np.array_equal(l_e, logits)


@pytest.mark.parametrize("family,precision", VARIANTS)
def test_ring_follows_cpu_reference_on_the_same_folder(cuda_default, family, precision):
    model = cuda_default(family, precision)
    ref_tokens, ref_logits, _ = _run(model, "cpu_reference", PROMPTS)
    force = [[int(t) for t in row[:STEPS]] for row in ref_tokens]
    _, got, _ = _run(model, "cuda", PROMPTS, force=force)
    spread = ref_logits.max(-1) - ref_logits.min(-1)
    assert (np.abs(got - ref_logits).max(-1) <= 0.02 * spread + 1e-2).all(), family
    assert (got.argmax(-1) == ref_logits.argmax(-1)).mean() >= 0.9, family


@pytest.mark.parametrize("family", WINDOWED)
def test_ring_decode_step_is_bitwise_a_prefill_of_its_history(cuda_default, family):
    """Past the ring's 40 slots: the decode steps read wrapped slots, the prefills of the same
    histories are staged; every query's chunks and arithmetic are the same."""
    model = cuda_default(family, "fp16")
    prompt = PROMPTS[2]
    run = decode(Session(model, "cuda", batch=1, capacity=CAPACITY), [prompt], STEPS, keep_logits=True)
    for k in (1, STEPS // 2, STEPS):
        history = prompt + [int(t) for t in run.tokens[:k, 0]]
        fresh = decode(Session(model, "cuda", batch=1, capacity=CAPACITY), [history], 0, keep_logits=True)
        assert np.array_equal(fresh.logits[0, 0], run.logits[k, 0]), f"{family} step {k}"

"""The tiny mixture-of-experts families (core.testing.moe_families) on the cuda provider (GPU only).

gpt-oss in its fp16 CUDA build (MoE nodes) and its int4 CPU build (QMoE, int4 block 32 experts
in the raw layout; fp32 activations): the cuda
MoE kernels (kernels/moe.cu) route on the device and run each (row, expert) product on its own,
so each row of a batch of 8 is bitwise its batch-1 run, eager and captured; the captured step
replays with the eager bits; and the teacher-forced logits follow cpu_reference's on the same
folder within fp16 tolerance. The int4 CUDA build (experts in ONNX Runtime's CUDA layout,
repacked at plan time by core.qmoe_layout) is held to the same. LFM2-MoE's fp16 CUDA
build computes its router in the graph (sigmoid as Neg/Exp/Reciprocal, TopK, GatherElements,
ReduceSum, Clip, Log, ScatterElements into ConstantOfShape's sentinel logits; kernels/router.cu):
the same properties hold for it, eager and captured, at batch 1 and 8.

    pytest -q tests/cuda/test_moe_cuda.py            # builds 4 tiny folders (~20 s each)
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu import require_gpu

require_gpu()
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai", reason="the builder (the models extra) makes the family folders")

from core.executor import node_infos  # noqa: E402
from core.generation.loop import decode  # noqa: E402
from core.models.model import load_model  # noqa: E402
from core.session import Session  # noqa: E402
from core.testing.families import prepared_family  # noqa: E402

STEPS = 12
CAPACITY = 64
PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 21)), [200, 7, 7, 31, 64, 128, 9, 250, 1, 33, 77, 12, 6],
           [3, 3, 3], [90, 44, 23, 8, 1, 2], [250, 249, 248, 247], list(range(30, 52, 2)), [11, 64]]
#: build -> (the builder target of the folder, the expert op it holds); "int4-cuda" holds its
#: experts in ONNX Runtime's CUDA layout, repacked at plan time (core.qmoe_layout).
FOLDERS = {"fp16": ("cuda", "MoE"), "int4": ("cpu", "QMoE"), "int4-cuda": ("cuda", "QMoE")}


@pytest.fixture(scope="session")
def moe_cuda(tmp_path_factory):
    """(family, precision, target) -> the loaded folder, built on first use."""
    root = tmp_path_factory.mktemp("moe-cuda")
    built: dict[tuple[str, str, str], object] = {}

    def get(family: str, precision: str, target: str = "cuda"):
        key = (family, precision, target)
        if key not in built:
            built[key] = load_model(prepared_family(family, root / f"{precision}-{target}", precision, target))
        return built[key]

    return get


def _gpt_oss(moe_cuda, build):
    target, op = FOLDERS[build]
    model = moe_cuda("gpt-oss", build.split("-")[0], target)
    ops = [n.op_type for n in node_infos(model.graph)]
    assert ops.count(op) == 2, "both layers run the expert op under test"
    return model


def _run(model, provider, rows, capture=None, force=None):
    session = Session(model, provider, batch=len(rows), capacity=CAPACITY, capture=capture)
    logits = []
    trace = decode(session, rows, STEPS, force=force,
                   observer=lambda *_: logits.append(np.asarray(session.last_logits(), np.float32)))
    return trace.tokens.T, np.stack(logits, 1), session


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("precision", sorted(FOLDERS))
def test_rows_of_a_batch_of_8_are_bitwise_their_batch1_runs(moe_cuda, precision, capture):
    model = _gpt_oss(moe_cuda, precision)
    tokens, logits, session = _run(model, "cuda", PROMPTS, capture)
    if capture:
        assert session.counters.captures == 1 and session.counters.replays >= STEPS - 2
    for b in (0, 3, 7):
        t1, l1, _ = _run(model, "cuda", [PROMPTS[b]], capture)
        assert np.array_equal(tokens[b], t1[0]) and np.array_equal(logits[b], l1[0]), f"row {b}"


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("precision", sorted(FOLDERS))
def test_captured_steps_are_bitwise_the_eager_ones(moe_cuda, precision, batch):
    model = _gpt_oss(moe_cuda, precision)
    eager_tokens, eager_logits, _ = _run(model, "cuda", PROMPTS[:batch], capture=False)
    tokens, logits, session = _run(model, "cuda", PROMPTS[:batch], capture=True)
    assert session.counters.captures == 1 and not session.counters.fallbacks
    assert np.array_equal(tokens, eager_tokens) and np.array_equal(logits, eager_logits)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("precision", sorted(FOLDERS))
def test_cuda_follows_cpu_reference_on_the_same_folder(moe_cuda, precision, batch):
    """Teacher-forced on cpu_reference's greedy tokens: logits within fp16 tolerance of the
    reference's (relative to the logit spread), top-1 equal on at least 90% of the steps."""
    model = _gpt_oss(moe_cuda, precision)
    ref_tokens, ref_logits, _ = _run(model, "cpu_reference", PROMPTS[:batch])
    force = [[int(t) for t in row[:STEPS]] for row in ref_tokens]
    _, got, _ = _run(model, "cuda", PROMPTS[:batch], capture=True, force=force)
    spread = ref_logits.max(-1) - ref_logits.min(-1)
    assert (np.abs(got - ref_logits).max(-1) <= 0.02 * spread + 1e-2).all()
    assert (got.argmax(-1) == ref_logits.argmax(-1)).mean() >= 0.9


def _lfm2(moe_cuda):
    model = moe_cuda("lfm2-moe", "fp16")
    ops = [n.op_type for n in node_infos(model.graph)]
    assert ops.count("MoE") == 2 and ops.count("TopK") == 2, "both MoE layers route in the graph"
    return model


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
def test_lfm2_moe_rows_of_a_batch_of_8_are_bitwise_their_batch1_runs(moe_cuda, capture):
    """The in-graph router (kernels/router.cu) on cuda: no UnsupportedOpError, batch-invariant."""
    model = _lfm2(moe_cuda)
    tokens, logits, session = _run(model, "cuda", PROMPTS, capture)
    if capture:
        assert session.counters.captures == 1 and session.counters.replays >= STEPS - 2
    for b in (0, 3, 7):
        t1, l1, _ = _run(model, "cuda", [PROMPTS[b]], capture)
        assert np.array_equal(tokens[b], t1[0]) and np.array_equal(logits[b], l1[0]), f"row {b}"


@pytest.mark.parametrize("batch", [1, 8])
def test_lfm2_moe_captured_is_eager_and_follows_cpu_reference(moe_cuda, batch):
    model = _lfm2(moe_cuda)
    eager_tokens, eager_logits, _ = _run(model, "cuda", PROMPTS[:batch], capture=False)
    tokens, logits, session = _run(model, "cuda", PROMPTS[:batch], capture=True)
    assert session.counters.captures == 1 and not session.counters.fallbacks
    assert np.array_equal(tokens, eager_tokens) and np.array_equal(logits, eager_logits)
    ref_tokens, ref_logits, _ = _run(model, "cpu_reference", PROMPTS[:batch])
    force = [[int(t) for t in row[:STEPS]] for row in ref_tokens]
    _, got, _ = _run(model, "cuda", PROMPTS[:batch], capture=True, force=force)
    spread = ref_logits.max(-1) - ref_logits.min(-1)
    assert (np.abs(got - ref_logits).max(-1) <= 0.02 * spread + 1e-2).all()
    assert (got.argmax(-1) == ref_logits.argmax(-1)).mean() >= 0.9

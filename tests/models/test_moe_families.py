"""The builder's mixture-of-experts families, tiny and random (core.testing.moe_families), on cpu_reference.

gpt-oss (8 experts, top 2, the clamped SwiGLU with biases, sinks, sliding/full layers) and
lfm2-moe (the Qwen-MoE expert layer: plain SwiGLU without biases, behind an in-graph sigmoid
router) are prepared in fp32 (MoE nodes) and int4 (QMoE nodes, int4 block 32 experts: gpt-oss's
re-quantized from the checkpoint's MXFP4 tensors, lfm2-moe's from the dense ones; MatMulNBits
elsewhere) through ``core.prepare``. The int4 folder is
run with its MatMulNBits at accuracy_level 0 (ORT's level 4 quantizes activations to int8 and
parts from the exact oracle at near-ties, test_families.py says how much): the router is a
MatMulNBits too, and a flipped route changes a token.

Per folder: 32 greedy tokens of three prompts run as one batch equal ONNX Runtime GenAI's (CPU)
batch-1 tokens; and each row is bitwise its batch-1 run (tokens and logits), while the rows'
tokens route to different experts in the same step.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from core.executor import node_infos
from core.generation.generate import generate
from core.generation.loop import decode
from core.models.model import load_model
from core.session import Session
from core.testing.families import prepared_family

pytest.importorskip("onnxruntime_genai")

from _ort import ort_greedy  # noqa: E402

pytest.importorskip("transformers")

pytestmark = pytest.mark.model

STEPS = 32
CAPACITY = 64
PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 21)), [200, 7, 7, 31, 64, 128, 9, 250, 1, 33, 77, 12, 6, 90, 44, 23, 8]]
#: family -> its number of MoE layers.
MOE_LAYERS = {"gpt-oss": 2, "lfm2-moe": 2}
#: (family, precision) -> the op its expert layers use.
FOLDERS = {("gpt-oss", "fp32"): "MoE", ("gpt-oss", "int4"): "QMoE", ("lfm2-moe", "fp32"): "MoE",
           ("lfm2-moe", "int4"): "QMoE"}


def _exact_matmulnbits(folder, out):
    """A copy of ``folder`` whose MatMulNBits nodes say accuracy_level 0."""
    import onnx

    shutil.copytree(folder, out)
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False)
    for node in graph.graph.node:
        for a in node.attribute:
            if node.op_type == "MatMulNBits" and a.name == "accuracy_level":
                a.i = 0
    onnx.save(graph, str(out / "model.onnx"))
    return out


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory):
    """(family, precision) -> its prepared CPU folder (int4: the accuracy_level 0 copy), built on first use."""
    root = tmp_path_factory.mktemp("moe-families")
    built: dict[tuple[str, str], object] = {}

    def get(family: str, precision: str):
        key = (family, precision)
        if key not in built:
            folder = prepared_family(family, root / precision, precision, "cpu")
            built[key] = folder if precision == "fp32" else _exact_matmulnbits(folder, root / f"{family}-exact")
        return built[key]

    return get


@pytest.mark.parametrize("family,precision", sorted(FOLDERS))
def test_greedy_tokens_equal_ort_genai(moe_dirs, family, precision):
    folder = moe_dirs(family, precision)
    model = load_model(folder)
    experts = [n for n in node_infos(model.graph) if n.op_type == FOLDERS[family, precision]]
    assert len(experts) == MOE_LAYERS[family]
    ours = generate(Session(model, "cpu_reference", batch=len(PROMPTS), capacity=CAPACITY), PROMPTS, STEPS)
    eos = set(model.config.eos_token_ids)
    distinct = set()
    for b, ids in enumerate(PROMPTS):
        tokens, reason = ours[b]
        if reason == "eos":  # we report the EOS token; ORT GenAI stops before appending it
            assert tokens[-1] in eos
            tokens = tokens[:-1]
        assert tokens == ort_greedy(folder, ids, STEPS), f"{family} {precision} prompt {b}"
        distinct |= set(tokens)
    assert len(distinct) > 1, "the random model should not repeat one token"


@pytest.mark.parametrize("family,precision", sorted(FOLDERS))
def test_rows_of_a_batch_are_bitwise_their_batch1_runs(moe_dirs, monkeypatch, family, precision):
    from providers.cpu_reference.ops import moe, qmoe

    model = load_model(moe_dirs(family, precision))
    routed = []
    for module in (moe, qmoe):
        monkeypatch.setattr(module, "route", lambda *a, _route=module.route: routed.append(_route(*a)) or routed[-1])

    def run(rows):
        session = Session(model, "cpu_reference", batch=len(rows), capacity=CAPACITY)
        logits = []
        trace = decode(session, rows, STEPS, observer=lambda *_: logits.append(session.last_logits()))
        return trace.tokens.T, np.stack(logits, 1)

    tokens, logits = run(PROMPTS)
    decode_steps = [r.experts for r in routed if r.experts.shape[0] == len(PROMPTS)]
    shared = [len({int(e) for e in row} & {int(e) for e in other}) > 0
              for step in decode_steps for row, other in zip(step, step[1:])]
    assert any(shared) and not all(shared), "rows should both share and not share experts"
    for b, ids in enumerate(PROMPTS):
        t1, l1 = run([ids])
        assert np.array_equal(tokens[b], t1[0]), f"{family} {precision} row {b} tokens"
        assert np.array_equal(logits[b], l1[0]), f"{family} {precision} row {b} logits"


@pytest.mark.parametrize("family,precision", sorted(FOLDERS))
def test_expert_budget_that_forces_page_ins_is_bitwise_the_resident_run(moe_dirs, family, precision):
    """A budget of 2 experts per layer plus a ring of 2 slots: the three rows route to up to 6
    experts per layer and step, so most routes page in (several waves per call); tokens and
    logits are bitwise those of the all-resident run, for the uniform plan (experts 0 and 1 of
    each layer) and for the plan made from the routing frequencies that run measured."""
    from core.runtime.experts import moe_layout
    from providers.cpu_reference.expert_pager import use_expert_residency

    model = load_model(moe_dirs(family, precision))
    counts, sizes = moe_layout(model.graph, model.initializers)
    assert set(counts.values()) == {8} and len(counts) == MOE_LAYERS[family]

    def run(budget, frequencies=None):
        session = Session(model, "cpu_reference", batch=len(PROMPTS), capacity=CAPACITY)
        residency = use_expert_residency(session, budget, ring_slots=2, frequencies=frequencies)
        logits = []
        trace = decode(session, PROMPTS, STEPS, observer=lambda *_: logits.append(session.last_logits()))
        return trace.tokens, np.stack(logits), residency

    tokens, logits, calibration = run(None)
    assert calibration.counters.page_ins == 0 and calibration.counters.hit_rate == 1.0
    measured = calibration.counters.frequencies()
    budget = (2 * len(counts) + 2) * max(sizes.values())
    for frequencies in (None, measured):
        paged_tokens, paged_logits, residency = run(budget, frequencies)
        c = residency.counters
        resident = residency.plan.resident
        assert sum(len(r) for r in resident.values()) == 2 * len(counts)
        if frequencies is None:
            assert all(r == {0, 1} for r in resident.values())
        else:  # the most-routed experts across the layers
            kept = [share[e] for node, share in measured.items() for e in resident[node]]
            left = [share[e] for node, share in measured.items() for e in range(8) if e not in resident[node]]
            assert min(kept) >= max(left)
        assert c.page_ins > 0 and 0 < c.hit_rate < 1
        assert c.page_in_bytes == c.page_ins * max(sizes.values())
        assert c.routed == c.hits + c.page_ins
        assert np.array_equal(paged_tokens, tokens) and np.array_equal(paged_logits, logits)


def test_a_released_layout_checkpoint_prepares_to_the_same_fp32_experts(moe_dirs, tmp_path, monkeypatch):
    """The tiny checkpoint stores its experts dense and in MXFP4; a released gpt-oss checkpoint
    stores MXFP4 only (with quantization_config mxfp4). ``lockstep prepare`` of that layout gives
    the same fp32 expert weights, so the tiny folders stand for the released ones."""
    import onnx

    from core.models.prepare import Variant, prepare
    from core.testing.families import write_checkpoint
    from core.testing.moe_families import released_layout

    def experts(folder):
        graph = onnx.load(str(folder / "model.onnx"))
        return {t.name: onnx.numpy_helper.to_array(t) for t in graph.graph.initializer if ".moe.experts." in t.name}

    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path / "cache"))
    released = prepare(Variant(str(released_layout(write_checkpoint("gpt-oss", tmp_path / "hf"))), "fp32", "cpu"))
    want, got = experts(moe_dirs("gpt-oss", "fp32")), experts(released)
    assert want.keys() == got.keys() and len(want) == 8
    assert all(np.array_equal(got[k], want[k]) for k in want)

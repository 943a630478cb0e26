"""The builder's dense decoder families, tiny and random (core.testing.families), on cpu_reference.

Each family's checkpoint goes through ``core.prepare`` (a Hugging Face folder source: content
hash, lock, the real builder) once per test session. Per family: 32 greedy tokens of three
prompts of different lengths, run as one batch, equal ONNX Runtime GenAI's (CPU, fp32) batch-1
tokens; and each row is bitwise its batch-1 run (tokens and logits).

The prompts plus 32 tokens stay within 64 positions and the sessions' capacity is 64: the
sliding windows (24) are exercised, and Phi-3 LongRoPE's If picks the short-factor caches in
both runtimes (ORT GenAI compares the current length with original_max_position_embeddings = 64,
Lockstep the mask width, which is the capacity: docs/ops.md 5).
"""

from __future__ import annotations

import numpy as np
import pytest

from core.generation.generate import generate
from core.generation.loop import decode
from core.models.model import load_model
from core.session import Session
from core.testing.families import FAMILIES, prepared_family

pytest.importorskip("onnxruntime_genai")

from _ort import ort_greedy, ort_teacher_forced  # noqa: E402

pytest.importorskip("transformers")

pytestmark = pytest.mark.model

STEPS = 32
CAPACITY = 64
PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 21)), [200, 7, 7, 31, 64, 128, 9, 250, 1, 33, 77, 12, 6, 90, 44, 23, 8]]
TESTED = sorted(FAMILIES)
#: Families also checked in the builder's int4 CPU variant: every one.
INT4 = TESTED


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """family -> its prepared fp32 CPU builder folder (built on first use in this session)."""
    root = tmp_path_factory.mktemp("families")
    built: dict[str, object] = {}

    def get(family: str):
        if family not in built:
            built[family] = prepared_family(family, root, "fp32", "cpu")
        return built[family]

    return get


@pytest.mark.parametrize("family", TESTED)
def test_greedy_tokens_equal_ort_genai(family_dirs, family):
    folder = family_dirs(family)
    model = load_model(folder)
    assert model.config.num_layers == 2 and model.config.hidden_size == 64
    ours = generate(Session(model, "cpu_reference", batch=len(PROMPTS), capacity=CAPACITY), PROMPTS, STEPS)
    eos = set(model.config.eos_token_ids)
    distinct = set()
    for b, ids in enumerate(PROMPTS):
        expected = ort_greedy(folder, ids, STEPS)
        tokens, reason = ours[b]
        if reason == "eos":  # we report the EOS token; ORT GenAI stops before appending it
            assert tokens[-1] in eos
            tokens = tokens[:-1]
        assert tokens == expected, f"{family} prompt {b}"
        distinct |= set(tokens)
    assert len(distinct) > 1, "the random model should not repeat one token"


@pytest.mark.parametrize("family", TESTED)
def test_rows_of_a_batch_are_bitwise_their_batch1_runs(family_dirs, family):
    model = load_model(family_dirs(family))

    def run(rows):
        session = Session(model, "cpu_reference", batch=len(rows), capacity=CAPACITY)
        logits = []
        trace = decode(session, rows, STEPS, observer=lambda *_: logits.append(session.last_logits()))
        return trace.tokens.T, np.stack(logits, 1)

    tokens, logits = run(PROMPTS)
    for b, ids in enumerate(PROMPTS):
        t1, l1 = run([ids])
        assert np.array_equal(tokens[b], t1[0]), f"{family} row {b} tokens"
        assert np.array_equal(logits[b], l1[0]), f"{family} row {b} logits"


def test_families_use_their_distinguishing_features(family_dirs):
    """The tiny graphs carry what makes each family differ (so the parity above covers it)."""
    from core.executor import node_infos

    def attrs_of(family, op):
        return [n.attrs for n in node_infos(load_model(family_dirs(family)).graph) if n.op_type == op]

    assert any(a.get("local_window_size") == 24 for a in attrs_of("mistral", "GroupQueryAttention"))
    assert any(a.get("softcap", 0) > 0 for a in attrs_of("gemma2", "GroupQueryAttention"))
    assert attrs_of("gemma2", "Gelu") and attrs_of("phi3-longrope", "If")
    assert not any(a.get("sliding_window_cache") for f in ("mistral", "gemma2", "smollm3")
                   for a in attrs_of(f, "GroupQueryAttention"))


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_fp16_cuda_variant_with_fused_qk_norm_follows_the_fp32_cpu_variant(family_dirs, tmp_path_factory, family):
    """The builder's fp16 CUDA graph of a q/k-norm family passes q_norm/k_norm into
    GroupQueryAttention (inputs 14, 15; docs/ops.md 1.3.0) where its fp32 CPU graph writes
    Reshape + SimplifiedLayerNormalization nodes. cpu_reference runs the CUDA variant of the same
    checkpoint: teacher-forced on the fp32 variant's greedy tokens, its logits stay within fp16
    tolerance (2% of the logit spread) and its top-1 agrees on at least 90% of the steps."""
    from core.executor import node_infos

    fp32 = load_model(family_dirs(family))
    fp16 = load_model(prepared_family(family, tmp_path_factory.mktemp(f"{family}-fp16"), "fp16", "cuda"))
    gqa = [n for n in node_infos(fp16.graph) if n.op_type == "GroupQueryAttention"]
    assert gqa and all(len(n.inputs) > 15 and n.inputs[14] and n.inputs[15] for n in gqa)
    assert not any(n.op_type == "SimplifiedLayerNormalization" and "q_norm" in n.name for n in node_infos(fp16.graph))

    def run(model, force=None):
        session = Session(model, "cpu_reference", batch=len(PROMPTS), capacity=CAPACITY)
        logits = []
        trace = decode(session, PROMPTS, STEPS, force=force,
                       observer=lambda *_: logits.append(np.asarray(session.last_logits(), np.float32)))
        return trace.tokens.T, np.stack(logits, 1)

    tokens, want = run(fp32)
    _, got = run(fp16, force=[[int(t) for t in row[:STEPS]] for row in tokens])
    spread = want.max(-1) - want.min(-1)
    assert (np.abs(got - want).max(-1) <= 0.02 * spread).all()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.fixture(scope="session")
def int4_dirs(tmp_path_factory):
    """family -> (its prepared int4 CPU folder as built: MatMulNBits accuracy_level 4, and a copy
    whose MatMulNBits nodes say accuracy_level 0)."""
    import shutil

    import onnx

    root = tmp_path_factory.mktemp("families-int4")
    built: dict[str, tuple] = {}

    def get(family: str):
        if family not in built:
            folder = prepared_family(family, root, "int4", "cpu")
            exact = root / f"{family}-accuracy0"
            shutil.copytree(folder, exact)
            graph = onnx.load(str(exact / "model.onnx"), load_external_data=False)
            levels = [a for n in graph.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
                      if a.name == "accuracy_level"]
            assert levels and all(a.i == 4 for a in levels)  # the builder's CPU default
            for a in levels:
                a.i = 0
            onnx.save(graph, str(exact / "model.onnx"))
            built[family] = (folder, exact)
        return built[family]

    return get


@pytest.mark.parametrize("family", INT4)
def test_int4_greedy_tokens_equal_ort_genai_with_exact_matmulnbits(int4_dirs, family):
    """int4 CPU (MatMulNBits block 32, fp32 scales; int4 GatherBlockQuantized embedding where tied):
    with accuracy_level 0, ORT's MatMulNBits dequantizes and multiplies in fp32, as cpu_reference
    does; the 32 greedy tokens of the batch then equal ORT GenAI's batch-1 tokens."""
    _, folder = int4_dirs(family)
    model = load_model(folder)
    ours = generate(Session(model, "cpu_reference", batch=len(PROMPTS), capacity=CAPACITY), PROMPTS, STEPS)
    for b, ids in enumerate(PROMPTS):
        tokens, reason = ours[b]
        if reason == "eos":
            tokens = tokens[:-1]
        assert tokens == ort_greedy(folder, ids, STEPS), f"{family} prompt {b}"


@pytest.mark.parametrize("family", INT4)
def test_int4_as_built_teacher_forced_logits_close_to_ort_genai(int4_dirs, family):
    """The folder as built (accuracy_level 4): ORT quantizes each block of 32 activations to int8
    (docs/ops.md 2, "accuracy_level"), cpu_reference does not, so greedy tokens part at near-ties
    (observed: llama 2 of 3 prompts equal over 32 steps, qwen2 1 of 3, phi3 3 of 3). Teacher-forced
    on ORT GenAI's tokens, the logits stay within 5% of the logit spread, top-1 equal on >= 90%
    of the steps."""
    folder, _ = int4_dirs(family)
    model = load_model(folder)
    ids = PROMPTS[2]
    forced = ort_greedy(folder, ids, STEPS)
    want = ort_teacher_forced(folder, ids, forced)
    session = Session(model, "cpu_reference", batch=1, capacity=CAPACITY)
    got = []
    decode(session, [ids], len(forced), force=[list(forced)], observer=lambda *_: got.append(session.last_logits()[0]))
    got = np.stack(got)
    spread = want.max(-1) - want.min(-1)
    assert (np.abs(got - want).max(-1) <= 0.05 * spread).all(), family
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9, family

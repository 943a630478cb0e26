"""End to end on SmolLM2-135M against ONNX Runtime GenAI on the same model folder (the oracle)."""

import numpy as np
import pytest

from core.generation.generate import generate
from core.generation.loop import decode
from core.session import Session

og = pytest.importorskip("onnxruntime_genai")

from _ort import ort_greedy, ort_teacher_forced  # noqa: E402

pytestmark = pytest.mark.model


def test_fp32_greedy_tokens_equal_ort_genai(fp32_model, fp32_model_dir, prompt_ids):
    """32 greedy tokens per prompt, 5 prompts as one batch, equal ORT GenAI's batch-1 tokens."""
    session = Session(fp32_model, "cpu_reference", batch=len(prompt_ids), capacity=128)
    ours = generate(session, prompt_ids, max_new_tokens=32)
    eos = set(fp32_model.config.eos_token_ids)
    for b, ids in enumerate(prompt_ids):
        expected = ort_greedy(fp32_model_dir, ids, 32)
        tokens, reason = ours[b]
        if reason == "eos":  # we report the EOS token; ORT GenAI stops before appending it
            assert tokens[-1] in eos
            tokens = tokens[:-1]
        assert tokens == expected, f"prompt {b}"


def teacher_forced_logits(model, ids, forced):
    session = Session(model, "cpu_reference", batch=1, capacity=128)
    out = []
    decode(session, [ids], len(forced), force=[list(forced)], observer=lambda *_: out.append(session.last_logits()[0]))
    return np.stack(out)


def test_fp32_teacher_forced_logits_match_ort_genai(fp32_model, fp32_model_dir, prompt_ids):
    """fp32: every step's logits within 1e-3 absolute of ORT GenAI (fp32 rounding over 30 layers)."""
    ids = prompt_ids[0]
    forced = ort_greedy(fp32_model_dir, ids, 16)
    ref = ort_teacher_forced(fp32_model_dir, ids, forced)
    got = teacher_forced_logits(fp32_model, ids, forced)
    assert np.abs(got - ref).max() < 1e-3


def test_int4_teacher_forced_logits_close_to_ort_genai(int4_model, int4_model_dir, prompt_ids):
    """int4 CPU: ORT GenAI's MatMulNBits (accuracy_level 4) quantizes activations to int8 per
    block, while the reference dequantizes the weights and multiplies in fp32. The activation
    rounding (~1/254 of each block's max) accumulates over 30 layers, so the logits are compared
    relative to their spread: max |diff| <= 5% of the logit range, and top-1 agreement on at
    least 90% of steps."""
    ids = prompt_ids[1]
    forced = ort_greedy(int4_model_dir, ids, 24)
    ref = ort_teacher_forced(int4_model_dir, ids, forced)
    got = teacher_forced_logits(int4_model, ids, forced)
    spread = ref.max(axis=1) - ref.min(axis=1)
    assert (np.abs(got - ref).max(axis=1) <= 0.05 * spread).all()
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9

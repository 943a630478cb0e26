"""SmolLM2-135M (9 query heads, 3 KV heads) sharded over 3 simulated ranks against the
unsharded run on cpu_reference (docs/parallel.md, docs/cases.md 33)."""

import numpy as np
import pytest

from core.models.model import ModelError
from core.session import Session

pytestmark = pytest.mark.model

#: docs/parallel.md: fp32 (and int4 with fp32 scales) within 1e-5 x max|logit| of the unsharded run
RTOL = 1e-5
STEPS = 8


@pytest.mark.parametrize("variant", ["fp32", "int4"])
def test_smollm2_three_ranks_match_the_unsharded_run(variant, fp32_model_dir, int4_model_dir, fp32_model):
    folder = fp32_model_dir if variant == "fp32" else int4_model_dir
    tok = fp32_model.tokenizer
    ids = [tok.encode(tok.apply_chat_template("What is the capital of France?"))]
    ref = Session(folder, batch=1, capacity=128)
    tokens, logits = [int(ref.prefill(ids).tokens[0])], [ref.last_logits()]
    for _ in range(STEPS):
        tokens.append(int(ref.step().tokens[0]))
        logits.append(ref.last_logits())
    ref.close()
    tp = Session(folder, batch=1, capacity=128, tensor_parallel=3)
    try:
        got, tp_logits = [int(tp.prefill(ids).tokens[0])], [tp.last_logits()]
        for i in range(STEPS):  # fed the reference's tokens: both see the same history
            got.append(int(tp.step(force_tokens=[tokens[i]]).tokens[0]))
            tp_logits.append(tp.last_logits())
        assert tp.counters.all_reduces == (STEPS + 1) * (1 + 2 * 30)
    finally:
        tp.close()
    ref_l, tp_l = np.array(logits), np.array(tp_logits)
    assert np.abs(tp_l - ref_l).max() <= RTOL * np.abs(ref_l).max()
    assert got == tokens
    assert tok.decode(tokens).startswith("The capital of France is Paris")


def test_smollm2_two_ranks_are_refused(fp32_model_dir):
    with pytest.raises(ModelError, match="3 KV heads, which 2 ranks cannot share evenly"):
        Session(fp32_model_dir, batch=1, tensor_parallel=2)

"""The engine beside the fixed-batch Session: the same rows give bitwise the same tokens and
logits, and the logprobs the engine reports are the log-softmax of those logits (cpu_reference;
the cuda twin is tests/cuda/test_engine_logprobs_cuda.py)."""

from __future__ import annotations

import numpy as np
import pytest

from core.engine import Engine
from core.engine.logprobs import chosen
from core.errors import RequestError
from core.runtime.runner import Runner
from core.testing.engine_twins import engine_rows, session_rows
from core.testing.tiny_model import make_tiny_model, write_byte_tokenizer

CAPACITY = 64
PROMPTS = [[5, 17, 33, 2, 9], [40, 41], [7, 7, 7, 8, 90, 3, 11, 12, 13]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return Runner(write_byte_tokenizer(make_tiny_model(tmp_path_factory.mktemp("logprobs"))), "cpu_reference")


def test_chosen_is_the_fp32_log_softmax():
    x = np.array([[1.0, 3.0, -2.0, 3.5]], np.float16)
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum())
    lp = chosen(x, 1)
    assert lp.token == 1 and lp.top_token == 3
    assert lp.logprob == pytest.approx(ref[0, 1], abs=1e-6) and lp.top_logprob == pytest.approx(ref[0, 3], abs=1e-6)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        chosen(x, 4)


@pytest.mark.parametrize("sampled", [False, True])
def test_session_and_engine_give_bitwise_equal_tokens_and_logits(runner, sampled):
    sampling = [{"do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 100 + i} for i in range(len(PROMPTS))] \
        if sampled else None
    s_tokens, s_logits = session_rows(runner, PROMPTS, MAX_TOKENS, CAPACITY, sampling)
    e_tokens, e_logits, e_logprobs = engine_rows(runner, PROMPTS, MAX_TOKENS, CAPACITY, sampling)
    for b in range(len(PROMPTS)):
        n = len(e_tokens[b])
        assert n == MAX_TOKENS and e_tokens[b] == s_tokens[b, :n].tolist()
        assert len(e_logits[b]) == n == len(e_logprobs[b])  # the logprobs path ran for every token
        for t in range(n):
            assert np.array_equal(e_logits[b][t], s_logits[b, t])  # bitwise
            want = chosen(s_logits[b, t], int(s_tokens[b, t]))
            assert e_logprobs[b][t] == want and want.logprob <= 0.0


def test_requests_without_logprobs_carry_none(runner):
    engine = Engine(runner, max_batch=2, capacity=CAPACITY)
    with_lp = engine.submit(PROMPTS[0], max_tokens=3, logprobs=True)
    without = engine.submit(PROMPTS[1], max_tokens=3)
    engine.run_until_idle()
    assert all(e.logprobs is None for e in without)
    assert all(len(e.logprobs or []) == len(e.token_ids) for e in with_lp)
    with pytest.raises(RequestError, match="logprobs must be true or false"):
        engine.request(PROMPTS[0], 3, logprobs=1)

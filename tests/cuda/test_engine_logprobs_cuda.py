"""The cuda twin of tests/unit/test_engine_logprobs.py (GPU only): the fixed-batch Session and
the engine (its decode buckets captured and replayed) give bitwise the same tokens and logits
for the same rows, and the engine's logprobs are the fp32 log-softmax of those logits."""

from _gpu import require_gpu

require_gpu()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from core.engine.logprobs import chosen  # noqa: E402
from core.runtime.runner import Runner  # noqa: E402
from core.testing.engine_twins import engine_rows, session_rows  # noqa: E402

CAPACITY = 64
PROMPTS = [[5, 17, 33, 2, 9], [40, 41], [7, 7, 7, 8, 90, 3, 11, 12, 13]]
MAX_TOKENS = 12


@pytest.mark.parametrize("sampled", [False, True])
def test_session_and_engine_give_bitwise_equal_tokens_and_logits_on_cuda(model_dir, sampled):
    runner = Runner(model_dir, "cuda")
    sampling = [{"do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 100 + i} for i in range(len(PROMPTS))] \
        if sampled else None
    s_tokens, s_logits = session_rows(runner, PROMPTS, MAX_TOKENS, CAPACITY, sampling)
    e_tokens, e_logits, e_logprobs = engine_rows(runner, PROMPTS, MAX_TOKENS, CAPACITY, sampling)
    for b in range(len(PROMPTS)):
        n = len(e_tokens[b])
        assert n >= 1 and e_tokens[b] == s_tokens[b, :n].tolist()
        assert len(e_logits[b]) == n == len(e_logprobs[b])  # the logprobs path ran for every token
        for t in range(n):
            assert np.array_equal(e_logits[b][t], s_logits[b, t]), (b, t)  # bitwise
            assert e_logprobs[b][t] == chosen(s_logits[b, t], int(s_tokens[b, t]))

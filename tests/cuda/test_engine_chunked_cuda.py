"""The cuda twin of tests/unit/test_engine_chunked.py (GPU only): long prompts prefilled in
small chunks on the fixed grid of absolute positions, with captured decode buckets between
them, give every request its solo run with the same chunks; and whether cuda's chunked prefill
is bitwise its whole-prompt prefill (tokens and logits against the fixed-batch Session)."""

from _gpu import require_gpu

require_gpu()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from core.runtime.runner import Runner  # noqa: E402
from core.testing.arrivals import fuzz_arrivals  # noqa: E402
from core.testing.engine_twins import assert_rows_agree, engine_rows, session_rows  # noqa: E402

LONG = [int(t) for t in np.random.default_rng(3).integers(3, 250, 45)]


def test_arrivals_with_long_prompts_in_small_chunks_equal_their_solo_runs_on_cuda(model_dir):
    report = fuzz_arrivals(Runner(model_dir, "cuda"), seed=49, requests=120, max_batch=8, capacity=64,
                           prefill_chunk=8, prompt_share=0.7, solo="engine", prefill_tokens=16)
    assert report.mismatches == []
    assert report.prefill_chunks > 120 and report.captures >= 3 and report.replays > 50  # both paths ran


@pytest.mark.parametrize("sampled", [False, True])
def test_chunked_prefill_is_bitwise_the_whole_prompt_on_cuda(model_dir, sampled):
    runner = Runner(model_dir, "cuda")
    prompts = [LONG, LONG[:9], LONG[:20]]
    sampling = [{"do_sample": True, "temperature": 0.9, "top_k": 30, "seed": 7 + i} for i in range(3)] \
        if sampled else None
    s_tokens, s_logits = session_rows(runner, prompts, 6, 64, sampling)
    for chunk in (1, 3, 8):
        e_tokens, e_logits, _ = engine_rows(runner, prompts, 6, 64, sampling, max_batch=4, prefill_chunk=chunk)
        assert_rows_agree(runner, e_tokens, e_logits, s_tokens, s_logits, chunk)

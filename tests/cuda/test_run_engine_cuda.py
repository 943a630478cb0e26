"""The cuda twin of tests/unit/test_run_engine.py (GPU only): ``core.run`` goes through the
engine (captured decode buckets) and its rows are bitwise the fixed-batch Session path's for
unequal prompts, greedy and seeded."""

from _gpu import require_gpu

require_gpu()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import core  # noqa: E402
from core.runtime.runner import Runner  # noqa: E402
from core.session import Session  # noqa: E402

PROMPTS = [[int(t) for t in np.random.default_rng(5).integers(3, 250, n)] for n in (3, 21, 8, 34)]
NEWS = [9, 5, 12, 7]


@pytest.mark.parametrize("sampled", [False, True])
def test_core_run_on_the_engine_is_bitwise_the_session_path_on_cuda(model_dir, sampled):
    runner = Runner(model_dir, "cuda")
    sampling = [{"do_sample": True, "temperature": 0.9, "top_k": 40, "seed": 21 + i} for i in range(4)] \
        if sampled else None
    got = core.run(runner, input_ids=PROMPTS, max_new_tokens=NEWS, sampling=sampling)
    assert got.counters["engine_requests"] == 4 and got.counters["captures"] >= 1  # the engine, captured
    session = Session(runner, batch=4, capacity=64, kv_policy="fixed")
    want = session.stream(PROMPTS, NEWS, sampling=sampling).run()
    session.close()
    assert [r.output_ids for r in got.rows] == [w.output_ids for w in want]
    assert [r.finish_reason for r in got.rows] == [w.finish_reason for w in want]

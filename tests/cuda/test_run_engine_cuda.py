"""The cuda twin of tests/unit/test_run_engine.py and test_run_engine_budget.py (GPU only):
``core.run`` goes through the engine (captured decode buckets) and its rows are bitwise the
fixed-batch Session path's for unequal prompts, greedy and seeded, with weights resident or
streamed under a weight budget."""

from _gpu import require_gpu

require_gpu()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import core  # noqa: E402
from core.runtime.runner import Runner  # noqa: E402
from core.session import Session  # noqa: E402
from core.testing.engine_twins import assert_tight_capacity_rows  # noqa: E402

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


@pytest.mark.parametrize("sampled", [False, True])
def test_a_slot_filled_to_its_last_position_on_cuda_equals_each_rows_session(model_dir, sampled):
    """Row 0 needs exactly the capacity (30 + 3 - 1 = 32) while row 1 decodes on: the captured
    steps queued past row 0's last token put its lane back to 0 (no write past its slot), and
    each row equals its batch-1 Session at that capacity."""
    runner = Runner(model_dir, "cuda")
    ids, news = [PROMPTS[3][:30], PROMPTS[0]], [3, 20]
    sampling = [{"do_sample": True, "temperature": 0.9, "top_k": 40, "seed": 21 + i} for i in range(2)] \
        if sampled else None
    assert_tight_capacity_rows(runner, ids, news, 32, sampling)


@pytest.mark.parametrize("sampled", [False, True])
def test_a_weight_budget_streams_through_the_engine_bitwise_on_cuda(model_dir, sampled, monkeypatch):
    """Streamed weights on the engine's captured buckets: bitwise the resident engine and the
    streamed Session path, the streaming counters metered as the Session meters them."""
    from core.runtime import residency

    monkeypatch.setattr(residency, "SMALL_BYTES", 512)  # the tiny models' matrices stream too
    with pytest.raises(residency.BudgetError) as info:  # the smallest budget the cuda forms allow
        Runner(model_dir, "cuda", weight_budget=1)
    smallest = int(str(info.value).rsplit("is ", 1)[1].split()[0].replace(",", ""))
    runner = Runner(model_dir, "cuda", weight_budget=smallest)
    r = runner.residency
    assert r.streams
    sampling = [{"do_sample": True, "temperature": 0.9, "top_k": 40, "seed": 21 + i} for i in range(4)] \
        if sampled else None
    news = [8] * 4
    got = core.run(runner, input_ids=PROMPTS, max_new_tokens=news, sampling=sampling)
    c = got.counters
    assert c["engine_requests"] == 4 and c["captures"] >= 1  # the engine, captured
    assert c["htod_bytes"] > 0 and c["page_ins"] > 0 and c["htod_bytes_per_token"] > 0
    resident = core.run(Runner(model_dir, "cuda"), input_ids=PROMPTS, max_new_tokens=news, sampling=sampling)
    assert [x.output_ids for x in got.rows] == [x.output_ids for x in resident.rows]
    session = Session(runner, batch=4, capacity=64, kv_policy="fixed")
    want = session.stream(PROMPTS, news, sampling=sampling).run()
    s = session.counters
    session.close()
    assert [x.output_ids for x in got.rows] == [w.output_ids for w in want]
    if all(len(x.output_ids) == 8 for x in got.rows):  # every step advanced every row on both paths
        assert c["htod_bytes_per_token"] == s.htod_bytes_per_token
        assert c["page_ins_per_token"] == s.page_ins_per_token

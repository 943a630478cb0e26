"""One decode path: ``core.run``, ``core.stream`` and ``lockstep run`` go through the engine
(its ``engine_requests`` counter says so), and their rows are bitwise the fixed-batch Session
path's for a batch of unequal prompts, greedy and seeded, a slot as tight as a Session's row
included (cpu_reference; the cuda twin is tests/cuda/test_run_engine_cuda.py). Budgets:
tests/unit/test_run_engine_budget.py; tensor parallel: tests/unit/test_tensor_parallel_engine.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

import core
from core.cli import main
from core.runtime.runner import Runner
from core.session import Session
from core.testing.engine_twins import assert_tight_capacity_rows
from core.testing.tiny_model import make_tiny_model, write_byte_tokenizer

PROMPTS = [[int(t) for t in np.random.default_rng(5).integers(3, 250, n)] for n in (3, 21, 8, 34)]
NEWS = [9, 5, 12, 7]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_byte_tokenizer(make_tiny_model(tmp_path_factory.mktemp("run_engine") / "m"))


@pytest.fixture(scope="module")
def runner(folder):
    return Runner(folder, "cpu_reference")


def _sampling(sampled: bool):
    return [{"do_sample": True, "temperature": 0.9, "top_k": 40, "seed": 21 + i} for i in range(4)] if sampled else None


@pytest.mark.parametrize("sampled", [False, True])
def test_core_run_goes_through_the_engine_and_equals_the_session_path_bitwise(runner, sampled):
    got = core.run(runner, input_ids=PROMPTS, max_new_tokens=NEWS, sampling=_sampling(sampled), stop_token_ids=[7])
    assert got.counters["engine_requests"] == len(PROMPTS)  # every row was an engine request
    assert got.counters["decode_steps"] > 0 and got.counters["prefill_tokens"] == sum(map(len, PROMPTS))
    assert got.counters["prefill_runs"] == 1  # rows arriving together: one padded prefill, as the Session's
    session = Session(runner, batch=len(PROMPTS), capacity=64, kv_policy="fixed")
    want = session.stream(PROMPTS, NEWS, sampling=_sampling(sampled), stop_token_ids=[7]).run()
    session.close()
    assert [r.output_ids for r in got.rows] == [w.output_ids for w in want]
    assert [(r.text, r.finish_reason, r.stop) for r in got.rows] == [(w.text, w.finish_reason, w.stop) for w in want]
    assert all(len(r.output_ids) > 1 for r in got.rows)  # decode steps made tokens, not just the prefill
    if sampled:
        assert [r.sampling["seed"] for r in got.rows] == [21, 22, 23, 24]


def test_streamed_deltas_join_to_the_rows_and_end_once(folder):
    st = core.stream(folder, prompts=["hello there", "a"], max_new_tokens=[6, 0], chat=False, stop=["zz"])
    deltas = list(st)
    result = st.result()
    for b, row in enumerate(result.rows):
        mine = [d for d in deltas if d.row == b]
        assert "".join(d.text for d in mine) == row.text
        assert [t for d in mine for t in d.token_ids] == row.output_ids
        assert [d.finish_reason for d in mine if d.finish_reason] == [row.finish_reason]
    assert result.rows[1].finish_reason == "length" and result.rows[1].output_ids == []
    assert result.counters["engine_requests"] == 1  # the 0-token row never reached the engine


def test_lockstep_run_json_reports_the_engine_counters(folder, capsys):
    code = main(["run", "--model", str(folder), "--raw", "--json", "--max-new-tokens", "3", "--prompt", "hi",
                 "--prompt", "longer prompt"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["counters"]["engine_requests"] == 2
    assert [len(r["output_ids"]) for r in doc["rows"]] == [3, 3]


def test_a_weight_budget_runs_on_the_engine_with_the_same_rows(folder, runner):
    # budgets that stream are tests/unit/test_run_engine_budget.py
    engine = core.run(runner, input_ids=PROMPTS[:2], max_new_tokens=4)
    budget = core.run(folder, input_ids=PROMPTS[:2], max_new_tokens=4, weight_budget="1GiB")
    assert engine.counters["engine_requests"] == 2 and budget.counters["engine_requests"] == 2
    assert [r.output_ids for r in budget.rows] == [r.output_ids for r in engine.rows]


@pytest.mark.parametrize("sampled", [False, True])
def test_a_capacity_of_prompt_plus_new_minus_one_runs_on_the_engine_bitwise_the_session(runner, sampled):
    # row 0 needs exactly the capacity (30 + 3 - 1 = 32: the last token's KV is never written);
    # row 1 decodes on, so steps queued ahead run row 0 past its last token, where its length
    # reaches the capacity (SlotState.decode puts it back to 0 instead of writing past the slot)
    ids, news = [PROMPTS[3][:30], PROMPTS[0]], [3, 20]
    sampling = _sampling(sampled)[:2] if sampled else None
    assert_tight_capacity_rows(runner, ids, news, 32, sampling)
    with pytest.raises(core.RequestError, match="it needs 33 KV positions but the capacity is 32"):
        core.run(runner, input_ids=ids, max_new_tokens=[4, 20], capacity=32)


def test_a_failing_step_raises_to_the_caller_of_core_run(runner, monkeypatch):
    """A fault is the caller's error, as on the Session path (not a row "error", which means
    non-finite logits), and the runner serves the next request right."""
    from core.engine import slots

    real = slots.SlotState.decode

    def broken(self, *args):
        raise RuntimeError("device fault")

    monkeypatch.setattr(slots.SlotState, "decode", broken)
    with pytest.raises(RuntimeError, match="device fault"):
        core.run(runner, input_ids=PROMPTS[:2], max_new_tokens=4)
    monkeypatch.setattr(slots.SlotState, "decode", real)
    again = core.run(runner, input_ids=PROMPTS[:2], max_new_tokens=4)
    alone = [core.run(runner, input_ids=[p], max_new_tokens=4).rows[0].output_ids for p in PROMPTS[:2]]
    assert [r.output_ids for r in again.rows] == alone


def test_prompts_of_unlike_lengths_prefill_in_length_groups_and_stay_bitwise(runner):
    """Two long and three short prompts: two padded runs (the Session's length groups), not
    one run padded to the longest nor five runs; the rows as the Session gives them."""
    prompts = [PROMPTS[3][:30] * 2, [7, 8], PROMPTS[3][:29] * 2, [9, 10, 11], [12, 13]]
    got = core.run(runner, input_ids=prompts, max_new_tokens=5)
    assert got.counters["prefill_runs"] == 2 and got.counters["engine_requests"] == 5
    session = Session(runner, batch=5, capacity=128, kv_policy="fixed")
    want = session.stream(prompts, 5).run()
    session.close()
    assert [r.output_ids for r in got.rows] == [w.output_ids for w in want]

"""Issue 39 on the tiny model: threads sharing a Runner, continuation edge cases and bad
requests; after each, the next request is bitwise a fresh run's."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import core
from core.runtime.runner import Runner
from core.session import RequestError, Session, StaleGenerationError
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider

A, B = [[5, 6, 7], [8, 9]], [[40, 41], [42, 43, 44, 45]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("reliability"))


@pytest.fixture(scope="module")
def runner(model_dir):
    return Runner(model_dir, CpuReferenceProvider())


def fresh(model_dir, prompts, new) -> list[list[int]]:
    """Each row decoded alone on a Runner of its own."""
    r = Runner(model_dir, CpuReferenceProvider())
    return [core.run(r, input_ids=[p], max_new_tokens=n).rows[0].output_ids
            for p, n in zip(prompts, new if isinstance(new, list) else [new] * len(prompts))]


def test_threads_sharing_a_runner_get_their_solo_results(model_dir, runner):
    prompts = [[i + 1, (7 * i) % 250 + 1, 3] for i in range(16)]
    want = fresh(model_dir, prompts, 10)
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(rows):
        try:
            for i in rows:
                got[i] = core.run(runner, input_ids=[prompts[i]], max_new_tokens=10).rows[0].output_ids
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(range(k, 16, 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [got[i] for i in range(16)] == want
    assert core.run(runner, input_ids=[prompts[0]], max_new_tokens=10).rows[0].output_ids == want[0]


def test_extend_after_a_zero_token_turn_continues_its_own_prompt(model_dir, runner):
    s = Session(runner, batch=2, capacity=64)
    s.stream(B, max_new_tokens=8).run()  # an earlier request leaves its KV in the state
    g = s.stream(A, max_new_tokens=0)
    assert [d.finish_reason for d in g] == ["length", "length"]
    g.extend([[11, 12], [13]], max_new_tokens=6)
    list(g)
    other = Session(Runner(model_dir, CpuReferenceProvider()), batch=2, capacity=64)
    h = other.stream(A, max_new_tokens=0)
    h.run()
    h.extend([[11, 12], [13]], max_new_tokens=6).run()
    assert [r.output_ids for r in g.rows] == [r.output_ids for r in h.rows]
    # and the tokens of one run over the whole history
    assert [r.output_ids for r in g.rows] == fresh(model_dir, [a + e for a, e in zip(A, [[11, 12], [13]])], 6)


def test_resuming_an_abandoned_generation_raises_and_the_new_request_is_right(model_dir, runner):
    s = Session(runner, batch=2, capacity=64)
    old = iter(s.stream(A, max_new_tokens=12))
    for _ in range(4):
        next(old)
    new = s.stream(B, max_new_tokens=9)
    it = iter(new)
    first = next(it)
    with pytest.raises(StaleGenerationError):
        next(old)
    rows = [list(first.token_ids) if first.row == b else [] for b in range(2)]
    for d in it:
        rows[d.row] += d.token_ids
    assert rows == fresh(model_dir, B, 9) == [r.output_ids for r in new.rows]


def test_extending_a_stale_generation_changes_nothing(model_dir, runner):
    s = Session(runner, batch=2, capacity=64)
    g = s.stream(A, max_new_tokens=5)
    g.run()
    before = [(list(r.prompt_ids), list(r.output_ids), r.finish_reason) for r in g.rows]
    s.stream([[1], [2]], max_new_tokens=2).run()  # another request: the KV holds it now
    with pytest.raises(StaleGenerationError):
        g.extend([[3], [4]], max_new_tokens=4)
    assert [(r.prompt_ids, r.output_ids, r.finish_reason) for r in g.rows] == before
    assert [r.output_ids for r in s.stream(B, max_new_tokens=9).run()] == fresh(model_dir, B, 9)


def test_a_refused_extend_leaves_the_generation_continuable(model_dir, runner):
    s = Session(runner, batch=2, capacity=64)
    g = s.stream(A, max_new_tokens=5)
    g.run()
    before = [(list(r.prompt_ids), list(r.output_ids)) for r in g.rows]
    for bad in ([[3], [10**6]], [[3], "ab"], [[3], [1.5]], None, [[3]]):
        with pytest.raises(RequestError):
            g.extend(bad, max_new_tokens=4)
        assert [(r.prompt_ids, r.output_ids) for r in g.rows] == before
    with pytest.raises(RequestError):
        g.extend([[3], [4]], max_new_tokens=4, sampling={"temperature": -1.0})
    g.extend([[3], [4]], max_new_tokens=4).run()
    history = [p + o + [t] for (p, o), t in zip(before, [3, 4])]
    assert [r.output_ids for r in g.rows] == fresh(model_dir, history, 4)


def test_max_new_tokens_per_row_is_checked_against_each_rows_own_prompt(runner):
    s = Session(runner, batch=2, capacity=16)
    long, short = list(range(1, 15)), [1, 2]
    s.stream([long, short], max_new_tokens=[2, 12]).run()  # 15 and 13 positions: both fit
    with pytest.raises(RequestError, match="prompt 0"):
        s.stream([long, short], max_new_tokens=[4, 2])


def test_core_run_sizes_the_cache_for_each_rows_own_limit(model_dir, runner):
    """A long prompt with few new tokens beside a short one with many: each row fits the
    128-position context alone, though the longest prompt + the most new tokens would not."""
    rows, new = [list(range(1, 121)), [5, 6]], [2, 20]
    got = core.run(runner, input_ids=rows, max_new_tokens=new).rows
    assert [r.output_ids for r in got] == fresh(model_dir, rows, new)


@pytest.mark.parametrize("request_kwargs", [
    dict(input_ids=[[1, 2**63]]),
    dict(input_ids=[[1, -(2**64)]]),
    dict(input_ids=[np.array(5)]),
    dict(input_ids=[np.array([[1, 2]])]),
    dict(input_ids=[np.array([2**63], np.uint64)]),
    dict(input_ids=[[1, 2]], stop_token_ids=1.5),
    dict(input_ids=[[1, 2]], stop_token_ids="ab"),
    dict(input_ids=[[1, 2]], stop_token_ids=[True]),
    dict(input_ids=[[1, 2]], progress="yes"),
    dict(input_ids=[[1, 2]], capture="yes"),
    dict(input_ids=[[1, 2]], top_p=1e-300, do_sample=True),
    dict(input_ids=[[1, 2]], temperature=1e-40, do_sample=True),
    dict(input_ids=[[1, 2]], repetition_penalty=1e-300),
    dict(prompts=["hi"], chat="no"),
])
def test_bad_requests_are_named_errors_and_the_next_request_is_right(model_dir, runner, request_kwargs):
    with pytest.raises(RequestError):
        core.run(runner, max_new_tokens=4, **request_kwargs)
    assert core.run(runner, input_ids=A, max_new_tokens=6).rows[1].output_ids == fresh(model_dir, A, 6)[1]


def test_a_top_k_beyond_int32_keeps_every_token(runner):
    """top_k >= the vocabulary filters nothing, as top_k=0 (the device form holds it as the
    largest int32)."""
    def sampled(k):
        return core.run(runner, input_ids=A, max_new_tokens=8, do_sample=True, top_k=k, seed=3).rows

    assert [r.output_ids for r in sampled(2**32)] == [r.output_ids for r in sampled(0)]


@pytest.mark.parametrize("bad", [None, 5, "text", np.array(3)])
def test_session_stream_refuses_what_is_not_a_list_of_rows(runner, bad):
    s = Session(runner, batch=1, capacity=16)
    with pytest.raises(RequestError, match="input_ids"):
        s.stream(bad)


SCRIPT = """
import core
r = core.run({folder!r}, input_ids=[[1, 2, 3], [9, 8]], max_new_tokens=4, tensor_parallel=2)
print("TOKENS", [row.output_ids for row in r.rows])
"""


@pytest.mark.parametrize("how", ["stdin", "-c"])
def test_tensor_parallel_starts_from_a_script_on_stdin_or_dash_c(model_dir, how):
    """The ranks do not re-run the caller's main module (which "spawn" cannot find for <stdin>)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = SCRIPT.format(folder=str(model_dir))
    args = [sys.executable, "-"] if how == "stdin" else [sys.executable, "-c", code]
    root = str(Path(core.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(args, input=code if how == "stdin" else None, capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("TOKENS")][0]
    assert line == f"TOKENS {fresh(model_dir, [[1, 2, 3], [9, 8]], 4)}"


def test_a_rank_that_fails_at_start_reports_its_own_error(model_dir):
    from core.plugins import ProviderError

    with pytest.raises(ProviderError, match="no_such_provider"):
        Session(model_dir, provider="no_such_provider", tensor_parallel=2)

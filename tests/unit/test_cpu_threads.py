"""BLAS threads are chosen per provider and workload, set with --threads or LOCKSTEP_CPU_THREADS,
and in force while the command runs (core/threads.py)."""

import json

import pytest
from threadpoolctl import threadpool_info

from core.cli import main
from core.testing.tiny_model import make_tiny_model, write_byte_tokenizer
from core.threads import ENV, ThreadsError, blas_threads, choose, requested


@pytest.mark.parametrize("provider, workload, cores, busy, threads", [
    ("cpu_reference", "run", 2, 0.1, 2),    # a quiet 2-core machine: both cores
    ("cpu_reference", "run", 2, 1.0, 1),    # one busy loop elsewhere: the idle core
    ("cpu_reference", "chat", 2, 2.0, 1),   # two busy loops: never below 1
    ("cpu_reference", "profile", 8, 3.2, 5),
    ("cpu_reference", "run", 4, 0.0, 4),
    ("cpu_reference", "parity", 8, 0.0, 1),  # many tiny ops: one thread
    ("cuda", "run", 8, 0.0, 1),              # the math is on the GPU: one host thread
    ("cuda", "profile", 8, 0.0, 1),
])
def test_the_choice_per_provider_workload_and_load(provider, workload, cores, busy, threads):
    assert choose(provider, workload, None, cores, busy) == threads


def test_an_explicit_count_wins_over_every_rule():
    assert choose("cuda", "parity", 3, 2, 5.0) == 3
    assert choose("cpu_reference", "run", 1, 16, 0.0) == 1


def test_the_flag_wins_over_the_environment_and_bad_values_are_named():
    assert requested(4, {ENV: "2"}) == 4
    assert requested(None, {ENV: " 2 "}) == 2
    assert requested(None, {}) is None and requested(None, {ENV: ""}) is None
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ThreadsError, match=ENV):
            requested(None, {ENV: bad})
    with pytest.raises(ValueError, match="workload"):
        choose("cpu_reference", "serve-everything")


def test_the_limit_holds_inside_the_block_and_is_lifted_after():
    before = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    assert before, "numpy's BLAS is not visible to threadpoolctl"
    for n in (2, 1):  # both differ from the default of some run (OPENBLAS_NUM_THREADS=1 or 2 cores)
        with blas_threads(n):
            assert {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"} == {n}
    assert [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"] == before


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    return write_byte_tokenizer(make_tiny_model(tmp_path_factory.mktemp("threads") / "m"))


def _run_seeing_threads(monkeypatch, capsys, model, *argv):
    """`lockstep run --json` on the tiny model; returns (exit code, JSON, BLAS threads seen by start())."""
    import core.generation.generate as gen

    seen = []
    real = gen.start

    def spy(*args, **kwargs):
        seen.append({p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"})
        return real(*args, **kwargs)

    monkeypatch.setattr(gen, "start", spy)
    code = main(["run", "--model", str(model), "--raw", "--json", "--max-new-tokens", "2", "--prompt", "hi", *argv])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else out.err), seen


def test_run_uses_the_threads_asked_for_and_reports_them(monkeypatch, capsys, byte_model):
    monkeypatch.delenv(ENV, raising=False)
    code, result, seen = _run_seeing_threads(monkeypatch, capsys, byte_model, "--threads", "2")
    assert code == 0 and result["cpu_threads"] == 2 and seen == [{2}]
    monkeypatch.setenv(ENV, "3")
    code, result, seen = _run_seeing_threads(monkeypatch, capsys, byte_model)
    assert code == 0 and result["cpu_threads"] == 3 and seen == [{3}]


def test_run_by_default_takes_the_idle_cores(monkeypatch, capsys, byte_model):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr("core.threads.usable_cores", lambda: 2)
    monkeypatch.setattr("core.threads.load", lambda: 1.0)  # one core busy elsewhere
    code, result, seen = _run_seeing_threads(monkeypatch, capsys, byte_model)
    assert code == 0 and result["cpu_threads"] == 1 and seen == [{1}]


def test_a_bad_environment_value_is_a_one_line_error_before_any_work(monkeypatch, capsys, byte_model):
    monkeypatch.setenv(ENV, "lots")
    code, err, seen = _run_seeing_threads(monkeypatch, capsys, byte_model)
    assert code == 2 and ENV in err and err.count("\n") == 1 and seen == []


def test_the_load_is_the_busy_share_of_the_cpus_over_a_short_sample(monkeypatch):
    import os

    import core.threads as threads

    samples = iter([(100, 1000), (150, 1100)])  # (busy, total) jiffies: half busy meanwhile
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(threads, "SAMPLE_S", 0.0)
    assert threads.load() == 0.5 * os.cpu_count()
    monkeypatch.setattr(threads, "_cpu_times", lambda: None)  # no /proc/stat: the load average
    monkeypatch.setattr(os, "getloadavg", lambda: (1.25, 0.0, 0.0))
    assert threads.load() == 1.25

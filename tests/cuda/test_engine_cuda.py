"""The continuous-batching engine on the cuda provider (GPU only): random arrivals, each request
equal to its solo run (a batch-1 Session), with every decode bucket captured and replayed."""

from _gpu import require_gpu

require_gpu()

from core.runtime.runner import Runner  # noqa: E402
from core.testing.arrivals import fuzz_arrivals  # noqa: E402


def test_arrivals_equal_solo_runs_with_captured_buckets(model_dir):
    report = fuzz_arrivals(Runner(model_dir, "cuda"), seed=40, requests=200, max_batch=16, capacity=64)
    assert report.mismatches == []
    # seed 40's occupancy passes through buckets 1, 4, 8 and 16 (the same on cpu_reference)
    assert {4, 8, 16} <= report.buckets
    assert report.captures >= 4 and report.replays > 100  # the captured path ran


def test_warm_up_captures_every_bucket(model_dir):
    from core.engine import Engine

    engine = Engine(Runner(model_dir, "cuda"), max_batch=8, capacity=64)
    engine.warm_up()
    assert engine.counters.captures == 4  # buckets 1, 2, 4, 8
    handle = engine.submit([5, 6, 7], max_tokens=8)
    engine.run_until_idle()
    assert list(handle)[-1].usage.completion_tokens == 8
    engine.shutdown()

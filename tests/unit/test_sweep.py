"""`lockstep profile` sweeps per provider by default (small on cpu_reference) and says how long
the sweep will take before it starts (core/sweep.py)."""

import json
from types import SimpleNamespace

import pytest

from core.cli import main
from core.sweep import apply_defaults, duration, estimate_s, planned_steps
from core.testing.tiny_model import make_tiny_model


@pytest.mark.parametrize("provider, batches, tokens", [
    ("cpu_reference", [1, 2, 4, 8], 16),
    ("cuda", [1, 2, 4, 8, 16, 32, 64, 128, 256], 64),
    ("someone_elses_gpu", [1, 2, 4, 8, 16, 32, 64, 128, 256], 64),
])
def test_default_sweep_per_provider(provider, batches, tokens):
    args = SimpleNamespace(provider=provider, batch_sweep=None, tokens=None)
    apply_defaults(args)
    assert (args.batch_sweep, args.tokens) == (batches, tokens)


def test_given_values_are_kept():
    args = SimpleNamespace(provider="cpu_reference", batch_sweep=[3], tokens=5)
    apply_defaults(args)
    assert (args.batch_sweep, args.tokens) == ([3], 5)


def test_the_estimate_counts_every_step_and_prefill():
    # batch 1: 2 steps x 0.1 s + two prefills (warm-up, timed) of 0.2 s; batch 2: 2 x 0.1 x (1 + 0.6)
    # + two prefills of 0.2 x 2 rows
    assert estimate_s("cpu_reference", [1, 2], [16], 1, 1, 0.1, 0.2) == pytest.approx(0.6 + 1.12)
    # without batch 1 in the sweep, the batch-1 reference run is counted too (one prefill: no warm-up)
    assert estimate_s("cpu_reference", [2], [16], 1, 1, 0.1, 0.2) == pytest.approx(1.12 + 0.4)
    # a prompt twice as long: its prefills take twice as long
    assert estimate_s("cuda", [1], [16, 32], 0, 1, 0.0, 1.0) == pytest.approx(6.0)
    assert planned_steps([1, 2, 4], [16, 32], 8, 16) == 3 * 2 * 24 and planned_steps([2], [16], 1, 1) == 4


def test_duration_reads_for_a_person():
    assert (duration(40), duration(720), duration(4 * 3600)) == ("40 s", "12 min", "4.0 h")


def test_profile_on_cpu_reference_sweeps_small_and_announces_first(tmp_path, capsys):
    folder = make_tiny_model(tmp_path / "m")
    out = tmp_path / "rows.json"
    code = main(["profile", str(folder), "--warmup", "1", "--json", str(out)])
    err = capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert code == 0 and [r["batch"] for r in rows] == [1, 2, 4, 8]
    lines = err.splitlines()
    assert lines[0].startswith("profile: batches 1,2,4,8 x prompt length 16: 68 decode steps (1 warm-up + 16 "
                               "measured a point); about ")
    assert "batch 1 x 16 prompt tokens done" in lines[1]  # the estimate came before the first point

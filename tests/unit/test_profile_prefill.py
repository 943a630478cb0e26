"""``lockstep profile`` times the prefill in steady state: an untimed prefill of the same shape
first, then the timed one, reported as prefill tokens/s beside decode tokens/s (cpu_reference)."""

import argparse
import json
import time
import weakref

import pytest

from core.cli import main
from core.profile import profile
from core.runtime import step as steps
from core.testing.tiny_model import make_tiny_model

#: What the first prefill of a decode state sleeps in :func:`slow_first_prefill`: far longer than a
#: tiny-model prefill on cpu_reference (a few ms).
FIRST_S = 0.25


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _args(**kw):
    base = dict(prompt_len=[6], context=32, warmup=1, tokens=2, layout="head_major", no_capture=False,
                no_run_ahead=False)
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture
def slow_first_prefill(monkeypatch):
    """The first prefill of each decode state takes :data:`FIRST_S` longer (what a new shape's
    allocations and compiles cost on a GPU); returns the batch of every prefill run, in order."""
    real, seen, batches = steps.prefill, weakref.WeakSet(), []  # not ids: a freed state's id comes back

    def prefill(state, input_ids, *a, **kw):
        batches.append(len(input_ids))
        if state not in seen:
            seen.add(state)
            time.sleep(FIRST_S)
        return real(state, input_ids, *a, **kw)

    monkeypatch.setattr(steps, "prefill", prefill)
    return batches


def test_the_timed_prefill_is_the_second_of_its_shape(model_dir, slow_first_prefill):
    rows = profile(model_dir, "cpu_reference", [1, 3], _args())
    assert [r.batch for r in rows] == [1, 3]
    assert slow_first_prefill == [1, 1, 3, 3]  # each point: the warm-up prefill, then the timed one
    for r in rows:
        assert r.first_prefill_ms >= FIRST_S * 1e3 > r.prefill_ms > 0
        assert r.row0_matches_batch1


def test_the_batch1_reference_run_has_no_warm_up_prefill(model_dir, slow_first_prefill):
    rows = profile(model_dir, "cpu_reference", [2], _args())
    assert slow_first_prefill == [2, 2, 1] and rows[0].row0_matches_batch1


def test_prefill_tokens_per_s_is_in_the_json_and_the_table(model_dir, tmp_path, capsys):
    out = tmp_path / "p.json"
    code = main(["profile", str(model_dir), "--batch-sweep", "1,2", "--tokens", "2", "--warmup", "1",
                 "--context", "32", "--prompt-len", "5,9", "--json", str(out)])
    speed = capsys.readouterr().out.split("capture and device memory")[0]
    assert code == 0 and "prefill tok/s" in speed and "decode tok/s" in speed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prompt_len"], r["batch"]) for r in rows] == [(5, 1), (5, 2), (9, 1), (9, 2)]
    for r in rows:
        assert r["prefill_tokens_per_s"] > 0 and r["first_prefill_ms"] > 0
        assert r["prefill_tokens_per_s"] == pytest.approx(r["batch"] * r["prompt_len"] / (r["prefill_ms"] / 1e3))

"""Weight streaming on the GPU (docs/cases.md 16-19): streamed runs bitwise equal to the resident
run, eager and captured, with the smallest ring; htod bytes per token ~ 1/N with one capture.

Every equality test also asserts that streaming happened: bytes copied > 0, pages copied > 0,
the resident weights plus the staging ring within the budget (docs/cases.md 17).
"""

import numpy as np
import pytest
from _gpu import require_gpu

require_gpu()

from core.generation.loop import decode  # noqa: E402
from core.runtime import residency  # noqa: E402
from core.runtime.runner import Runner  # noqa: E402
from core.session import Session  # noqa: E402


@pytest.fixture(autouse=True)
def tiny_tensors_stream(monkeypatch, model_dir):
    if "tiny" in str(model_dir) or "/tmp/pytest" in str(model_dir):
        monkeypatch.setattr(residency, "SMALL_BYTES", 512)


def _rows(batch, vocab):
    rng = np.random.default_rng(11)
    return [list(rng.integers(3, vocab, 3 + (5 * b) % 11)) for b in range(batch)]


def _trace(runner, rows, steps, capture):
    s = Session(runner, batch=len(rows), capacity=256, capture=capture)
    logits = []
    t = decode(s, rows, steps, observer=lambda *_: logits.append(s.last_logits()))
    counters = s.counters
    s.close()
    return t.tokens, np.stack(logits), counters


def _budget(runner, fraction):
    """A budget streaming about ``fraction`` of the weight bytes."""
    total = sum(w.nbytes for w in residency.weights_of(runner.plan))
    return int(total * (1 - fraction))


@pytest.fixture(scope="module")
def resident(model_dir, gpu):
    return Runner(model_dir, gpu)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.9])
def test_streamed_steps_are_bitwise_the_resident_steps(model_dir, gpu, resident, fraction):
    vocab = resident.model.config.vocab_size
    try:
        runner = Runner(model_dir, gpu, weight_budget=_budget(resident, fraction))
    except residency.BudgetError as exc:
        pytest.skip(f"this model cannot stream {fraction:.0%}: {exc}")
    r = runner.residency
    assert r.streams and runner.weight_bytes + r.staging_bytes <= r.budget
    for batch in (1, 8):
        rows = _rows(batch, vocab)
        want = _trace(resident, rows, 24, capture=False)
        for capture in (False, True):
            got = _trace(runner, rows, 24, capture=capture)
            assert np.array_equal(want[0], got[0]), f"tokens differ (batch {batch}, capture {capture})"
            assert np.array_equal(want[1], got[1]), f"logits differ (batch {batch}, capture {capture})"
            c = got[2]
            assert c.htod_bytes == (c.decode_steps + 1) * r.weight_bytes_streamed_per_step > 0
            assert c.page_ins > 0 and c.fallbacks == []
            if capture:
                assert c.captures == 1 and c.replays == c.decode_steps - 1


def test_the_smallest_ring_over_200_steps_equals_the_resident_run(model_dir, gpu, resident):
    try:
        runner = Runner(model_dir, gpu, weight_budget=_budget(resident, 0.5), staging_slots=2)
    except residency.BudgetError as exc:
        pytest.skip(str(exc))
    assert runner.residency.slots == 2 and runner.residency.page_ins_per_step > 2
    rows = _rows(4, resident.model.config.vocab_size)
    want = _trace(resident, rows, 200, capture=False)
    got = _trace(runner, rows, 200, capture=True)
    assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])
    assert got[2].replays == 199 and got[2].htod_bytes > 0


def test_htod_bytes_per_token_fall_as_one_over_n_with_one_capture(model_dir, gpu, resident):
    try:
        runner = Runner(model_dir, gpu, weight_budget=_budget(resident, 0.5))
    except residency.BudgetError as exc:
        pytest.skip(str(exc))
    per_step = runner.residency.weight_bytes_streamed_per_step
    for n in (1, 2, 4, 8, 16, 32):
        _, _, c = _trace(runner, _rows(n, resident.model.config.vocab_size), 16, capture=True)
        assert c.htod_bytes_per_token == pytest.approx(per_step / n, rel=0.05)
        assert (c.captures, c.invalidations, c.fallbacks) == (1, 0, [])
        assert runner.stream.bytes_copied > 0

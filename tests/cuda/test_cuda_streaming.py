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


@pytest.fixture(scope="module")
def model_dir(model_dir, tmp_path_factory):
    """The SmolLM2-shaped models as they are; the tiny ones rebuilt with more layers, a longer
    context and a small vocabulary, so that no single page dominates the weights."""
    import os

    from core.testing.tiny_model import TinyConfig, make_tiny_model

    root = os.environ.get("LOCKSTEP_CUDA_MODELS")
    if root and str(model_dir).startswith(root):
        return model_dir
    from core.models.model import load_model

    m = load_model(model_dir)
    quant = "int4" if any(n.endswith("_Q4") for n in m.initializers) else None
    config = TinyConfig(layers=8, vocab=128, context=512, intermediate=64)
    return make_tiny_model(tmp_path_factory.mktemp("stream"), dtype=m.io_dtype.name, quant=quant, config=config)


@pytest.fixture(autouse=True)
def tiny_tensors_stream(monkeypatch, model_dir):
    import os

    if not str(model_dir).startswith(os.environ.get("LOCKSTEP_CUDA_MODELS") or "//"):
        monkeypatch.setattr(residency, "SMALL_BYTES", 512)


def _rows(batch, vocab):
    rng = np.random.default_rng(11)
    return [list(rng.integers(3, vocab, 3 + (5 * b) % 11)) for b in range(batch)]


def _trace(runner, rows, steps, capture):
    s = Session(runner, batch=len(rows), capacity=min(256, runner.model.config.context_length), capture=capture)
    logits = []
    t = decode(s, rows, steps, observer=lambda *_: logits.append(s.last_logits()))
    counters = s.counters
    s.close()
    return t.tokens, np.stack(logits), counters


def _budget(runner, fraction):
    """The largest budget streaming at least ``fraction`` of the streamable weight bytes (those
    the admission policy does not pin) through a 2-slot ring."""
    return residency.budget_for(residency.weights_of(runner.plan), fraction, slots=2, mappable=True)


@pytest.fixture(scope="module")
def resident(model_dir, gpu):
    return Runner(model_dir, gpu)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.9])
def test_streamed_steps_are_bitwise_the_resident_steps(model_dir, gpu, resident, fraction):
    vocab = resident.model.config.vocab_size
    try:
        runner = Runner(model_dir, gpu, weight_budget=_budget(resident, fraction), staging_slots=2)
    except residency.BudgetError as exc:
        pytest.skip(f"this model cannot stream {fraction:.0%}: {exc}")
    r = runner.residency
    assert r.streams and runner.weight_bytes + r.staging_bytes <= r.budget
    print(f"{model_dir}: {fraction:.0%} of the streamable bytes: {r.weight_bytes_streamed_per_step:,} bytes "
          f"streamed per step in {r.page_ins_per_step} pages, byte hit rate {r.byte_hit_rate:.2f}")
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

"""Eager launch replay (providers/cuda/replay.py) on the GPU: bitwise the launchers' run, and
actually used on decode steps."""

import numpy as np
import pytest
from _gpu import require_gpu

require_gpu()

from core.session import Session  # noqa: E402
from providers.cuda import replay  # noqa: E402
from providers.cuda.provider import CudaProvider  # noqa: E402
from providers.cuda.tuning import Tuning  # noqa: E402


def _decode(model_dir, provider, steps=40, **kw):
    rng = np.random.default_rng(3)
    rows = [list(rng.integers(3, 200, n)) for n in (9, 1, 4)]
    kw.setdefault("capacity", 64)
    s = Session(model_dir, provider, batch=3, capture=False, **kw)
    tokens, logits = [s.prefill(rows).tokens], [s.last_logits()]
    for _ in range(steps):
        tokens.append(s.step().tokens)
        logits.append(s.last_logits())
    # a second request with other prompt lengths on the same session (prefill shapes change)
    s.prefill([r[:2] for r in rows])
    for _ in range(8):
        tokens.append(s.step().tokens)
        logits.append(s.last_logits())
    return np.stack(tokens), np.stack(logits)


@pytest.mark.parametrize("kv_policy", ["fixed", "growing"])
def test_replay_is_bitwise_the_launchers(model_dir, kv_policy):
    """Tokens and fp32 logits with replay on equal replay off bitwise, across two requests
    (and growth events with kv_policy="growing"); most decode-step nodes were replayed."""
    off = CudaProvider()
    off.eager_replay = False
    on = CudaProvider()
    on.eager_replay = True
    kw = {"kv_policy": kv_policy, "max_capacity": 64} if kv_policy == "growing" else {}
    if kv_policy == "growing":
        kw["capacity"] = 16
    before = replay.stats()
    with_replay = _decode(model_dir, on, **kw)
    after = replay.stats()
    without = _decode(model_dir, off, **kw)
    assert np.array_equal(with_replay[0], without[0])
    assert np.array_equal(with_replay[1], without[1])
    replayed = after["replayed"] - before["replayed"]
    launched = after["launched"] - before["launched"]
    assert replayed > 3 * launched, (replayed, launched)


def test_every_provider_uses_one_stream():
    """Launches go to CuPy's current stream: two providers with streams of their own raced
    (capture, replay and downloads used the first one's while the second one's was current)."""
    import cupy

    a, b = CudaProvider(), CudaProvider()
    assert a.stream is b.stream and cupy.cuda.get_current_stream().ptr == a.stream.ptr


def test_programmatic_dependent_launch_is_bitwise_the_plain_launch(model_dir):
    """Two providers in one process, made with Tuning(pdl=True) and Tuning(pdl=False): the
    first one's decode steps go out through cuLaunchKernelEx with the programmatic attribute
    (counted), the second one's never, also after the first one ran, and tokens and logits are
    bitwise the same."""
    on, off = CudaProvider(tuning=Tuning(pdl=True)), CudaProvider(tuning=Tuning(pdl=False))
    if on.pdl_rows is None:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 and cuda-bindings")
    assert on.settings()["pdl"] == "on" and off.settings()["pdl"] == "off"  # what lockstep profile reports
    runs = {}
    for name, provider in (("on", on), ("off", off), ("on again", on), ("off again", off)):
        session = Session(model_dir, provider, batch=3, capacity=64, capture=False)
        session.prefill([[5, 6, 7], [8], [9, 10]])
        start = replay.stats()["pdl_launches"]
        tokens, logits = [], []
        for _ in range(8):
            tokens.append(session.step().tokens)
            logits.append(session.last_logits())
        runs[name] = (np.stack(tokens), np.stack(logits), replay.stats()["pdl_launches"] - start)
    assert runs["on"][2] > 0 and runs["on again"][2] > 0
    assert runs["off"][2] == 0 and runs["off again"][2] == 0
    for name in ("off", "on again", "off again"):
        assert np.array_equal(runs["on"][0], runs[name][0]) and np.array_equal(runs["on"][1], runs[name][1]), name

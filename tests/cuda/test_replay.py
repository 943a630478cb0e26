"""Eager launch replay (providers/cuda/replay.py) on the GPU: bitwise the launchers' run, and
actually used on decode steps."""

import numpy as np
import pytest
from _gpu import require_gpu

require_gpu()

from core.session import Session  # noqa: E402
from providers.cuda import replay  # noqa: E402
from providers.cuda.provider import CudaProvider  # noqa: E402


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
    """With LOCKSTEP_CUDA_PDL's path on (replay.set_pdl(True)), every kernel goes out through
    cuLaunchKernelEx with the programmatic attribute (counted), and tokens and logits are
    bitwise the plain launches'."""
    before = replay.set_pdl(True)
    try:
        if not replay.pdl_enabled():
            pytest.skip("programmatic dependent launch needs compute capability 9.0 and cuda-bindings")
        start = replay.stats()["pdl_launches"]
        provider = CudaProvider()
        assert provider.settings()["pdl"] == "on"  # what lockstep profile reports
        with_pdl = _decode(model_dir, provider, steps=12)
        assert replay.stats()["pdl_launches"] > start
    finally:
        replay.set_pdl(before)
    replay.set_pdl(False)
    try:
        provider = CudaProvider()
        assert provider.settings()["pdl"] == "off"
        plain = _decode(model_dir, provider, steps=12)
    finally:
        replay.set_pdl(before)
    assert np.array_equal(with_pdl[0], plain[0]) and np.array_equal(with_pdl[1], plain[1])

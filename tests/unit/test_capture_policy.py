"""The capture state machine (core.runtime.capture) on a provider that records capture calls.

The fake provider runs kernels eagerly (NumPy) and records which decode steps happened while
a capture was open; "replay" re-runs the recorded step function, which is what a CUDA graph
does with the recorded kernels. This checks the policy, not a device: warm-up before capture,
capture does not advance state, one capture then replays, invalidation on pointer change,
fallback with a reason when capture fails, contexts frozen only while capturing.
"""

import numpy as np
import pytest

from core.generation.loop import decode
from core.protocol import Capabilities
from core.runtime.step import decode_step
from core.session import Session
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider


class RecordingCapture(CpuReferenceProvider):
    """cpu_reference plus a capture that records the step instead of running it."""

    name = "recording"

    def __init__(self, fail: bool = False):
        super().__init__()
        self.fail = fail
        self.capturing = False
        self.frozen_seen = []
        self.session = None

    def capabilities(self):
        return Capabilities(dtypes=("float32",), graph_capture=True)

    def begin_capture(self):
        self.capturing = True
        self.snapshot = [np.array(t, copy=True) for t in self._state()]

    def end_capture(self):
        self.capturing = False
        # capture must not advance decode state: restore what the recorded step changed
        for t, saved in zip(self._state(), self.snapshot):
            t[...] = saved
        if self.fail:
            raise RuntimeError("simulated capture failure")
        return "graph"

    def replay(self, graph):
        assert graph == "graph"
        decode_step(self.session.state)

    def _state(self):
        s = self.session.state
        return [s.input_ids, s.attention_mask, s.result, s.lengths_dev] + s.kv.buffers()

    def device_argmax(self, logits, positions, result):
        if self.capturing:
            self.frozen_seen.append(all(ctx.frozen for ctx in self.session.plan.contexts))
        super().device_argmax(logits, positions, result)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def stream(model_dir, provider, steps=8, **kw):
    s = Session(model_dir, provider, batch=3, capacity=64, **kw)
    if isinstance(provider, RecordingCapture):
        provider.session = s
    rows = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    t = decode(s, rows, steps, keep_logits=True)
    return t.tokens.T, t.logits.transpose(1, 0, 2), s


def test_warm_up_then_one_capture_then_replays_equal_eager(model_dir):
    eager = stream(model_dir, CpuReferenceProvider())
    prov = RecordingCapture()
    graph = stream(model_dir, prov, capture=True)
    c = graph[2].counters
    assert (c.captures, c.replays, c.fallbacks, c.invalidations) == (1, 7, [], 0)
    assert np.array_equal(eager[0], graph[0]) and np.array_equal(eager[1], graph[1])
    assert prov.frozen_seen == [True]
    assert not any(ctx.frozen for ctx in graph[2].plan.contexts)


def test_a_second_request_reuses_the_graph(model_dir):
    prov = RecordingCapture()
    _, _, s = stream(model_dir, prov, capture=True)
    s.prefill([[1, 2], [3], [4, 5, 6]])
    s.step()
    assert s.counters.captures == 1 and s.counters.invalidations == 0


def test_pointer_change_invalidates_and_recaptures(model_dir):
    prov = RecordingCapture()
    _, _, s = stream(model_dir, prov, steps=3, capture=True)
    st = s.state
    st.input_ids = prov.allocate(st.input_ids.shape, st.input_ids.dtype, zero=True)  # a new buffer
    st.binding.bind_input("input_ids", st.input_ids)
    s.step()  # invalidated: this step is a fresh warm-up
    s.step()  # recapture + replay
    c = s.counters
    assert c.invalidations == 1 and c.captures == 2 and "pointer" in c.invalidation_reasons[0]


def test_capture_failure_falls_back_to_eager_with_a_reason(model_dir):
    eager = stream(model_dir, CpuReferenceProvider())
    failing = stream(model_dir, RecordingCapture(fail=True), capture=True)
    c = failing[2].counters
    assert c.captures == 0 and c.replays == 0
    assert len(c.fallbacks) == 1 and "simulated capture failure" in c.fallbacks[0]
    assert np.array_equal(eager[0], failing[0]) and np.array_equal(eager[1], failing[1])


def test_asking_for_capture_on_a_provider_without_it_is_a_recorded_fallback(model_dir):
    _, _, s = stream(model_dir, CpuReferenceProvider(), steps=2, capture=True)
    assert s.counters.captures == 0 and "no graph capture" in s.counters.fallbacks[0]


def test_a_kernel_that_allocates_inside_capture_is_refused(model_dir):
    """docs/cases.md 10: with every context frozen, a new buffer request raises."""
    s = Session(model_dir, CpuReferenceProvider(), batch=1, capacity=16)
    ctx = s.plan.contexts[0]
    ctx.output(0, (2, 2), np.float32)
    s.plan.set_frozen(True)
    assert ctx.output(0, (2, 2), np.float32) is ctx.output(0, (2, 2), np.float32)
    with pytest.raises(RuntimeError, match="inside a captured region"):
        ctx.output(0, (3, 2), np.float32)


def test_new_prompt_lengths_do_not_invalidate_the_graph(model_dir):
    """Prefill buffers of new shapes never displace the buffers a captured step uses."""
    prov = RecordingCapture()
    _, _, s = stream(model_dir, prov, steps=3, capture=True)
    for n in range(4, 12):
        s.prefill([[5] * n, [6] * (n + 1), [7] * (n + 2)])
        s.step()
    assert s.counters.captures == 1 and s.counters.invalidations == 0


def test_a_later_session_of_the_same_batch_reuses_the_graph_on_the_runner(model_dir):
    """One graph per batch on a Runner: a second session of batch 3 captures nothing and
    replays the first one's graph, bitwise the same tokens as a fresh eager run."""
    from core.runtime.runner import Runner

    prov = RecordingCapture()
    runner = Runner(model_dir, prov)
    first = stream(runner, prov, capture=True)
    graph = first[2].state.capture.graph
    first[2].close()
    second = stream(runner, prov, capture=True)
    c = second[2].counters
    assert second[2].state.capture.graph is graph
    assert (c.captures, c.replays, c.invalidations) == (0, 8, 0)
    eager = stream(model_dir, CpuReferenceProvider())
    assert np.array_equal(eager[0], second[0]) and np.array_equal(eager[1], second[1])

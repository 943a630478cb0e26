"""Cached pool blocks after a weight re-plan: a device pool (CuPy's MemoryPool on cuda) keeps the
blocks of freed arrays cached, held by the process, until ``free_all_blocks()``. The weights a
re-plan evicts are freed only once whatever held them lets go (a captured graph, dropped when
the re-plan invalidates it; the pooled states a sweep releases), so the blocks are given back
then (the provider's ``reset_peak()``), not left above the device budget. A stand-in pool on
cpu_reference counts the cached bytes; cuda's ``reset_peak`` empties CuPy's default pool, the
one its arrays come from."""

import types
import weakref

import numpy as np
import pytest
from test_capture_policy import RecordingCapture

from core.generation.loop import decode
from core.protocol import Capabilities
from core.runtime import residency
from core.runtime.runner import Runner
from core.runtime.step import decode_step
from core.session import Session
from core.testing.tiny_model import TinyConfig, make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider

ROWS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


class FakePool:
    """CuPy's ``MemoryPool`` as far as these tests need: a freed array's block stays cached
    until :meth:`free_all_blocks`; ``cached`` counts the weights' blocks among them."""

    def __init__(self):
        self.cached = self.released = self.calls = 0

    def free_all_blocks(self, stream=None):
        self.calls += 1
        self.released += self.cached
        self.cached = 0


class _Graph:
    """A captured step that keeps the weights it read alive (as a graph holding its arguments)."""

    def __init__(self, held):
        self.held = held


class PooledCapture(RecordingCapture):
    """cpu_reference with a capture whose graph holds the plan's constants, weight streaming, and
    the weights uploaded at load counted by a :class:`FakePool` once freed."""

    def __init__(self):
        super().__init__()
        self.pool, self.tagging, self.graphs = FakePool(), True, 0

    def capabilities(self):
        return Capabilities(dtypes=("float32",), graph_capture=True, weight_streaming=True)

    def _upload(self, array):
        out = np.array(array, copy=True)
        if self.tagging:
            weakref.finalize(out, self._freed, out.nbytes)
        return out

    def _freed(self, nbytes: int) -> None:
        self.pool.cached += nbytes

    def reset_peak(self):
        self.pool.free_all_blocks()

    def end_capture(self):
        super().end_capture()
        self.graphs += 1
        return _Graph(list(self.session.runner.plan.constants.values()))

    def replay(self, graph):
        assert isinstance(graph, _Graph)
        decode_step(self.session.state)


@pytest.fixture(autouse=True)
def small_tensors_stream(monkeypatch):
    monkeypatch.setattr(residency, "SMALL_BYTES", 512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pool"), config=TinyConfig(layers=6, vocab=128, context=256))


def test_the_blocks_of_the_weights_a_replan_evicts_are_released_once_the_graph_lets_go(model_dir):
    resident = Runner(model_dir, CpuReferenceProvider())
    want = decode(Session(resident, batch=3, capacity=200), ROWS, 120).tokens
    weights = sum(w.nbytes for w in residency.weights_of(resident.plan))
    kv_per_position = 2 * 6 * 3 * 2 * 16 * 4  # K and V, layers, rows, kv heads, head size, fp32
    work = resident.workspace_estimate(3, 200, (3, 16))
    # every weight fits beside a small cache, not beside the grown one: a growth re-plans
    provider = PooledCapture()
    runner = Runner(model_dir, provider, device_budget=int(0.6 * weights) + 128 * kv_per_position + work)
    provider.tagging = False  # the weights uploaded at load are the ones counted
    assert not runner.residency.streams
    s = Session(runner, batch=3, capacity=16, kv_policy="growing", max_capacity=200, capture=True)
    provider.session = s
    got = decode(s, ROWS, 120).tokens
    assert np.array_equal(got, want)
    assert s.counters.replans >= 1 and runner.residency.streams and provider.graphs >= 2  # captured, re-planned
    # the evicted weights were freed when the re-plan dropped the graph, and their blocks given back
    assert provider.pool.released > 0 and provider.pool.cached == 0, vars(provider.pool)


def test_releasing_pooled_states_gives_their_blocks_back(model_dir):
    provider = PooledCapture()
    runner = Runner(model_dir, provider)
    provider.tagging = True  # from here: the states' buffers (uploads) too
    s = Session(runner, batch=3, capacity=16, capture=True)
    provider.session = s
    decode(s, ROWS, 4)
    s.close()  # its state is pooled: its graph still holds the weights it read
    assert provider.graphs >= 1
    calls = provider.pool.calls
    runner.release_states()
    assert provider.pool.calls > calls and provider.pool.cached == 0


def test_cuda_releases_the_cached_blocks_of_the_pool_its_arrays_come_from():
    """No GPU needed: cuda's ``reset_peak`` on a stand-in CuPy whose arrays come from its
    default pool, as ``cupy.empty`` takes them."""
    from providers.cuda.provider import CudaProvider

    pool = FakePool()
    made = []
    cupy = types.SimpleNamespace(get_default_memory_pool=lambda: pool,
                                 empty=lambda shape, dtype: made.append(pool) or np.empty(shape, dtype),
                                 zeros=lambda shape, dtype: made.append(pool) or np.zeros(shape, dtype))
    provider = object.__new__(CudaProvider)
    provider.cupy = cupy
    provider._allocate((4,), np.float32, False)
    pool.cached = 1 << 20  # a freed block the pool keeps
    provider.reset_peak()
    assert made == [pool] and pool.calls == 1 and pool.released == 1 << 20 and pool.cached == 0

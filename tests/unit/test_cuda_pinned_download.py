"""The cuda provider's pinned staging slots (``download_async``), checked without a GPU.

Issue 39: a download handle dropped inside a reference cycle (a failed stream's traceback holds
the generator frame, its queued steps and their handles) is reclaimed by the cycle collector,
which finalises every object only that cycle reaches before it looks for resurrected ones. The
slot's ``cupy.cuda.Event`` is such an object: its ``__del__`` destroys the CUDA event and
leaves ``ptr`` set. A handle that gave its slot back from ``__del__`` resurrected the slot with
a destroyed event, and the next stream's ``cudaEventRecord`` on it failed (context destroyed,
invalid context) or crashed. A fake CuPy stands in for the device: its events record whether
they were destroyed.
"""

import gc

import numpy as np
import pytest

from core.runtime.runner import Runner
from core.session import Session
from core.testing.faults import FaultyProvider, InjectedFault
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider
from providers.cuda.provider import _PinnedDownload, _PinnedSlot


class FakeEvent:
    """cupy.cuda.Event's lifetime: ``__del__`` destroys the handle, ``ptr`` stays set."""

    def __init__(self, disable_timing=False):
        self.ptr, self.destroyed = 1, False

    def __del__(self):
        self.destroyed = True

    def synchronize(self):
        assert not self.destroyed, "synchronize on a destroyed event"


class FakeCuda:
    Event = FakeEvent

    @staticmethod
    def alloc_pinned_memory(nbytes):
        return bytearray(nbytes)


class FakeCupy:
    cuda = FakeCuda


def handle(free):
    return _PinnedDownload(free, _PinnedSlot(FakeCupy, 16), (2,), np.dtype(np.int32), 8)


def test_a_handle_reclaimed_with_a_reference_cycle_gives_its_slot_back_with_a_live_event():
    free: list = []
    cycle: list = [handle(free)]
    cycle.append(cycle)  # only the cycle holds the handle, as a dropped traceback's frame does
    del cycle
    gc.collect()
    assert len(free) == 1 and not free[0].event.destroyed


def test_a_dropped_handle_gives_its_slot_back_once():
    free: list = []
    h = handle(free)
    del h
    gc.collect()
    assert len(free) == 1 and not free[0].event.destroyed


def test_a_read_handle_gives_its_slot_back_once_and_keeps_its_result():
    free: list = []
    h = handle(free)
    h._slot.host[:8] = np.array([7, 9], np.int32).view(np.uint8)
    first = h.wait()
    assert first.tolist() == [7, 9] and len(free) == 1
    assert h.wait() is first and len(free) == 1
    del h
    gc.collect()
    assert len(free) == 1


class PinnedCpu(CpuReferenceProvider):
    """cpu_reference whose ``download_async`` stages through the cuda provider's pinned slots
    and handles (the fake CuPy's events refuse a record once destroyed, as the driver does)."""

    def __init__(self):
        super().__init__()
        self._pinned_free: list = []

    def download_async(self, tensor):
        host = np.ascontiguousarray(self.download(tensor))
        free = self._pinned_free
        slot = free.pop(0) if free else _PinnedSlot(FakeCupy, 4096)
        assert not slot.event.destroyed, "cudaEventRecord on a destroyed event (issue 39)"
        slot.host[:host.nbytes] = host.reshape(-1).view(np.uint8)
        return _PinnedDownload(free, slot, host.shape, host.dtype, host.nbytes)


def test_a_download_fault_while_streaming_leaves_every_pinned_slot_usable(tmp_path):
    model = make_tiny_model(tmp_path)
    prompts, new = [[5, 6, 7], [8, 9]], [20, 17]
    clean = Session(Runner(model, CpuReferenceProvider()), batch=2, capacity=48)
    want = clean.stream(prompts, max_new_tokens=new).run()
    prov = FaultyProvider(PinnedCpu())
    s = Session(Runner(model, prov), batch=2, capacity=48, capture=False)
    it = iter(s.stream(prompts, max_new_tokens=new))
    for _ in range(6):
        next(it)
    prov.arm("download")
    with pytest.raises(InjectedFault):
        list(it)
    gc.collect()  # the step queued ahead, dropped by the fault, lives only in the traceback's cycle
    assert all(not slot.event.destroyed for slot in prov.inner._pinned_free)
    got = s.stream(prompts, max_new_tokens=new).run()
    assert [r.output_ids for r in got] == [r.output_ids for r in want]

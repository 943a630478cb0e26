"""Weight streaming on the GPU: pinned host weights, a copy stream, one event pair per slot.

Copies run on a dedicated non-blocking copy stream, in execution order, into a ring of device
staging slots. Two events per slot keep it safe (docs/cases.md 18):

- ``copied[s]`` is recorded on the copy stream after the copy into slot s; the compute stream
  waits on it before the first kernel that reads the slot;
- ``released[s]`` is recorded on the compute stream after the last kernel that reads the
  slot's current weight; the next copy into slot s waits on it.

Each step starts by forking the copy stream from the compute stream (an event recorded on the
compute stream, waited on by the copy stream) and ends by joining it (the reverse), so a CUDA
graph capture of the step contains the copies, every forked stream is joined before the
capture ends, and no event recorded before the capture is waited on inside it (docs/cases.md
19). Host weights live in pinned memory (``cupy.cuda.alloc_pinned_memory``), so the copies are
asynchronous and capturable; no kernel reads host memory, and no managed memory is used.
"""

from __future__ import annotations

from core.provider import WeightStream


class CudaWeightStream(WeightStream):
    """The provider's staging ring with a copy stream and per-slot events."""

    def __init__(self, provider, slots: int, slot_bytes: int):
        super().__init__(provider, slots, slot_bytes)
        cp = provider.cupy
        self._cp = cp
        self.compute = provider.stream
        self.copy_stream = cp.cuda.Stream(non_blocking=True)
        self.copied = [cp.cuda.Event(disable_timing=True) for _ in self.slots]
        self.released = [cp.cuda.Event(disable_timing=True) for _ in self.slots]
        self._fork = cp.cuda.Event(disable_timing=True)
        self._join = cp.cuda.Event(disable_timing=True)
        self._released_this_step = [False] * len(self.slots)

    def begin(self) -> None:
        self._fork.record(self.compute)
        self.copy_stream.wait_event(self._fork)
        self._released_this_step = [False] * len(self.slots)

    def copy(self, slot: int, items) -> None:
        rt = self._cp.cuda.runtime
        if self._released_this_step[slot]:
            self.copy_stream.wait_event(self.released[slot])
        for host, view in items:
            rt.memcpyAsync(view.data.ptr, host.ctypes.data, host.nbytes, rt.memcpyHostToDevice,
                           self.copy_stream.ptr)
            self.bytes_copied += int(host.nbytes)
        self.copied[slot].record(self.copy_stream)
        self.copies += 1

    def ready(self, slot: int) -> None:
        self.compute.wait_event(self.copied[slot])

    def release(self, slot: int) -> None:
        self.released[slot].record(self.compute)
        self._released_this_step[slot] = True

    def end(self) -> None:
        self._join.record(self.copy_stream)
        self.compute.wait_event(self._join)

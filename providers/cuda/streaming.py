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
A row block of a ``[K, N]`` weight (:func:`row_blocks`) is K strided pieces of the pinned copy:
one ``cudaMemcpy2DAsync``.
"""

from __future__ import annotations

import numpy as np

from core.provider import WeightStream
from core.runtime import rowblocks


def row_blocks(node, shape_of) -> rowblocks.RowSplit | None:
    """Row blocks on cuda (:mod:`core.runtime.rowblocks`): an fp32 MatMul only. Its kernel
    (kernels/linear.cu ``dense``) fixes every output element's reduction by K and the chunk
    size alone, so a block of output rows gives the whole node's bits whatever N is. The fp16
    tensor-core GEMMs (a packed weight, a split-K and tile schedule chosen by N,
    ops/_mma_schedule.py) and the int4 ones do not declare row blocks: a page launch would need
    the whole node's schedule passed in, which they do not take yet, so those nodes stream
    whole."""
    if (node.domain, node.op_type) != ("", "MatMul"):
        return None
    dtypes = [d for d in node.input_dtypes[:2] if d is not None]
    if not dtypes or any(np.dtype(d) != np.float32 for d in dtypes):
        return None
    return rowblocks.onnx_rows(node, shape_of)


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
            if host.flags.c_contiguous:
                rt.memcpyAsync(view.data.ptr, host.ctypes.data, host.nbytes, rt.memcpyHostToDevice,
                               self.copy_stream.ptr)
            else:  # a row block of a [K, N] weight: K pinned rows of its columns, one 2-D copy
                width = host.shape[1] * host.itemsize
                rt.memcpy2DAsync(view.data.ptr, width, host.ctypes.data, host.strides[0], width, host.shape[0],
                                 rt.memcpyHostToDevice, self.copy_stream.ptr)
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

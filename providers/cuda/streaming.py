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
    """Row blocks on cuda (:mod:`core.runtime.rowblocks`): an fp32 MatMul, an fp16 MatMul or
    SiluGatedMatMul whose weight is packed for the tensor cores (:func:`dense_rows`), and a
    MatMulNBits or SiluGatedMatMulNBits whose int4 weights are (:func:`int4_rows`). The fp32
    kernel (kernels/linear.cu ``dense``) fixes every output element's reduction by K and the
    chunk size alone, so a block of output rows gives the whole node's bits whatever N is."""
    if (node.domain, node.op_type) in _INT4:
        return int4_rows(node, shape_of)
    if (node.domain, node.op_type) in _DENSE:
        packed = dense_rows(node, shape_of)
        if packed is not None or (node.domain, node.op_type) != ("", "MatMul"):
            return packed
    dtypes = [d for d in node.input_dtypes[:2] if d is not None]
    if not dtypes or any(np.dtype(d) != np.float32 for d in dtypes):
        return None
    return rowblocks.onnx_rows(node, shape_of)


_DENSE = {("", "MatMul"): 1, ("lockstep", "SiluGatedMatMul"): 2}


def dense_rows(node, shape_of) -> rowblocks.RowSplit | None:
    """The row split of a prepared fp16 tensor-core node (MatMul, or SiluGatedMatMul with its up
    input dropped), or None. ``ops/_mma_layout.prepare_dense`` packs the weight 3-D,
    ``[R, ceil(K / 64), 64]`` (``_mma_layout.packed_shape``), when N is a multiple of 16: R = N
    rows, or 2 N gate/up rows interleaved 8 features of each per 16-row tile. The packing is
    tile-major (a tile's 16 rows x ceil64(K) elements are contiguous, in fragment order), so
    rows ``a:b`` of N, multiples of 16 (:data:`core.runtime.rowblocks.ROW_ALIGN`), are rows
    ``a:b`` (GLU: ``2a:2b``) of the packed weight: the packing of the block's own weights.
    The kernels' arithmetic per output depends on K alone (kernels/linear_mma.cu: the kernel
    and grid never change a bit), and the launchers take N from the weight's leading axis, so
    a page launched on its rows gives the node's bits. A flat (1-D) packed weight or a raw
    ``[K, N]`` one (not prepared) declares nothing here."""
    per = _DENSE[(node.domain, node.op_type)]
    inputs = list(node.inputs) + [""] * 3
    if not inputs[1] or (per == 2 and inputs[2]):
        return None
    dtypes = [d for d in node.input_dtypes[:2] if d is not None]
    if any(np.dtype(d) != np.float16 for d in dtypes):
        return None
    shape = shape_of(inputs[1])
    if shape is None or len(shape) != 3 or shape[2] != 64 or shape[0] % (per * rowblocks.ROW_ALIGN):
        return None
    return rowblocks.RowSplit(int(shape[0]) // per, {1: 0})


_INT4 = {("com.microsoft", "MatMulNBits"): 1, ("lockstep", "SiluGatedMatMulNBits"): 2}


def int4_rows(node, shape_of) -> rowblocks.RowSplit | None:
    """The row split of a prepared int4 node (``ops/_mma_layout.pack_int4``'s codes, scales and
    zero points, ``[R, X]`` each, R = N rows, or 2 N interleaved gate/up rows for the GLU), or
    None. The packed arrays are tile-major (16 rows a tile), so rows ``a:b`` of N, a multiple of
    16 (:data:`core.runtime.rowblocks.ROW_ALIGN`), are rows ``a:b`` (GLU: ``2a:2b``) of each:
    the packed form of the block's own weights. The kernels' products per output depend on K
    alone (kernels/linear_mma.cu: the kernel and grid never change a bit), so a block computes
    the node's bits. Declared when N is a multiple of 16 (whole tiles) and inputs 1-3 have the
    packed shapes (raw weights are ``[N, n_blocks, blob]``; the GLU's up inputs are dropped);
    a MatMulNBits bias ``[N]`` is cut with them."""
    n, per = int(node.attrs.get("N", 0)), _INT4[(node.domain, node.op_type)]
    inputs = list(node.inputs) + [""] * 7
    absent = inputs[4:7] if per == 2 else inputs[4:5]  # the GLU's dropped up weights; no g_idx
    if n <= 0 or n % rowblocks.ROW_ALIGN or not inputs[1] or not inputs[2] or any(absent):
        return None
    axes = {}
    for i in (1, 2, 3):
        if inputs[i]:
            shape = shape_of(inputs[i])
            if shape is None or len(shape) != 2 or shape[0] != per * n:
                return None
            axes[i] = 0
    if per == 1 and inputs[5]:
        shape = shape_of(inputs[5])
        if shape is None or tuple(shape) != (n,):
            return None
        axes[5] = 0
    return rowblocks.RowSplit(n, axes)


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

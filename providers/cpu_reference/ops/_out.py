"""Output buffers of the cpu_reference kernels (no OP_TYPE: not an op).

Every kernel writes its results into its node's persistent buffers,
``ctx.output(slot, shape, dtype)`` (:class:`core.protocol.KernelContext`), and returns those
buffers: a step allocates nothing once the shapes are known, no output aliases an input, and
the parity kit's poison (buffers filled with NaN before a run) shows any element a kernel
forgets to write. The one output that is not such a buffer is the present KV of
GroupQueryAttention in share-buffer mode: the past buffer itself, written in place.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from providers.cpu_reference.ops._util import compute_dtype


def buffer(ctx, slot, shape, dtype) -> np.ndarray:
    """The host buffer of output ``slot``: ``ctx.output(slot, shape, dtype)``.

    The executor's host dispatch (a device provider's host nodes run on these kernels) gives
    the kernel a host context (core.executor.host.HostFallback): its buffers are numpy arrays too.
    A context whose buffers are not host arrays (a device provider's context, in a direct
    call) gets a new host array instead.
    """
    out = ctx.output(slot, shape, dtype)
    return out if isinstance(out, np.ndarray) else np.empty(shape, dtype)


def write(ctx, slot, value, dtype=None) -> np.ndarray:
    """``value`` converted to ``dtype`` (default: its own; numpy ``astype`` rounding) and
    copied into the buffer of output ``slot``; returns the buffer."""
    if not isinstance(value, np.ndarray):
        value = np.asarray(value)
    out = buffer(ctx, slot, value.shape, value.dtype if dtype is None else dtype)
    np.copyto(out, value, casting="unsafe")
    return out


def write_elementwise(ctx, fn: Callable[..., np.ndarray], *xs) -> np.ndarray:
    """``fn(*xs)`` computed in :func:`compute_dtype` of the first input and rounded into
    output buffer 0 in the first input's dtype (the rounding of ``_util.elementwise``). A
    numpy ufunc computes straight into the buffer (its loop in the compute dtype, the result
    cast on output: the same rounding, no temporary)."""
    arrays = [np.asarray(x) for x in xs]
    dtype = arrays[0].dtype
    work = compute_dtype(dtype)
    if isinstance(fn, np.ufunc):
        shape = arrays[0].shape if all(x.shape == arrays[0].shape for x in arrays) else np.broadcast(*arrays).shape
        return fn(*arrays, out=buffer(ctx, 0, shape, dtype), dtype=work, casting="unsafe")
    args = [x.astype(work, copy=False) if x.dtype.kind == "f" else x for x in arrays]
    return write(ctx, 0, fn(*args), dtype)

"""One module per ONNX op (the op-module convention of :mod:`core.ops`).

Each module defines OP_TYPE, DOMAIN ("" default), run(ctx, *inputs) -> tuple with one entry
per node output, optionally supports(node), and optionally prepare(ctx, *inputs), the
plan-time weight hook (:mod:`core.ops`): it turns constant weights into the kernel's form
once (the fp16 tensor-core packing of ``_mma_layout.pack``, the gate/up interleave of ``_mma.glu_*``)
and records the static facts the kernel needs in ``ctx.cache``; the kernel reads prepared
inputs when that entry is present and still runs on raw inputs (direct calls, fed weights).

Rules every launcher follows (docs/cuda.md "Stream capture"): outputs and scratch come from
``ctx.output``; no CuPy expression that allocates; no host sync; scalars passed as numpy
int32/int64/float32; launches on the current (provider) stream. Nodes whose inputs are all
host values (shape arithmetic on small integer constants) never reach these launchers: the
core runs them on the host (core.executor.host); a launcher may still receive host
values beside device ones (a host scalar operand, host axes). Host-only ops (Shape,
Constant) are declared here so that ``supports`` answers for them. No module imports
another provider: shared op rules are in :mod:`core.opdefs`.
Modules whose name starts with "_" are helpers, not ops.
"""

from __future__ import annotations

import numpy as np

from core.opdefs import is_host  # noqa: F401 - the launchers' host test

#: A NULL device pointer for optional kernel arguments.
NULL = np.uint64(0)


def array_module(x):
    """numpy for a host array (the prepare hooks run on numpy in the unit tests), else cupy."""
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


def device_array(ctx, x, key: str, dtype=None):
    """A device array for ``x``: itself when on the device; a host value is uploaded once and
    cached in ``ctx.cache`` by content (host values reaching here are small constants)."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return x if dtype is None or x.dtype == dtype else _converted(ctx, x, key, dtype)
    host = np.asarray(x, dtype=dtype)
    tag = (host.dtype.str, host.shape, host.tobytes())
    cached = ctx.cache.get(key)
    if cached is None or cached[0] != tag:
        cached = (tag, cupy.asarray(host))
        ctx.cache[key] = cached
    return cached[1]


def _converted(ctx, x, key, dtype):
    import cupy

    from providers.cuda import replay

    replay.not_replayable()  # a CuPy launch, not a recorded Kernel launch
    buf = ctx.output(key, x.shape, dtype)
    cupy.copyto(buf, x, casting="unsafe")
    return buf


#: The largest grid y and z (CUDA's limit on every current device); grid x allows 2^31 - 1.
MAX_GRID_Y = 65535


def row_slices(m: int, rows_per_block: int):
    """``(r0, r1)`` ranges of at most MAX_GRID_Y row blocks (multiples of 64 rows) covering m rows.

    The row-blocked GEMM launchers run one launch per range on row views of A and Y: rows are
    independent (each row's K order is fixed), so the bits do not depend on the split.
    """
    step = (MAX_GRID_Y // 64 * 64) * rows_per_block
    return [(r0, min(m, r0 + step)) for r0 in range(0, m, step)]


def rows_of(x, r0: int, r1: int, k: int):
    """Rows [r0, r1) of a C-contiguous ``x`` viewed as [m, k] (no copy; ``x`` itself when whole)."""
    if r0 == 0 and r1 * k == x.size:
        return x
    return x.reshape(-1, k)[r0:r1]


def grid_threads(n: int, threads: int = 256, cap: int = 65535) -> tuple[int]:
    return (max(1, min(cap, -(-n // threads))),)

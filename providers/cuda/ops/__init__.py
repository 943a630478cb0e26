"""One module per ONNX op (same convention as providers.cpu_reference.ops).

Each module defines OP_TYPE, DOMAIN ("" default), run(ctx, *inputs) -> tuple of outputs and
optionally supports(node). Rules every launcher follows (CUDA_NOTES "Stream capture"):
outputs and scratch come from ``ctx.output``; no CuPy expression that allocates; no host sync;
scalars passed as numpy int32/int64/float32; launches on the current (provider) stream.
Ops whose inputs are all host numpy arrays (shape arithmetic on small integer constants) run
on the host through the cpu_reference op of the same name (see :func:`host_or_none`).
Modules whose name starts with "_" are helpers, not ops.
"""

from __future__ import annotations

import importlib

import numpy as np

#: A NULL device pointer for optional kernel arguments.
NULL = np.uint64(0)


def is_host(x) -> bool:
    """True for host values (numpy arrays / scalars) and absent inputs."""
    return x is None or isinstance(x, (np.ndarray, np.generic, int, float))


def host_or_none(ctx, module_name: str, inputs):
    """The cpu_reference op's result when every input is on the host, else None."""
    if all(is_host(x) for x in inputs):
        ref = importlib.import_module(f"providers.cpu_reference.ops.{module_name}")
        return ref.run(ctx, *inputs)
    return None


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


def grid_threads(n: int, threads: int = 256, cap: int = 65535) -> tuple[int]:
    return (max(1, min(cap, -(-n // threads))),)

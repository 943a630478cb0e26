"""Load and cache the CUDA C sources of kernels/ as cupy.RawModule objects.

Each ``kernels/<name>.cu`` is compiled once per process with the complete tuple of template
instantiations its launchers use (``name_expressions``); CuPy adds ``-arch`` and the include
paths itself. Kernel files include no project headers, so CuPy's disk cache key (the source
text) covers everything. The first run on a machine compiles (seconds per file, about 20 s in
all); each compile is timed through :mod:`core.compiling`, so it shows as its own step and
stays out of the prefill and decode rates.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from core.compiling import compiling
from providers.cuda import replay

KERNELS = Path(__file__).parent / "kernels"


#: Kernel files compiled after another file of kernels/ whose device functions they call:
#: ``linear_gemv4.cu`` runs ``linear_mma.cu``'s int4 arithmetic, ``moe_paged.cu`` ``moe.cu``'s per-pair
#: products (their instantiations only are compiled).
AFTER = {"linear_gemv4": "linear_mma", "moe_paged": "moe"}

#: Headers of kernels/ prepended to one file (and so to the files compiled after it): moe.cu's
#: expert activations, shared with moe_paged.cu.
HEADERS = {"moe": ("moe_act.cuh",)}


def source(name: str) -> str:
    """The CUDA C source compiled for ``kernels/<name>.cu``: kernels/pdl.cuh (the PDL_ENTER macros
    every kernel uses), then the file named in :data:`AFTER` for it, if any, with its
    :data:`HEADERS`, then the file with its own. Prepended rather than included, so the source
    text CuPy keys its disk cache on covers it."""
    files = [*(f for f in (AFTER.get(name),) if f), name]
    before = [KERNELS / "pdl.cuh"]
    for f in files[:-1]:
        before += [*(KERNELS / h for h in HEADERS.get(f, ())), KERNELS / f"{f}.cu"]
    before += [KERNELS / h for h in HEADERS.get(name, ())]
    return "".join(p.read_text() for p in (*before, KERNELS / f"{name}.cu"))


def cache_dir() -> Path:
    """Where CuPy keeps compiled kernels between runs: $CUPY_CACHE_DIR, else ~/.cupy/kernel_cache
    (CuPy's default)."""
    return Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")


@functools.cache
def _module(name: str, expressions: tuple[str, ...]):
    """``kernels/<name>.cu`` compiled with ``expressions``, timed as a compile (core.compiling:
    seconds out of every rate, shown as their own step); a disk-cache hit takes milliseconds."""
    import cupy

    with compiling(f"{name}.cu", str(cache_dir())):
        module = cupy.RawModule(code=source(name), options=("--std=c++17",),
                                name_expressions=list(expressions))
        module.get_function(expressions[0])  # compile now, inside the timed block, not at first launch
    return module


class Kernel:
    """A compiled kernel. Calling it, ``kernel(grid, block, args, shared_mem=0)``, launches on
    the current stream (with programmatic dependent launch where the launching provider has it
    on, :data:`providers.cuda.replay._pdl_rows`, else through CuPy) and, while a node is being
    recorded, also keeps the launch for eager replay (:mod:`providers.cuda.replay`).

    Attributes:
        raw: the cupy.RawKernel; ptr: its CUfunction handle.
    """

    __slots__ = ("raw", "ptr")

    def __init__(self, raw):
        self.raw = raw
        self.ptr = raw.kernel.ptr

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        if replay._pdl_rows is not None:
            try:
                launch = replay.Launch(self.ptr, grid, block, args, shared_mem)
            except TypeError:  # an argument without a fixed C layout: CuPy launches it
                launch = None
            if launch is not None:
                import cupy

                launch.fire(cupy.cuda.get_current_stream().ptr)
                if replay._recording is not None:
                    replay._recording.append(launch)
                return
        self.raw(grid, block, args, shared_mem=shared_mem)
        if replay._recording is not None:
            replay.record(self.ptr, grid, block, args, shared_mem)

    def blocks_per_multiprocessor(self, threads: int) -> int:
        """How many blocks of ``threads`` threads fit one multiprocessor at once by this kernel's
        registers (its ``num_regs``, allocated per warp in units of 256) and the device's
        thread limit; shared memory is not counted. Cached per thread count."""
        cached = _RESIDENT.get((self.ptr, threads))
        if cached is None:
            import cupy

            attrs = cupy.cuda.Device().attributes
            warps = -(-threads // 32)
            per_warp = -(-self.raw.num_regs * 32 // 256) * 256
            cached = _RESIDENT[(self.ptr, threads)] = max(1, min(
                attrs["MaxRegistersPerMultiprocessor"] // (per_warp * warps),
                attrs["MaxThreadsPerMultiProcessor"] // (32 * warps)))
        return cached

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self.raw.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, nbytes: int) -> None:
        self.raw.max_dynamic_shared_size_bytes = nbytes


_FUNCTIONS: dict = {}
_RESIDENT: dict = {}


@functools.cache
def multiprocessors() -> int:
    """The current device's multiprocessor count (132 where no device answers: host-side tests
    get an H200's launch shapes)."""
    try:
        import cupy

        return int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    except Exception:  # noqa: BLE001 - no device (host-side tests)
        return 132


def function(name: str, expression: str, expressions: tuple[str, ...]) -> Kernel:
    """The compiled kernel ``expression`` of ``kernels/<name>.cu`` (one of ``expressions``),
    cached per process (a dict hit: launch paths call this on every step)."""
    key = (name, expression)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        fn = _FUNCTIONS[key] = Kernel(_module(name, expressions).get_function(expression))
    return fn


_CTYPES: dict = {}


def ctype(dtype) -> str:
    """The CUDA C type name of a float numpy dtype ("__half" or "float"); a dict hit on the hot path."""
    name = _CTYPES.get(dtype)
    if name is None:
        name = _CTYPES[dtype] = _ctype(dtype)
    return name


def _ctype(dtype) -> str:
    import numpy as np

    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return "__half"
    if dtype == np.float32:
        return "float"
    raise ValueError(f"unsupported float dtype {dtype} (float16 or float32)")

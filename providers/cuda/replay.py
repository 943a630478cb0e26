"""Eager launch replay: the host-side fast path of an eager (uncaptured) decode step.

In eager mode every node runs its Python launcher on every step: shape checks, buffer lookups,
launch configuration and CuPy's argument packing cost 10-30 us a node (8 us for the emptiest
CuPy launch on the H200 host; ``benchmarks/launch_cost.py``), while a decode step of a small
model is a few microseconds of GPU work a node. Decode steps repeat themselves: the session
feeds the same persistent buffers each step and every node gets its persistent outputs back
from its :class:`~core.protocol.KernelContext`.

:class:`ReplayKernel` wraps an op's ``run``. A run records the launches the op makes
(every launch goes through :class:`providers.cuda.module.Kernel`) as prepared driver-API
launches: function handle, grid, block, shared bytes and the argument values packed once.
When the node is next called with the same inputs (the same device arrays, by identity, and
the same host values, or the op's ``replay_key`` facts) and the context is not frozen, the
recorded launches are fired again through ``cuLaunchKernel`` and the recorded outputs returned.
The kernels and their arguments are exactly those of the launcher's run, so results are bitwise
the same; only the Python work is skipped. This is not a CUDA graph: every kernel is still
launched by the host, one ``cuLaunchKernel`` each.

A node is never replayed when its op module sets ``REPLAY = False`` or its run made device work
outside :class:`~providers.cuda.module.Kernel` (a CuPy expression: the launcher calls
:func:`not_replayable`), nor while its context is frozen (capture always runs the launcher,
so the context can check and pin its buffers). A transient run (a prefill, whose buffers the
executor frees as soon as their last reader has run) is neither replayed nor recorded: a record
would hold those buffers, and the decode step's record stays for the next step.

The recording state is process-global: plans of one process run nodes one at a time (the
cuda provider launches on one process-wide stream), as they do today. So is the PDL rule of the
launches being made (:data:`_pdl_rows`), but it is each provider's own: decided from its
:class:`~providers.cuda.tuning.Tuning` when it is made (:func:`pdl_rows`) and made current by its
nodes and runs, so two providers of one process may differ. Launches outside any run (a
``prepare`` hook's packing at load) take the rule of the provider that launched last; PDL
changes no bit either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from core.ops import run_memos
from providers.cuda.paths import PATHS

if TYPE_CHECKING:
    from providers.cuda.tuning import Tuning

#: Node calls since import: replayed (recorded launches fired), launched (the op's launcher
#: ran), unreplayable (the launcher did device work outside Kernel); pdl_launches counts kernel
#: launches made with programmatic dependent launch. Read with :func:`stats`.
PATHS.declare("replay", ("replayed", "launched", "unreplayable", "pdl_launches"))
#: Launches recorded by the node being run (None: no recording in progress).
_recording: list | None = None
#: Set by :func:`not_replayable` during a recording.
_spoiled = False
#: Rows of the node whose launches are being made, while PDL is on for its provider
#: (:class:`ReplayKernel` sets it from the node's first device input: its elements over its last
#: dimension; a decode step's nodes have one row per sequence). It stays set after the node, so
#: the provider's own launches that follow the lm_head (argmax, decode_advance) take the step's
#: rows; None before any node. Read by each :class:`Launch` for the PDL rows rule.
_rows: int | None = None


def stats() -> dict:
    """A copy of the node-call counters (the ``replay`` group of :data:`providers.cuda.paths.PATHS`)."""
    return PATHS.stats("replay")


def not_replayable() -> None:
    """Mark the node being recorded as not replayable (it did device work outside Kernel)."""
    global _spoiled
    _spoiled = True


class Launch:
    """One prepared launch: kernel arguments packed once into host memory; :meth:`fire` is one
    ``cuLaunchKernel`` call (CuPy's thin driver wrapper).

    Args:
        fn: CUfunction handle (int).
        grid, block: 1 to 3 dimensions.
        args: the kernel's arguments as given to CuPy: device arrays and numpy scalars.
        shared: dynamic shared memory, bytes.

    Raises:
        TypeError: an argument type without a fixed C layout (a Python int or float: CuPy
            would choose its width); the caller then does not record the node.
    """

    __slots__ = ("fn", "dims", "pdl", "shared", "params", "_keep", "_config")

    def __init__(self, fn: int, grid: tuple, block: tuple, args: tuple, shared: int):
        import cupy

        values = []
        for a in args:
            if isinstance(a, cupy.ndarray):
                values.append(np.array(a.data.ptr, np.uint64))
            elif isinstance(a, np.generic):
                values.append(np.array(a))
            else:
                raise TypeError(f"cannot pack kernel argument of type {type(a).__name__}")
        g, b = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        self.fn = fn
        self.dims = (int(g[0]), int(g[1]), int(g[2]), int(b[0]), int(b[1]), int(b[2]))
        # the PDL rule of the provider whose node made it, for that node's rows (pdl_rows)
        self.pdl = _pdl_rows is not None and _rows is not None and _rows <= _pdl_rows
        self.shared = int(shared)
        pointers = np.array([v.ctypes.data for v in values], np.uint64)
        self.params = int(pointers.ctypes.data) if len(values) else 0
        # the packed values, the pointer array and the device arrays (their memory must
        # outlive every replay) stay referenced here
        self._keep = (values, pointers, [a for a in args if isinstance(a, cupy.ndarray)])
        self._config: tuple | None = None

    def fire(self, stream: int) -> None:
        """Launch on ``stream`` (a CUstream handle): with programmatic dependent launch where the
        launch was made under PDL by a node of at most the provider's PDL rows (``pdl``, from
        :data:`_pdl_rows` when it was made: ``cuLaunchKernelEx``, the launch config built once per
        stream), else one plain ``cuLaunchKernel``.

        Raises:
            RuntimeError: the driver refused the launch (the CUresult is named).
        """
        if self.pdl:
            config = self._config
            if config is None or config[0] != stream:
                config = self._config = (stream, _pdl_config(self.dims, self.shared, stream))
            _launch_ex(self.fn, config[1], self.params)
            return
        d = self.dims
        _launch(self.fn, d[0], d[1], d[2], d[3], d[4], d[5], self.shared, stream, self.params)


#: The PDL rule of the provider whose launches are being made: the most rows of a node whose
#: launches take the programmatic attribute, None when PDL is off for it (:func:`pdl_rows` of
#: its :class:`~providers.cuda.tuning.Tuning`). Set per node by :class:`ReplayKernel` and at the
#: start of each of the provider's runs (:func:`use_pdl`, ``CudaProvider.own_stream``); like
#: :data:`_rows` it stays set after the node, so the provider's own launches that follow take it.
#: Not a switch: nothing here reads the environment (``LOCKSTEP_CUDA_PDL`` is read into the Tuning).
_pdl_rows: int | None = None
_functions: dict = {}


def _pdl_capable() -> bool:
    """Whether this device and process can launch with the programmatic attribute: compute
    capability 9.0 or later and cuda-bindings importable (False where CuPy or a device is
    missing: host-side tests)."""
    try:
        import cupy
        from cuda.bindings import driver  # noqa: F401

        return int(cupy.cuda.Device().compute_capability) // 10 >= 9
    except Exception:  # noqa: BLE001 - no CuPy, bindings or device: launch without the attribute
        return False


def pdl_rows(tuning: Tuning, capable: bool | None = None) -> int | None:
    """The most rows a node may have for its launches to take the programmatic stream-serialization
    attribute under ``tuning``, or None when PDL is off: ``tuning.pdl`` off, or the device cannot
    (``capable``; None: :func:`_pdl_capable` is asked). The limit is ``tuning.pdl_rows`` (``"all"``:
    no limit). A node's rows are its first device input's elements over its last dimension
    (:class:`ReplayKernel`): the batch of a decode step, batch x length for a prompt; launches
    before any node never take it. On by default because it hides each launch behind the
    previous kernel's tail (small decode steps measured faster on every folder,
    docs/performance.md); capped because large steps are long enough to hide their own launches
    and waiting blocks then only take room (measured slower on Llama-3.2-1B from 32 rows)."""
    if not tuning.pdl or not (_pdl_capable() if capable is None else capable):
        return None
    return 1 << 62 if tuning.pdl_rows == "all" else int(tuning.pdl_rows)


def use_pdl(rows: int | None) -> int | None:
    """Make ``rows`` (:func:`pdl_rows`; None: off) the PDL rule of the launches made from now on,
    by the provider about to launch; returns the rule before. A recorded launch keeps the rule it
    was made under (a launch already captured in a CUDA graph keeps its edges)."""
    global _pdl_rows
    before, _pdl_rows = _pdl_rows, rows
    return before


def _pdl_config(dims: tuple, shared: int, stream: int):
    from cuda.bindings import driver

    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = dims
    cfg.sharedMemBytes = shared
    cfg.hStream = driver.CUstream(stream)
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg


def _launch_ex(fn: int, config, params: int) -> None:
    from cuda.bindings import driver

    handle = _functions.get(fn)
    if handle is None:
        handle = _functions[fn] = driver.CUfunction(fn)
    (err,) = driver.cuLaunchKernelEx(config, handle, params, 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx failed: {err!r}")
    PATHS.add("replay", "pdl_launches")


def _bindings_launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params) -> None:
    from cuda.bindings import driver

    (err,) = driver.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, shared, stream, params, 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernel failed: {err!r}")


def _launcher():
    """cuLaunchKernel through CuPy's Cython driver wrapper (raises on error); through
    cuda-bindings where that module is absent."""
    try:
        from cupy_backends.cuda.api.driver import launchKernel
    except ImportError:
        return _bindings_launch

    def launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params) -> None:
        launchKernel(fn, gx, gy, gz, bx, by, bz, shared, stream, params, 0)

    return launch


def _launch(*args) -> None:
    global _launch
    _launch = _launcher()
    _launch(*args)


def record(kernel_ptr: int, grid, block, args, shared) -> None:
    """Called by :class:`~providers.cuda.module.Kernel` after each CuPy launch."""
    global _spoiled
    if _recording is None:
        return
    try:
        _recording.append(Launch(kernel_ptr, grid, block, args, shared))
    except TypeError:
        _spoiled = True


def _host_tag(x: Any):
    host = np.asarray(x)
    return (host.dtype.str, host.shape, host.tobytes())


def host_values(inputs: tuple, skip: int | None = None) -> tuple:
    """The values of the host inputs (None for device arrays and absent inputs), leaving out
    input ``skip``: the default replay key's host part, for ops that refine it."""
    import cupy

    return tuple(None if x is None or i == skip or isinstance(x, cupy.ndarray) else _host_tag(x)
                 for i, x in enumerate(inputs))


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= int(d)
    return out


class ReplayKernel:
    """An op's ``run`` with eager launch replay (module docstring).

    Args:
        run: the op's ``run(ctx, *inputs)``.
        host_facts: the op module's ``replay_key(ctx, *inputs)`` (optional): what the launcher
            uses of its host inputs; default: the host inputs' values.
        pdl_rows: the PDL rule of the provider whose kernel this is (:func:`pdl_rows`; None:
            off), made the launches' rule whenever the node runs (:func:`use_pdl`).
    """

    __slots__ = ("run", "host_facts", "pdl_rows", "_ndarray", "_stream")

    def __init__(self, run: Callable, host_facts: Callable | None = None, pdl_rows: int | None = None):
        import cupy

        self.run = run
        self.host_facts = host_facts
        self.pdl_rows = pdl_rows
        self._ndarray = cupy.ndarray
        self._stream = cupy.cuda.get_current_stream

    def _key(self, ctx, inputs) -> tuple:
        nd = self._ndarray
        if self.host_facts is not None:
            return tuple(id(x) if isinstance(x, nd) else None for x in inputs), self.host_facts(ctx, *inputs)
        # one pass: device arrays by identity, host values by content
        return tuple(id(x) if isinstance(x, nd) else (None if x is None else _host_tag(x)) for x in inputs)

    def __call__(self, ctx, *inputs):
        global _recording, _spoiled, _rows, _pdl_rows
        _pdl_rows = self.pdl_rows
        if _pdl_rows is not None:  # only the PDL rows rule reads it: no work per node without PDL
            first = next((x for x in inputs if isinstance(x, self._ndarray)), None)
            _rows = None if first is None or not first.shape else _prod(first.shape[:-1])
        if ctx.frozen or ctx.transient:  # capture pins buffers; a transient run's buffers die with it
            return self.run(ctx, *inputs)
        key = self._key(ctx, inputs)
        memo = run_memos(ctx).get("replay")
        if memo is not None and memo[0] == key:
            stream = self._stream().ptr
            for launch in memo[2]:
                launch.fire(stream)
            PATHS.add("replay", "replayed")
            return memo[1]
        outer, outer_spoiled = _recording, _spoiled
        _recording, _spoiled = [], False
        try:
            outs = self.run(ctx, *inputs)
            launches, spoiled = _recording, _spoiled
        finally:
            _recording, _spoiled = outer, outer_spoiled
        PATHS.add("replay", "launched")
        if spoiled:
            PATHS.add("replay", "unreplayable")
            run_memos(ctx).pop("replay", None)
        else:
            # the inputs stay referenced, so the ids in the key cannot be reused
            run_memos(ctx)["replay"] = (key, outs, launches, inputs)
        return outs

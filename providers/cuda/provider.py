"""The cuda execution provider: CuPy memory, CUDA C kernels, CUDA graph capture."""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np

from core.executor import PlanBinding
from core.ops import OpTable
from core.protocol import Capabilities, KVRequest, NodeInfo
from core.provider import ProviderBase
from providers.cuda import replay
from providers.cuda.replay import ReplayKernel
from providers.cuda.tuning import Tuning

#: (domain, op type) of the attention op, whose support depends on ``tuning.attn_ring``.
_GQA = ("com.microsoft", "GroupQueryAttention")
_MISSING_CUPY = ("the 'cuda' provider needs CuPy (and an NVIDIA GPU with its driver): from a checkout, "
                 "pip install -e \".[cuda13]\" (CUDA 13) or -e \".[cuda12]\" (CUDA 12); from an installed "
                 "lockstep, pip install \"lockstep[cuda13]\"")


def _import_cupy():
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(f"{_MISSING_CUPY} ({exc})") from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - driver missing or broken
        raise RuntimeError(f"the 'cuda' provider found no usable GPU: {exc}") from exc
    if count < 1:
        raise RuntimeError("the 'cuda' provider found no visible GPU (CUDA_VISIBLE_DEVICES?)")
    return cupy


_STREAM = None


def _shared_stream(cupy):
    """The one non-blocking stream every CudaProvider of the process uses. Launches go to
    CuPy's current stream, so two providers with streams of their own would race (the second
    one made current while the first one's capture, replay and downloads use the first)."""
    global _STREAM
    if _STREAM is None:
        _STREAM = cupy.cuda.Stream(non_blocking=True)
    return _STREAM


class _PinnedSlot:
    """Pinned host memory of ``nbytes`` and the event recorded after the last copy into it."""

    def __init__(self, cupy, nbytes: int):
        self.mem = cupy.cuda.alloc_pinned_memory(nbytes)
        self.host = np.frombuffer(self.mem, np.uint8, nbytes)
        self.event = cupy.cuda.Event(disable_timing=True)


class _PinnedDownload:
    """The handle of :meth:`CudaProvider.download_async`: its slot goes back to the free list
    once read, or when the handle is collected (a later copy into the slot is queued behind
    this one on the same stream, so it cannot overtake it).

    The slot goes back by a ``weakref.finalize``, never ``__del__``: a handle dropped in a
    reference cycle (a failed stream's traceback) is reclaimed by the cycle collector, which
    first finalises the slot's ``cupy.cuda.Event`` (destroying the CUDA event); a ``__del__``
    handing the slot back resurrected it with a destroyed event, and the next ``download_async``
    failed in ``cudaEventRecord`` (docs/reliability.md). The finaliser's registry holds the slot.
    """

    def __init__(self, free: list, slot: _PinnedSlot, shape: tuple, dtype: np.dtype, nbytes: int):
        self._shape, self._dtype, self._n = shape, dtype, nbytes
        self._slot: _PinnedSlot | None = slot
        self._out: np.ndarray | None = None
        self._give_back = weakref.finalize(self, free.append, slot)
        self._give_back.atexit = False

    def wait(self) -> np.ndarray:
        """Wait for the copy (its event only) and return it as a new host array."""
        if self._out is None:
            slot = self._slot
            assert slot is not None
            slot.event.synchronize()
            self._out = slot.host[:self._n].view(self._dtype).reshape(self._shape).copy()
            self._slot = None
            self._give_back()  # the slot back to the free list (a finalize runs once)
        return self._out


class _StreamBinding(PlanBinding):
    """:class:`core.executor.PlanBinding` whose ``run`` makes the provider stream current first."""

    def __init__(self, provider, plan):
        super().__init__(plan)
        self._provider = provider

    def run(self):
        self._provider.own_stream()
        return super().run()


class CudaProvider(ProviderBase):
    """CuPy arrays on the current device; every kernel launches on the provider's stream.

    Every instance uses one process-wide non-blocking stream and makes it current at
    construction (capture needs a stream other than the legacy default one, and warm-up should
    run on the capture stream).
    Graph capture: ``begin_capture()``; run the step; ``graph = end_capture()``;
    ``replay(graph)``. Arrays the captured step touches must be allocated before capture and
    kept alive by the caller (the graph holds no references; docs/cuda.md "Stream capture").

    Raises:
        RuntimeError: CuPy is missing, no GPU is visible, or the CUDA headers are missing.
    """

    name = "cuda"

    def __init__(self, tuning: Tuning | None = None):
        super().__init__()
        #: the switches (:class:`~providers.cuda.tuning.Tuning`): given, or read from the
        #: environment once, here, so a bad switch is named before anything else can fail
        self.tuning = Tuning.from_env() if tuning is None else tuning
        #: eager launch replay for plans made from now on (providers/cuda/replay.py); off with
        #: ``tuning.replay`` False (every node then runs its Python launcher every step)
        self.eager_replay = self.tuning.replay
        cupy = _import_cupy()
        #: the PDL rule of this provider's launches (:func:`providers.cuda.replay.pdl_rows`:
        #: ``tuning.pdl`` and ``pdl_rows`` where the device can; None: off)
        self.pdl_rows = replay.pdl_rows(self.tuning)
        self.cupy = cupy
        self.stream = _shared_stream(cupy)
        self.stream.use()
        self._argmax_scratch: dict = {}
        from providers.cuda import ops
        self.ops = OpTable(ops)  # supports, support_reason and prepare answer from it (ProviderBase)
        self._check_headers()
        # base pointer -> VmmArena; weak, so an arena is released with the last array over it
        self._arenas: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._bandwidth: float | None = None
        self._pinned_free: list[_PinnedSlot] = []  # download_async's staging slots not in use
        self._h2d: float | None = None
        self._vmm, page = None, 4096
        try:
            from providers.cuda import vmm
            if vmm.available():
                self._vmm, page = vmm, vmm.granularity()
        except Exception:  # noqa: BLE001 - no cuda-bindings or no VMM: growth reallocates instead
            self._vmm, page = None, 4096
        self._capabilities = Capabilities(dtypes=("float32", "float16"), graph_capture=True,
                                          vmm=self._vmm is not None, weight_streaming=True, page_bytes=page)

    def _check_headers(self) -> None:
        from providers.cuda.module import function
        try:
            function("argmax", "decode_advance",
                     ("argmax_partial<__half>", "argmax_partial<float>", "argmax_final", "decode_advance"))
        except Exception as exc:  # noqa: BLE001 - NVRTC errors come in several types
            if "cuda_fp16" in str(exc) or "CUDA headers" in str(exc):
                raise RuntimeError("the 'cuda' provider needs the CUDA toolkit headers: install "
                                   "cupy-cuda13x[ctk] / cupy-cuda12x[ctk] (or set CUDA_PATH); "
                                   f"NVRTC said: {exc}") from exc
            raise

    # -- protocol -------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def supports(self, node: NodeInfo) -> bool:
        """The op table's answer; GroupQueryAttention's under ``tuning.attn_ring``."""
        if (node.domain, node.op_type) == _GQA:
            from providers.cuda.ops import group_query_attention

            return group_query_attention.supports(node, ring=self.tuning.attn_ring)
        return ProviderBase.supports(self, node)

    def support_reason(self, node: NodeInfo) -> str | None:
        """Why :meth:`supports` refuses ``node``, or None (GroupQueryAttention's under
        ``tuning.attn_ring``)."""
        if (node.domain, node.op_type) == _GQA:
            from providers.cuda.ops import group_query_attention

            return group_query_attention.support_reason(node, ring=self.tuning.attn_ring)
        return ProviderBase.support_reason(self, node)

    def kernel(self, node: NodeInfo):
        """The op's launcher, wrapped for eager launch replay unless the op module sets
        ``REPLAY = False`` (providers/cuda/replay.py)."""
        module = self._table().modules[(node.domain, node.op_type)]
        if not self.eager_replay or not getattr(module, "REPLAY", True):
            return module.run
        return ReplayKernel(module.run, getattr(module, "replay_key", None), self.pdl_rows)

    def _allocate(self, shape, dtype, zero):
        cp = self.cupy
        return cp.zeros(shape, dtype) if zero else cp.empty(shape, dtype)

    def _upload(self, array: np.ndarray):
        return self.cupy.asarray(array)

    def _download(self, tensor: Any) -> np.ndarray:
        if isinstance(tensor, np.ndarray):
            return tensor.copy()
        out = tensor.get(stream=self.stream)
        self.stream.synchronize()
        return out

    def download_async(self, tensor: Any) -> Any:
        """Queue a copy of ``tensor`` into a pinned host slot on the provider stream, behind
        the work queued so far; ``wait()`` on the returned handle waits for that copy alone (an
        event) and returns a host array of the tensor's shape and dtype. A contiguous tensor
        only; anything else is downloaded now (a finished handle)."""
        if isinstance(tensor, np.ndarray) or not tensor.flags.c_contiguous:
            return super().download_async(tensor)
        n = int(tensor.nbytes)
        slot = self._pinned_slot(n)
        cp = self.cupy
        cp.cuda.runtime.memcpyAsync(slot.host.ctypes.data, tensor.data.ptr, n, cp.cuda.runtime.memcpyDeviceToHost,
                                    self.stream.ptr)
        slot.event.record(self.stream)
        self.downloaded_bytes += n
        return _PinnedDownload(self._pinned_free, slot, tuple(tensor.shape), np.dtype(tensor.dtype), n)

    def _pinned_slot(self, nbytes: int) -> _PinnedSlot:
        """A free pinned staging slot of at least ``nbytes`` (a new one when none is free)."""
        free = self._pinned_free
        for i, slot in enumerate(free):
            if slot.host.nbytes >= nbytes:
                return free.pop(i)
        return _PinnedSlot(self.cupy, max(nbytes, 4096))

    def _write(self, tensor, host: np.ndarray) -> None:
        tensor.set(host, stream=self.stream)

    def _fill(self, tensor, value: float) -> None:
        tensor.fill(value)

    def _copy_bytes(self, dst, src, copies) -> None:
        cp = self.cupy
        for so, do, n in copies:
            cp.cuda.runtime.memcpyAsync(dst.data.ptr + do, src.data.ptr + so, n,
                                        cp.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)

    def device_argmax(self, logits: Any, positions: Any, result: Any) -> None:
        from providers.cuda.ops import _argmax
        _argmax.device_argmax(self, logits, positions, result)

    def device_sample(self, logits: Any, positions: Any, counter: Any, fed: Any, sampling: Any, result: Any) -> None:
        """Per-row sampling in one kernel (kernels/sample.cu); capturable, allocates nothing."""
        from providers.cuda.ops import _sample
        _sample.device_sample(logits, positions, counter, fed, sampling, result)

    def decode_advance(self, result, input_ids, attention_mask, lengths) -> None:
        from providers.cuda.ops import _argmax
        self.own_stream()  # the first launch of every decode step
        _argmax.decode_advance(result, input_ids, attention_mask, lengths)

    def io_binding(self, plan):
        """The core's plan binding, whose ``run`` first makes the provider stream current
        (:meth:`own_stream`)."""
        return _StreamBinding(self, plan)

    def own_stream(self) -> None:
        """Make the provider stream CuPy's current stream again if the caller changed it.
        Kernels and CuPy expressions launch on the current stream, while copies, events and
        replays use the provider stream; a ``with other_stream:`` block around a call (which
        leaves the null stream current on exit) would otherwise split one step over two
        unordered streams and let a queued result copy overtake its kernels. Also makes this
        provider's PDL rule the launches' (:func:`providers.cuda.replay.use_pdl`)."""
        replay.use_pdl(self.pdl_rows)
        if self.cupy.cuda.get_current_stream().ptr != self.stream.ptr:
            self.stream.use()

    def reserve(self, shape: Sequence[int], dtype: Any):
        """A tensor over a VMM arena: address range reserved, no page backed until
        :meth:`kv_commit` (only when ``capabilities().vmm``)."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if self._vmm is None:
            raise RuntimeError("cuda: reserve needs VMM (capabilities().vmm is False on this device)")
        arena = self._vmm.VmmArena(nbytes)
        self._arenas[arena.ptr] = arena
        return arena.array(tuple(shape), dtype)

    def _kv_commit(self, arena: Any, requests: Sequence[KVRequest]) -> int:
        """Back the requested byte ranges of a tensor made by :meth:`reserve` (maps pages);
        for a plain allocation, only count. Returns bytes newly committed."""
        vmm = self._arenas.get(getattr(getattr(arena, "data", None), "ptr", None))
        if vmm is None:
            return super()._kv_commit(arena, requests)
        return sum(vmm.commit(r.offset, r.nbytes) for r in requests)

    def device_bandwidth(self) -> float:
        """Measured device-to-device copy bandwidth in bytes/s, counting bytes read plus
        written (1 GiB copies, median of 5, timed with CUDA events); measured once."""
        if self._bandwidth is None:
            cp = self.cupy
            a = cp.ones(1 << 28, cp.float32)
            b = cp.empty_like(a)

            def copy():
                b[...] = a

            self._bandwidth = 2 * a.nbytes / self._median_seconds(copy)
            del a, b
            self._return_probe()
        return self._bandwidth

    def _return_probe(self) -> None:
        """Give a bandwidth probe's freed buffers back to the device at once. Left cached in the
        pool, the next allocations (a session's KV and buffers) are carved out of them, and the
        pool can no longer free those 1 GiB chunks: the process then holds a GiB it does not use
        (measured on the H200: SmolLM2-135M int4 peaked at 1,097 MiB for 73 MiB of weights)."""
        self.stream.synchronize()
        self.cupy.get_default_memory_pool().free_all_blocks()

    def settings(self) -> dict[str, str]:
        """The cuda provider's switches (docs/cuda.md): programmatic dependent launch
        and its rows, the GEMM schedule (PIPE), tiled kernels, split-K and token tiles per block, the
        attention's hinted prologue and compile-time head size, eager launch replay."""
        on = ("off", "on")
        out = self.tuning.settings()
        del out["replay"]
        out.update(pdl=on[self.pdl_rows is not None], eager_replay=on[self.eager_replay])  # what runs
        return out

    def node_timer(self):
        """CUDA events recorded on the provider stream around each node (``lockstep profile
        --kernels``, core.kernel_profile): ``mark()`` records a new event, ``seconds(a, b)``
        is the GPU time between two (read after :meth:`synchronize`); ``hold()`` puts a GPU wait
        in front of a step so the host's launch gaps are not timed."""
        cp, stream = self.cupy, self.stream
        from providers.cuda.module import function

        class EventTimer:
            def __init__(self):
                self._free: list = []  # events given back by release(), recorded again by mark()

            def hold(self, seconds: float = 0.03) -> None:
                """Make the stream wait ``seconds`` on the GPU (kernels/timing.cu): the host then
                enqueues a whole eager step behind it, so the events time GPU work only."""
                function("timing", "gpu_hold", ("gpu_hold",))((1,), (1,), (np.int64(seconds * 1e9),))

            def mark(self):
                event = self._free.pop() if self._free else cp.cuda.Event()
                event.record(stream)
                return event

            def seconds(self, start, end) -> float:
                return cp.cuda.get_elapsed_time(start, end) / 1e3

            def release(self, *marks) -> None:
                """Marks read for the last time: later mark() calls record them again (a
                session times every step with two; creating events is most of a mark's cost)."""
                self._free.extend(marks)

        return EventTimer()

    def _median_seconds(self, work) -> float:
        """Seconds ``work()`` takes on the stream: CUDA events, 6 runs, the median of the last 5
        (the first one warms up)."""
        cp = self.cupy
        times = []
        for _ in range(6):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(self.stream)
            work()
            stop.record(self.stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
        return float(np.median(times[1:]))

    def stage(self, array: np.ndarray) -> np.ndarray:
        """A pinned host copy of ``array`` (``cupy.cuda.alloc_pinned_memory``; the array keeps
        its block alive), written in 64 MiB pieces so a memory-mapped weight is read once."""
        host = np.asarray(array)
        mem = self.cupy.cuda.alloc_pinned_memory(max(host.nbytes, 1))
        pinned = np.frombuffer(mem, host.dtype, host.size).reshape(host.shape)
        flat_in, flat_out = host.reshape(-1), pinned.reshape(-1)
        step = max(1, (64 << 20) // max(host.itemsize, 1))
        for i in range(0, flat_in.size, step):
            flat_out[i:i + step] = flat_in[i:i + step]
        self.staged_bytes += int(host.nbytes)
        return pinned

    def map_host(self, staged: np.ndarray):
        """A CuPy array over a :meth:`stage` copy that kernels read in place: pinned memory is
        mapped into the device's address space under the same pointer (unified addressing), so
        a gather reads its B rows over the bus and the table takes no device memory."""
        cp = self.cupy
        mem = cp.cuda.UnownedMemory(staged.ctypes.data, max(staged.nbytes, 1), staged, cp.cuda.Device().id)
        return cp.ndarray(staged.shape, staged.dtype, cp.cuda.MemoryPointer(mem, 0))

    def row_blocks(self, node, shape_of):
        """The nodes whose kernels give a row block the whole node's bits
        (:func:`providers.cuda.streaming.row_blocks`)."""
        from providers.cuda.streaming import row_blocks

        return row_blocks(node, shape_of)

    def weight_stream(self, slots: int, slot_bytes: int):
        """A staging ring with a copy stream and per-slot events (providers/cuda/streaming.py)."""
        from providers.cuda.streaming import CudaWeightStream

        return CudaWeightStream(self, slots, slot_bytes)

    def host_to_device_bandwidth(self) -> float:
        """Pinned host-to-device copy bandwidth in bytes/s (256 MiB copies, median of 5, CUDA
        events); measured once."""
        if self._h2d is None:
            cp = self.cupy
            n = 1 << 28
            mem = cp.cuda.alloc_pinned_memory(n)
            dev = cp.empty(n, cp.uint8)
            rt = cp.cuda.runtime

            def copy():
                rt.memcpyAsync(dev.data.ptr, mem.ptr, n, rt.memcpyHostToDevice, self.stream.ptr)

            self._h2d = n / self._median_seconds(copy)
            del dev, mem
            self._return_probe()
        return self._h2d

    def device_used_bytes(self) -> int:
        """Device bytes in use by the driver's count (cudaMemGetInfo: total minus free)."""
        free, total = self.cupy.cuda.runtime.memGetInfo()
        return int(total) - int(free)

    def free_device_bytes(self) -> int:
        """Free device memory now (cudaMemGetInfo) plus what CuPy's pool holds unused."""
        free, _ = self.cupy.cuda.runtime.memGetInfo()
        return int(free) + int(self.cupy.get_default_memory_pool().free_bytes())

    def peak_bytes(self) -> int:
        """Device bytes held: the CuPy pool's high-water total plus committed VMM pages."""
        pool = self.cupy.get_default_memory_pool()
        return int(pool.total_bytes()) + sum(a.committed for a in self._arenas.values() if a.ptr)

    def reset_peak(self) -> None:
        """Return cached, unused pool blocks to the device so the next peak starts low."""
        self.cupy.get_default_memory_pool().free_all_blocks()

    def workspace_bytes(self) -> int:
        """Device bytes of the scratch every node shares: the split-KV decode workspaces of
        GroupQueryAttention (one per shape), the argmax partials (one per batch and chunk
        count) and the GEMMs' split-K workspace (one per device, shared by the process)."""
        from providers.cuda.ops import _mma

        held = [a for ws in self.__dict__.get("_gqa_workspace", {}).values() for a in ws]
        held += [a for scratch in self._argmax_scratch.values() for a in scratch]
        return sum(int(a.nbytes) for a in held) + _mma.split_workspace_bytes()

    def planned_workspace_bytes(self, nodes: Sequence[NodeInfo], steps: Sequence[int], shape_of: Any,
                                batch: int, capacity: int) -> int:
        """The step's activations (the default's count) plus the scratch :meth:`workspace_bytes`
        will hold at ``batch`` rows over ``capacity`` positions: the GEMMs' split-K workspace,
        one split-KV workspace per GroupQueryAttention shape (partials ``[B, Nq, chunks, H + 2]``
        float32 and tickets ``[B, Nkv]`` int32, chunks for a full cache or a ring, whichever is
        more), the argmax partials of the ``[B, V]`` logits and a prompt's ring staging cache."""
        from providers.cuda.ops import _argmax
        from providers.cuda.ops import _mma_schedule as schedule
        from providers.cuda.ops.group_query_attention import decode_chunks, prompt_staging_bytes

        total = super().planned_workspace_bytes(nodes, steps, shape_of, batch, capacity)
        total += schedule.SPLIT_BYTES + 4 * schedule.SPLIT_TICKETS + prompt_staging_bytes(nodes, steps, shape_of)
        gqa = set()
        for i in steps:
            n = nodes[i]
            if n.op_type != "GroupQueryAttention":
                continue
            past = shape_of(n.inputs[3]) if len(n.inputs) > 3 and n.inputs[3] else None
            out = shape_of(n.outputs[0])
            nq, nkv = int(n.attrs["num_heads"]), int(n.attrs["kv_num_heads"])
            h = int(past.shape[-1]) if past is not None else (int(out.shape[-1]) // nq if out is not None else 0)
            window = int(n.attrs.get("local_window_size", -1))
            chunks = max(decode_chunks(capacity, window if window > 0 else capacity, ring)
                         for ring in (False, True))
            gqa.add((nq, nkv, chunks, h))
        total += sum(batch * (nq * chunks * (h + 2) * 4 + nkv * 4) for nq, nkv, chunks, h in gqa)
        logits = shape_of("logits")
        if logits is not None:
            total += batch * -(-int(logits.shape[-1]) // _argmax.CHUNK) * 12
        return total

    def synchronize(self) -> None:
        self.stream.synchronize()

    # -- capture --------------------------------------------------------------------------
    def begin_capture(self) -> None:
        """Start capturing every launch on the provider stream (allocation then fails)."""
        self.stream.begin_capture()

    def end_capture(self):
        """Stop capturing; returns the instantiated ``cupy.cuda.Graph``."""
        return self.stream.end_capture()

    def replay(self, graph) -> None:
        """Launch a captured graph on the provider stream (asynchronous)."""
        graph.launch(self.stream)

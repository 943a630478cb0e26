"""A base class for execution providers: validated public methods over private implementations.

:class:`ProviderBase` implements the public protocol of :mod:`core.protocol`. Each public method
checks its arguments, keeps the provider's counters and calls an underscored method that a
provider implements (``_allocate``, ``_upload``, ``_download``, ``_write``, ``_copy_bytes``, ...).
It also gives defaults for what most providers share: an IO binding over the plan, kv_commit
accounting, decode_advance and fill/copy written with array indexing (NumPy and CuPy arrays
both support it), and no-op answers for the optional members (peak memory, bandwidth).

The core touches provider tensors only through these methods (``write``, ``fill``,
``copy_bytes``, ``upload``, ``download``); it never indexes a provider tensor itself.

A provider does not have to inherit from this class: any object with the members of
:data:`core.protocol.REQUIRED_MEMBERS` is accepted. Inheriting gives the checks and counters
for free, so a new provider writes only its memory primitives and its kernels.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from core.ops import OpTable
from core.protocol import ARGMAX_ERROR, ARGMAX_TOKEN, Capabilities, Kernel, KVRequest, NodeInfo, SamplingTensors


class ReadyDownload:
    """A download that finished when it was made: ``wait()`` returns ``array`` (the default
    :meth:`ProviderBase.download_async`)."""

    def __init__(self, array: np.ndarray):
        self._array = array

    def wait(self) -> np.ndarray:
        """The downloaded host array."""
        return self._array


def _none(*_args: Any) -> None:
    return None


def _planned_activations(nodes: Sequence[Any], steps: Sequence[int], shape_of: Callable[[str], Any],
                         batch: int, capacity: int) -> int:
    from core.runtime.workspace import activation_bytes

    return activation_bytes(nodes, steps, shape_of)


def _async_download(provider: Any) -> Callable[[Any], ReadyDownload]:
    return lambda tensor: ReadyDownload(provider.download(tensor))


#: The optional protocol members (:mod:`core.protocol`) and, for each, what makes the default a
#: provider lacking it is given (:func:`with_defaults`): the same answer as
#: :class:`ProviderBase`'s method. ``device_sample`` is not here: a provider without it cannot
#: sample (the engine refuses such requests), which is an answer, not a default.
OPTIONAL_DEFAULTS: dict[str, Callable[[Any], Callable[..., Any]]] = {
    "support_reason": lambda p: _none,  # no reason to give
    "prepare": lambda p: _none,  # no plan-time weight hook
    "prepared_forms": lambda p: _none,  # planned from the raw sizes
    "download_async": _async_download,  # a synchronous download, finished when returned
    "peak_bytes": lambda p: _none,  # cannot tell
    "reset_peak": lambda p: _none,  # nothing to reset
    "workspace_bytes": lambda p: _none,
    "planned_workspace_bytes": lambda p: _planned_activations,  # the activations alone
    "device_bandwidth": lambda p: _none,
    "host_to_device_bandwidth": lambda p: _none,
    "device_used_bytes": lambda p: _none,
    "free_device_bytes": lambda p: _none,  # unbounded or unknown
    "node_timer": lambda p: _none,  # cannot time its nodes
    "settings": lambda p: dict,  # no switches
    "row_blocks": lambda p: _none,  # every node streams whole
}


def with_defaults(provider: Any) -> Any:
    """``provider`` with every optional member it lacks set to its default
    (:data:`OPTIONAL_DEFAULTS`), once, when the registry creates it, so the core calls the
    optional members without probing for them. A :class:`ProviderBase` has them all already.

    Raises:
        TypeError: a member is missing and the object does not take attributes (``__slots__``).
    """
    for name, make in OPTIONAL_DEFAULTS.items():
        if not hasattr(provider, name):
            try:
                setattr(provider, name, make(provider))
            except AttributeError as exc:
                raise TypeError(f"provider {getattr(provider, 'name', provider)!r} lacks the optional member "
                                f"{name!r} and does not take its default (inherit core.provider.ProviderBase)"
                                ) from exc
    return provider


class ProviderBase:
    """Validated protocol methods; subclasses implement the underscored primitives.

    Counters (bytes, cumulative over the provider's life):
        uploaded_bytes: bytes copied host -> device by :meth:`upload` and :meth:`write`.
        downloaded_bytes: bytes copied device -> host by :meth:`download`.
        committed_bytes: bytes backed through :meth:`kv_commit`.
        staged_bytes: bytes of host copies made by :meth:`stage`.

    Subclasses must set ``name`` and implement ``capabilities``, ``_allocate(shape, dtype,
    zero)``, ``_upload(array)``, ``_download(tensor)``, ``device_argmax`` and ``synchronize``.
    ``supports``, ``kernel``, ``support_reason`` and ``prepare`` answer from the op table the
    provider owns (``ops``, given to ``__init__``); a provider without one overrides
    ``supports`` and ``kernel``. ``_write``, ``_fill`` and ``_copy_bytes`` have
    array-indexing defaults.

    Args:
        ops: the provider's op table (:class:`core.ops.OpTable`: one module per op), or None.

    Attributes:
        ops: that table, or None. The core's host fallback runs a host provider's table
            (:class:`core.executor.host.HostFallback`).
    """

    name = "provider"

    def __init__(self, ops: OpTable | None = None) -> None:
        self.ops = ops
        self.uploaded_bytes = 0
        self.staged_bytes = 0
        self.downloaded_bytes = 0
        self.committed_bytes = 0

    # -- what a provider must implement ---------------------------------------------------
    def capabilities(self) -> Capabilities:
        """Static description of what this provider can do."""
        raise NotImplementedError

    def supports(self, node: NodeInfo) -> bool:
        """True when :meth:`kernel` can run ``node``: by default, when the op table has a
        kernel for it (:meth:`core.ops.OpTable.supports`).

        Raises:
            NotImplementedError: the provider has no op table and does not override this.
        """
        return self._table().supports(node)

    def kernel(self, node: NodeInfo) -> Kernel:
        """The callable that runs ``node`` (called once per node at plan time): by default the
        op table's (:meth:`core.ops.OpTable.kernel`).

        Raises:
            NotImplementedError: the provider has no op table and does not override this.
        """
        return self._table().kernel(node)

    def _table(self) -> OpTable:
        if self.ops is None:
            raise NotImplementedError(f"provider {self.name!r} has no op table: it must implement supports "
                                      "and kernel")
        return self.ops

    def device_argmax(self, logits: Any, positions: Any, result: Any) -> None:
        """Greedy selection on the device (see :class:`core.protocol.ExecutionProvider`)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for all queued device work."""

    def _allocate(self, shape: tuple[int, ...], dtype: np.dtype, zero: bool) -> Any:
        raise NotImplementedError

    def _upload(self, array: np.ndarray) -> Any:
        raise NotImplementedError

    def _download(self, tensor: Any) -> np.ndarray:
        raise NotImplementedError

    # -- validated public methods ---------------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: Any, zero: bool = False) -> Any:
        """A device tensor of ``shape`` / ``dtype`` (zero-filled when ``zero``).

        Raises:
            ValueError: a negative or non-integer dimension.
        """
        dims = tuple(int(s) for s in shape)
        if any(d < 0 for d in dims) or len(dims) != len(tuple(shape)):
            raise ValueError(f"{self.name}: cannot allocate shape {tuple(shape)}")
        return self._allocate(dims, np.dtype(dtype), bool(zero))

    def upload(self, array: np.ndarray) -> Any:
        """Copy a host array to a new device tensor (counted in ``uploaded_bytes``)."""
        host = np.ascontiguousarray(array)
        self.uploaded_bytes += host.nbytes
        return self._upload(host)

    def download(self, tensor: Any) -> np.ndarray:
        """Copy a device tensor to a new host array (synchronises)."""
        out = self._download(tensor)
        self.downloaded_bytes += int(out.nbytes)
        return out

    def download_async(self, tensor: Any) -> Any:
        """Start copying ``tensor`` to the host as it will be once the work queued so far has
        run; returns a handle whose ``wait() -> numpy.ndarray`` gives that copy. Work queued
        after this call (a later step overwriting the tensor) does not change what ``wait()``
        returns.

        This default copies now (:meth:`download`, synchronising) and returns a finished
        handle; a provider with an asynchronous device queue overrides it so the host can
        queue the next decode step before it reads this one (``Session.step_async``).
        """
        return ReadyDownload(self.download(tensor))

    def write(self, tensor: Any, array: np.ndarray) -> None:
        """Copy a host array into an existing device tensor of the same shape, in place.

        Raises:
            ValueError: the shapes differ.
        """
        host = np.ascontiguousarray(array, dtype=tensor.dtype)
        if tuple(host.shape) != tuple(tensor.shape):
            raise ValueError(f"{self.name}: write of {host.shape} into a tensor of {tuple(tensor.shape)}")
        self.uploaded_bytes += host.nbytes
        self._write(tensor, host)

    def fill(self, tensor: Any, value: float) -> None:
        """Set every element of ``tensor`` to ``value`` (e.g. NaN, to poison unused KV slots)."""
        self._fill(tensor, value)

    def copy_bytes(self, dst: Any, src: Any, copies: Sequence[tuple[int, int, int]]) -> int:
        """Device-to-device copies ``(src_offset, dst_offset, nbytes)`` between two tensors' bytes.

        Returns:
            bytes copied.

        Raises:
            ValueError: a range outside either tensor.
        """
        for s, d, n in copies:
            if s < 0 or d < 0 or s + n > src.nbytes or d + n > dst.nbytes:
                raise ValueError(f"{self.name}: copy ({s}, {d}, {n}) outside {src.nbytes} / {dst.nbytes} bytes")
        self._copy_bytes(dst, src, copies)
        return sum(n for _, _, n in copies)

    def support_reason(self, node: NodeInfo) -> str | None:
        """Why :meth:`supports` rejects ``node`` (an optional member: the parity kit adds it to
        the message of a skipped case), or None: supported, or no reason to give. By default
        the op table's answer (:meth:`core.ops.OpTable.support_reason`), None without one."""
        return None if self.ops is None else self.ops.support_reason(node)

    def prepare(self, node: NodeInfo) -> Callable[..., dict | None] | None:
        """The plan-time weight hook of ``node``'s op, or None (see :mod:`core.ops`: a hook turns
        constant inputs into the kernel's own form once, e.g. packed for the tensor cores). By
        default the op table's (:meth:`core.ops.OpTable.prepare`), None without one."""
        return None if self.ops is None else self.ops.prepare(node)

    def prepared_forms(self, node: NodeInfo, inputs: Sequence[Any]) -> dict | None:
        """What :meth:`prepare`'s hook will return for ``node``, from shapes alone: {input
        index: :class:`core.ops.Spec` of the replacement, or None for a dropped input}, or None
        (nothing declared: the load is planned from the raw sizes). ``inputs``: a Spec per
        constant input, None for the others. By default the op module's ``prepared``
        (:mod:`core.ops`), None without one."""
        declare = None if self.ops is None else self.ops.prepared(node)
        return None if declare is None else declare(node, *inputs)

    def io_binding(self, plan):
        """Persistent IO binding over a plan (the core's :class:`~core.executor.PlanBinding`)."""
        from core.executor import PlanBinding

        return PlanBinding(plan)

    def device_sample(self, logits: Any, positions: Any, counter: Any, fed: Any,
                      sampling: SamplingTensors, result: Any) -> None:
        """Sampling through the host (see :class:`core.protocol.ExecutionProvider`): downloads
        the rows, runs the reference :func:`core.generation.sampling.sample_rows` and writes
        ``result``. Correct on any provider, but it synchronises, so a captured step that uses
        it falls back to eager; a device provider overrides it with a kernel."""
        from core.generation.sampling import sample_rows

        pos = self.download(positions).astype(np.int64)
        rows = self.download(logits)[np.arange(len(pos)), pos].astype(np.float32)
        history = self.download(sampling.history)
        if fed is not None:
            history[np.arange(len(pos)), self.download(fed)[:, 0]] = 1
            self.write(sampling.history, history)
        out = sample_rows(rows, self.download(sampling.params), self.download(sampling.options),
                          self.download(counter), history)
        self.write(result, out)

    def decode_advance(self, result: Any, input_ids: Any, attention_mask: Any, lengths: Any) -> None:
        """Feed the chosen tokens back (see :class:`core.protocol.ExecutionProvider`)."""
        flagged = result[:, ARGMAX_ERROR] != 0
        input_ids[:, 0] = (result[:, ARGMAX_TOKEN] * (1 - flagged)).astype(input_ids.dtype)
        rows = self._arange(len(lengths))
        attention_mask[rows, lengths] = 1
        lengths += 1

    def kv_commit(self, arena: Any, requests: Sequence[KVRequest]) -> int:
        """Make byte ranges of a KV arena backed; returns bytes newly committed (the default
        only counts, clipped to the arena: memory from :meth:`allocate` is always backed).
        Ranges are whole pages (``capabilities().page_bytes``), so the last may end past the
        arena's last byte.

        Raises:
            ValueError: a range starting outside the arena.
        """
        for r in requests:
            if r.offset < 0 or r.nbytes < 0 or r.offset >= arena.nbytes:
                raise ValueError(f"{self.name}: KV commit ({r.offset}, {r.nbytes}) outside {arena.nbytes} bytes")
        added = self._kv_commit(arena, requests)
        self.committed_bytes += added
        return added

    def reserve(self, shape: Sequence[int], dtype: Any) -> Any:
        """A tensor over reserved address space, pages backed by :meth:`kv_commit` (only when
        ``capabilities().vmm``).

        Raises:
            NotImplementedError: the provider has no VMM.
        """
        raise NotImplementedError(f"provider {self.name!r} has no VMM (capabilities().vmm is False)")

    def stage(self, array: np.ndarray) -> np.ndarray:
        """The host copy a streamed or mapped weight lives in, made once (pinned memory on a
        GPU, so copies from it are asynchronous and kernels may read it): a new C-contiguous
        array of ``array``'s shape and dtype. Counted in ``staged_bytes``."""
        self.staged_bytes += int(array.nbytes)
        return np.array(array, order="C", copy=True)

    def map_host(self, staged: np.ndarray) -> Any:
        """A tensor kernels read in place over a :meth:`stage` copy (a gathered table: a step
        reads B rows of it from host memory). On a host provider the copy itself."""
        return staged

    def row_blocks(self, node: Any, shape_of: Any) -> Any:
        """How ``node`` runs on a block of its output rows when its weights stream as row-block
        pages (:class:`core.runtime.rowblocks.RowSplit`), or None: it streams whole (the
        default). A provider declares it only for kernels that compute every output element of
        a block bitwise as the whole node does (``shape_of``: constant name -> shape or None)."""
        return None

    def weight_stream(self, slots: int, slot_bytes: int) -> WeightStream:
        """A staging ring of ``slots`` device buffers of ``slot_bytes`` for weight streaming
        (:mod:`core.runtime.residency`). The default copies synchronously with :meth:`write`;
        a device provider overrides it with asynchronous copies on a copy stream."""
        return WeightStream(self, slots, slot_bytes)

    # -- optional measurements (None when the provider cannot tell) ------------------------
    def peak_bytes(self) -> int | None:
        """Device bytes held at the high-water mark, or None."""
        return None

    def reset_peak(self) -> None:
        """Start a new peak measurement (no-op by default)."""

    def workspace_bytes(self) -> int | None:
        """Device bytes of kernel scratch the provider keeps outside the kernel contexts (shared
        by every node and plan of the provider), or None when it cannot tell. Part of the
        workspace :meth:`core.runtime.runner.Runner.memory` reports."""
        return None

    def planned_workspace_bytes(self, nodes: Sequence[Any], steps: Sequence[int],
                                shape_of: Callable[[str], Any], batch: int, capacity: int) -> int:
        """Device bytes a decode step of ``batch`` rows over ``capacity`` KV positions makes
        this provider allocate beside the weights and the KV cache, declared before it runs
        (:mod:`core.runtime.workspace`): the per-step nodes' (``nodes[i]`` for ``i`` in
        ``steps``) activation buffers at the shapes ``shape_of(value name) -> Spec | None``
        gives, and the provider's scratch (:meth:`workspace_bytes` once allocated). A device
        budget reserves it before the weights get what is left. The default: the activations
        alone (one buffer per node output, :func:`core.runtime.workspace.activation_bytes`);
        a provider with scratch adds it."""
        return _planned_activations(nodes, steps, shape_of, batch, capacity)

    def device_bandwidth(self) -> float | None:
        """Measured device memory bandwidth in bytes/s (read + write), or None."""
        return None

    def node_timer(self) -> Any:
        """A node timer for ``lockstep profile --kernels`` (``mark()``, ``seconds(a, b)``;
        :mod:`core.kernel_profile`), or None: this provider cannot time its nodes."""
        return None

    def settings(self) -> dict[str, str]:
        """The switches, set outside the code (environment variables), that change how this
        provider runs: name -> value, for reports (``lockstep profile`` prints them in its title
        and JSON, so a measurement says what it measured). Empty by default."""
        return {}

    def host_to_device_bandwidth(self) -> float | None:
        """Measured host-to-device copy bandwidth from staged (pinned) memory in bytes/s, or None."""
        return None

    def device_used_bytes(self) -> int | None:
        """Device bytes in use by the driver's count (every process, the context included), or
        None when the provider cannot tell (:class:`core.runtime.meter.DriverMeter` polls it)."""
        return None

    def free_device_bytes(self) -> int | None:
        """Device bytes free now (for the default weight budget), or None when unbounded/unknown."""
        return None

    # -- array-indexing defaults ----------------------------------------------------------
    def _write(self, tensor: Any, host: np.ndarray) -> None:
        tensor[...] = self._upload(host)

    def _fill(self, tensor: Any, value: float) -> None:
        tensor[...] = value

    def _copy_bytes(self, dst: Any, src: Any, copies: Sequence[tuple[int, int, int]]) -> None:
        d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
        for so, do, n in copies:
            d[do:do + n] = s[so:so + n]

    def _kv_commit(self, arena: Any, requests: Sequence[KVRequest]) -> int:
        return sum(min(r.offset + r.nbytes, arena.nbytes) - r.offset for r in requests)

    def _arange(self, n: int) -> Any:
        return np.arange(n)


class WeightStream:
    """A ring of device staging slots that streamed weights are copied into, step by step.

    The executor drives it in a static order per step (:meth:`core.executor.Plan.run`)::

        begin()                          # the step starts (device providers: fork the copy stream)
        copy(slot, items)                # a page of weights -> slot; waits for its last reader
        ready(slot)                      # before the first kernel that reads the slot
        release(slot)                    # after the last kernel that reads the slot
        end()                            # the step ends (join the copy stream)

    This default runs on the host: ``copy`` writes synchronously through the provider, the
    other calls do nothing. A device provider subclasses it with a copy stream and events so
    that copies overlap compute (providers/cuda/streaming.py).

    Attributes:
        slots: the device buffers, uint8 ``[slot_bytes]`` each.
        copies, bytes_copied: pages copied and the bytes they moved (cumulative).
    """

    def __init__(self, provider: ProviderBase, slots: int, slot_bytes: int):
        self.provider = provider
        self.slots = [provider.allocate((slot_bytes,), np.uint8) for _ in range(slots)]
        self.copies = 0
        self.bytes_copied = 0

    def stage(self, array: np.ndarray) -> Any:
        """The host copy a weight is streamed from (pinned memory on a GPU), made once
        (:meth:`ProviderBase.stage`)."""
        return self.provider.stage(array)

    def view(self, slot: int, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """Bytes ``offset...`` of slot ``slot`` seen as a tensor of ``shape`` / ``dtype`` (what
        the kernel reads)."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        return self.slots[slot][offset:offset + n].view(dtype).reshape(shape)

    def begin(self) -> None:
        """A step starts."""

    def copy(self, slot: int, items: Sequence[tuple[Any, Any]]) -> None:
        """Copy a page: each staged weight ``host`` into its ``view`` of slot ``slot``."""
        for host, view in items:
            self.provider._write(view, host)
            self.bytes_copied += int(host.nbytes)
        self.copies += 1

    def ready(self, slot: int) -> None:
        """Make the kernels that follow wait for the copy into ``slot``."""

    def release(self, slot: int) -> None:
        """Every kernel that reads ``slot``'s current weight has been issued."""

    def end(self) -> None:
        """A step ends."""

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the ring."""
        return sum(int(s.nbytes) for s in self.slots)

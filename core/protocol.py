"""The execution-provider protocol: what a provider must offer the core.

A provider owns memory and kernels; the core owns the model, the decode loop, the KV-cache
geometry, the capture policy and the counters (docs/design.md "The provider protocol").
Providers are registered through the pluggy entry-point group ``lockstep.providers``
(see :mod:`core.hookspecs`) and proven with the parity kit (:mod:`core.testing`).

Tensors are whatever array type the provider uses (``numpy.ndarray`` on ``cpu_reference``,
``cupy.ndarray`` on ``cuda``); the core only moves them through the methods below (upload,
download, write, fill, copy_bytes) and reads ``.shape``, ``.dtype`` and ``.nbytes``; it never
indexes a provider tensor. :class:`core.provider.ProviderBase` implements the protocol over a
few private primitives: inheriting it is the short way to write a provider.

Optional members have documented defaults, so the core calls them without probing (no
``hasattr``): :class:`core.provider.ProviderBase` implements each, and the provider registry
gives a provider that does not inherit it the same defaults when it creates it
(:func:`core.provider.with_defaults`, :data:`core.provider.OPTIONAL_DEFAULTS`). They are
``prepare(node)`` (plan-time weight hooks, :mod:`core.executor.prepare`; default None),
``support_reason(node) -> str | None`` (why ``supports`` rejects a node; the parity kit puts it
in a skipped case's message; default None), ``download_async(tensor)`` (a handle whose
``wait()`` returns the tensor as it was when the work queued before the call had run; default a
synchronous download, so a session cannot queue a decode step before it reads the last one's
tokens), the measurements ``peak_bytes``, ``reset_peak``, ``workspace_bytes``,
``planned_workspace_bytes`` (default: the step's activations, :mod:`core.runtime.workspace`),
``device_bandwidth``, ``host_to_device_bandwidth``, ``device_used_bytes``,
``free_device_bytes`` (default None: cannot tell), ``node_timer`` (default None) and
``settings`` (default {}). ``reserve`` (VMM providers) and the capture trio are declared through
:class:`Capabilities`. ``device_sample`` (sampling on the device, :class:`SamplingTensors`)
is optional too: :class:`core.provider.ProviderBase` gives a host implementation, and a request
that samples on a provider without the member is refused (docs/providers.md).

Version 2 (this one) added ``write``, ``fill`` and ``copy_bytes`` to the required members.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import attrs
import numpy as np

#: The protocol version this core speaks. A provider declares the version it implements in
#: ``Capabilities.protocol_version``; the plugin manager refuses any other.
PROTOCOL_VERSION = 2

#: Device argmax result layout: int32 ``[B, 2]``, column 0 the token id, column 1 the error flag.
ARGMAX_TOKEN, ARGMAX_ERROR = 0, 1


@attrs.frozen
class Capabilities:
    """What a provider can do; the core reads it to choose code paths.

    Attributes:
        dtypes: activation dtypes the kernels accept, as numpy dtype names ("float32", ...).
        graph_capture: the provider implements ``begin_capture``/``end_capture``/``replay``.
        vmm: ``kv_commit`` maps physical pages under a fixed address range (pointers never move).
        weight_streaming: weights may live in host memory and be streamed per step.
        kv_layouts: KV layouts the attention kernels read ("head_major", "seq_major").
        page_bytes: granularity of ``kv_commit`` (the VMM page size; 2 MiB on NVIDIA GPUs).
        protocol_version: the :data:`PROTOCOL_VERSION` this provider implements.
    """

    dtypes: tuple[str, ...] = ("float32",)
    graph_capture: bool = False
    vmm: bool = False
    weight_streaming: bool = False
    kv_layouts: tuple[str, ...] = ("head_major", "seq_major")
    page_bytes: int = 4096
    protocol_version: int = PROTOCOL_VERSION


@attrs.frozen
class SamplingTensors:
    """The persistent per-row sampling buffers of one batch, handed to ``device_sample``.

    Written by the core when a request starts (never during a step), so a captured step
    replays unchanged. Layouts are in :mod:`core.generation.sampling` (``P_*``, ``O_*``).

    Attributes:
        params: float32 ``[B, 4]``: temperature, top_p, min_p, repetition_penalty.
        options: int32 ``[B, 4]``: flags (1 = sample, 2 = apply the penalty), top_k, seed low
            and high 32-bit words.
        history: uint8 ``[B, V]``: 1 where the token is in the row's history (prompt and every
            fed token); the core writes the prompt's, ``device_sample`` marks each fed token.
    """

    params: Any
    options: Any
    history: Any


@attrs.frozen
class NodeInfo:
    """A planned ONNX node as a kernel sees it.

    Attributes:
        name: node name from the graph (unique).
        op_type: ONNX op type, e.g. "GroupQueryAttention".
        domain: "" for the default domain, "com.microsoft" for contrib ops.
        attrs: attribute values decoded to Python (ints, floats, str, lists, numpy arrays).
        inputs: input value names ("" for an absent optional input).
        outputs: output value names ("" for an unused optional output).
        input_dtypes: numpy dtypes of the inputs where the graph declares them (None otherwise).
    """

    name: str
    op_type: str
    domain: str
    attrs: dict
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_dtypes: tuple[Any, ...] = ()


@attrs.frozen
class KVRequest:
    """One byte range of a KV arena that must be backed before a kernel writes it.

    Attributes:
        offset: first byte, relative to the start of the arena.
        nbytes: length in bytes.
    """

    offset: int
    nbytes: int


#: Buffer shapes kept per output slot of a node (see :meth:`KernelContext.output`).
KEEP_SHAPES = 3


class KernelContext:
    """Per-node state handed to every kernel call.

    The executor makes one context per node when it plans the graph. Kernels take persistent
    output buffers from :meth:`output` so that a captured decode step allocates nothing
    (docs/cases.md 10): the first call with a given shape allocates, later calls reuse the buffer,
    and while ``frozen`` is set (during capture) a new allocation raises ``RuntimeError``.

    Attributes:
        node: the :class:`NodeInfo` being run.
        provider: the provider that owns the kernel.
        kv_layout: "head_major" ([B, Nkv, S, H]) or "seq_major" ([B, S, Nkv, H]); attention
            kernels read persistent KV buffers in this layout.
        cache: free per-node storage for derived constants (e.g. dequantized weights).
        frozen: set by the capture policy; output/scratch allocation then raises.
        transient: set by the executor for a run whose activations die with it (a prefill,
            :meth:`core.executor.Plan.run`): the buffers this node allocates then are dropped by
            :meth:`release_transient` once the run no longer reads them, so a kernel must not keep
            a reference to its inputs or outputs past the call (an eager launch cache skips such
            runs).
        allocations: number of buffers this node allocated (a counter).
        evictions: number of buffers dropped to keep at most KEEP_SHAPES shapes per slot
            (never one a captured graph uses).
    """

    def __init__(self, node: NodeInfo, provider: ExecutionProvider, kv_layout: str):
        self.node = node
        self.provider = provider
        self.kv_layout = kv_layout
        self.cache: dict = {}
        self.frozen = False
        self.transient = False
        self.allocations = 0
        self.evictions = 0
        self._buffers: dict = {}
        self._last: dict = {}  # slot -> (shape, dtype, buffer) of the latest call
        self._pinned: set = set()  # keys of buffers a captured graph uses
        self._transient: list = []  # keys allocated while transient, not yet released
        self._transient_new = 0  # bytes of those allocated since take_transient_allocated()

    def output(self, slot: Any, shape: Sequence[int], dtype: Any) -> Any:
        """A persistent buffer for output ``slot`` (int index or a scratch name).

        Buffers are kept per (slot, shape, dtype): the last :data:`KEEP_SHAPES` shapes of each
        slot, plus every buffer handed out while frozen (a captured graph holds its pointer, so
        it is never dropped). Prefill shapes therefore never displace decode-step buffers.
        The common case, the same request as last time for this slot, is one dict lookup.
        A buffer allocated while :attr:`transient` is set is also noted for
        :meth:`release_transient` (one that existed before, a decode step's, is not).

        Raises:
            RuntimeError: a new allocation is needed while the context is frozen (capture).
        """
        last = self._last.get(slot)
        if last is not None and last[0] == shape and last[1] == dtype and not self.frozen:
            return last[2]
        shape = tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        key = (slot, shape, dtype.str)
        buf = self._buffers.pop(key, None)
        if buf is None:
            if self.frozen:
                raise RuntimeError(
                    f"node {self.node.name!r} ({self.node.op_type}) needs a new {dtype} buffer of "
                    f"shape {shape} for {slot!r} inside a captured region; capture requires every "
                    "buffer to exist before capture (docs/cases.md 10)")
            buf = self.provider.allocate(shape, dtype)
            self.allocations += 1
            if self.transient:
                self._transient.append(key)
                self._transient_new += int(buf.nbytes)
            same_slot = [k for k in self._buffers if k[0] == slot and k not in self._pinned]
            if len(same_slot) >= KEEP_SHAPES:
                del self._buffers[same_slot[0]]
                self.evictions += 1
        if self.frozen:
            self._pinned.add(key)
        self._buffers[key] = buf  # re-insert: most recently used last
        self._last[slot] = (shape, dtype, buf)
        return buf

    def release(self) -> int:
        """Drop every buffer no captured graph uses (a later call allocates again); returns the
        bytes dropped. For sweeps over shapes (``lockstep profile``), never during a step."""
        dropped = [k for k in self._buffers if k not in self._pinned]
        freed = sum(int(self._buffers[k].nbytes) for k in dropped)
        for k in dropped:
            del self._buffers[k]
        self._last.clear()
        return freed

    def take_transient_allocated(self) -> int:
        """Bytes allocated while :attr:`transient` since the last call (the executor's count of a
        transient run's live activations)."""
        new, self._transient_new = self._transient_new, 0
        return new

    def release_transient(self) -> int:
        """Drop the buffers allocated while :attr:`transient` was set since the last call (the
        memory goes back to the provider's allocator, which can hand it to a later node of the
        same run); returns the bytes dropped. Buffers that existed before, such as a decode
        step's buffer of the same shape that a one-token prompt reuses, stay: something outside
        the run (a captured graph, a decode state's output reference) may hold them. Called by
        the executor after the last reader of this node's outputs."""
        freed = 0
        for key in self._transient:
            if key in self._pinned:
                continue
            buf = self._buffers.pop(key, None)
            if buf is None:
                continue
            freed += int(buf.nbytes)
            last = self._last.get(key[0])
            if last is not None and last[2] is buf:
                del self._last[key[0]]
        self._transient.clear()
        self._transient_new = 0
        return freed

    def buffer_bytes(self) -> int:
        """Bytes held in this node's persistent buffers."""
        return sum(int(b.nbytes) for b in self._buffers.values())


#: A kernel: ``kernel(ctx, *inputs) -> tuple of outputs`` (absent optional inputs are None;
#: the tuple has one entry per declared node output, None for an unused optional output).
Kernel = Callable[..., tuple]


@runtime_checkable
class DeviceIoBinding(Protocol):
    """Persistent graph inputs and outputs on the provider's device.

    Made once per session by :meth:`ExecutionProvider.io_binding`; the decode loop binds the
    same buffers (input_ids, attention_mask, KV) on every step, so a captured step sees
    stable pointers.
    """

    def bind_input(self, name: str, tensor: Any) -> None:
        """Bind a device tensor to graph input ``name`` for every later :meth:`run`."""

    def bind_output(self, name: str, tensor: Any) -> None:
        """Make graph output ``name`` land in ``tensor`` (KV present outputs alias the past)."""

    def run(self) -> dict[str, Any]:
        """Run the whole graph once; returns graph outputs by name (device tensors)."""


@runtime_checkable
class ExecutionProvider(Protocol):
    """An execution provider: device memory, kernels and the few decode-loop primitives.

    Required members are listed in :data:`REQUIRED_MEMBERS`; the plugin manager checks them
    when the provider is created and names any that are missing.
    """

    name: str

    def capabilities(self) -> Capabilities:
        """Static description of what this provider can do."""

    def supports(self, node: NodeInfo) -> bool:
        """True when :meth:`kernel` can run ``node`` (domain, op_type, dtypes, attributes)."""

    def kernel(self, node: NodeInfo) -> Kernel:
        """The callable that runs ``node``. Called once per node when the graph is planned."""

    def allocate(self, shape: Sequence[int], dtype: Any, zero: bool = False) -> Any:
        """A device tensor of ``shape``/``dtype``, zero-filled when ``zero`` is set."""

    def upload(self, array: np.ndarray) -> Any:
        """Copy a host array to a new device tensor."""

    def download(self, tensor: Any) -> np.ndarray:
        """Copy a device tensor to a new host numpy array (synchronises)."""

    def io_binding(self, plan: Any) -> DeviceIoBinding:
        """Persistent IO binding over an executable plan (:class:`core.executor.Plan`)."""

    def device_argmax(self, logits: Any, positions: Any, result: Any) -> None:
        """Greedy selection on the device, row by row.

        Args:
            logits: ``[B, S, V]`` float tensor (fp16 or fp32; compared in fp32).
            positions: int32 device tensor ``[B]``: the sequence index read in each row
                (the last real prompt token after prefill, 0 during decode).
            result: int32 device tensor ``[B, 2]`` written in place: ``[token_id,
                capture_error]``. token_id is the index of the maximum, lowest index on ties
                (numpy.argmax semantics); capture_error is 1 when the row holds a NaN or an
                infinity (the token is then -1, never a silent 0), else 0 (docs/cases.md 11, 12).
        """

    def device_sample(self, logits: Any, positions: Any, counter: Any, fed: Any,
                      sampling: SamplingTensors, result: Any) -> None:
        """Optional: per-row sampling on the device (the algorithm of
        :mod:`core.generation.sampling`; :func:`~core.generation.sampling.sample_rows` is the
        reference).

        Args:
            logits: ``[B, S, V]`` float tensor, read at ``positions`` as in :meth:`device_argmax`.
            positions: int32 ``[B]``.
            counter: int32 ``[B]``: each row's sequence index of the token being chosen (the
                Philox counter word 1).
            fed: int64 ``[B, 1]`` tokens fed this step, marked in ``sampling.history`` before
                the penalty is applied; None after a prefill (the core wrote the history).
            sampling: the row options and history (:class:`SamplingTensors`).
            result: int32 ``[B, 2]`` written in place, as :meth:`device_argmax` does; a
                greedy row with penalty 1 gets exactly ``device_argmax``'s answer.
        """

    def decode_advance(self, result: Any, input_ids: Any, attention_mask: Any,
                       lengths: Any) -> None:
        """Feed the chosen tokens back on the device, for every row b:

        ``input_ids[b, 0] = result[b, 0]`` (pad id 0 when the row is flagged),
        ``attention_mask[b, lengths[b]] = 1``, ``lengths[b] += 1``.

        ``input_ids`` is int64 ``[B, 1]``, ``attention_mask`` int64 ``[B, capacity]``,
        ``lengths`` int32 ``[B]`` (tokens in each row's KV cache after this step).
        """

    def kv_commit(self, arena: Any, requests: Sequence[KVRequest]) -> int:
        """Make the byte ranges of a KV arena backed; returns bytes newly committed.

        On ``cpu_reference`` this only counts; on ``cuda`` with VMM it maps physical pages.
        """

    def write(self, tensor: Any, array: np.ndarray) -> None:
        """Copy a host array into an existing device tensor of the same shape, in place."""

    def fill(self, tensor: Any, value: float) -> None:
        """Set every element of a device tensor to ``value``."""

    def copy_bytes(self, dst: Any, src: Any, copies: Sequence[tuple[int, int, int]]) -> int:
        """Device-to-device copies ``(src_offset, dst_offset, nbytes)``; returns bytes copied."""

    def synchronize(self) -> None:
        """Wait for all queued device work."""

    # -- optional members: each has a default (core.provider.OPTIONAL_DEFAULTS, the same
    # answer as ProviderBase's method), given by the registry to a provider that lacks it
    def support_reason(self, node: NodeInfo) -> str | None:
        """Optional: why :meth:`supports` rejects ``node``, or None (default: None)."""

    def prepare(self, node: NodeInfo) -> Callable[..., dict | None] | None:
        """Optional: the plan-time weight hook of ``node``'s op (:mod:`core.ops`), or None
        (default: None)."""

    def prepared_forms(self, node: NodeInfo, inputs: Sequence[Any]) -> dict | None:
        """Optional: the shapes and dtypes the hook of :meth:`prepare` will give ``node``'s
        constant inputs, from their :class:`core.ops.Spec` (``prepared`` in :mod:`core.ops`),
        or None (default: None, the load is planned from the raw sizes)."""

    def download_async(self, tensor: Any) -> Any:
        """Optional: a handle whose ``wait()`` returns ``tensor`` as the work queued before the
        call left it (default: a synchronous download, :class:`core.provider.ReadyDownload`)."""

    def peak_bytes(self) -> int | None:
        """Optional: device bytes held at the high-water mark (default: None, cannot tell)."""

    def reset_peak(self) -> None:
        """Optional: start a new peak measurement (default: nothing)."""

    def workspace_bytes(self) -> int | None:
        """Optional: device bytes of the provider's shared kernel scratch (default: None)."""

    def planned_workspace_bytes(self, nodes: Sequence[NodeInfo], steps: Sequence[int],
                                shape_of: Callable[[str], Any], batch: int, capacity: int) -> int:
        """Optional: device bytes of the activations and scratch a decode step of ``batch``
        rows over ``capacity`` KV positions will allocate, from the step's value shapes
        (:mod:`core.runtime.workspace`; default: the activations, one buffer per output)."""

    def device_bandwidth(self) -> float | None:
        """Optional: measured device memory bandwidth in bytes/s (default: None)."""

    def host_to_device_bandwidth(self) -> float | None:
        """Optional: measured pinned host-to-device bandwidth in bytes/s (default: None)."""

    def device_used_bytes(self) -> int | None:
        """Optional: device bytes in use by the driver's count (default: None)."""

    def free_device_bytes(self) -> int | None:
        """Optional: device bytes free now (default: None, unbounded or unknown)."""

    def node_timer(self) -> Any:
        """Optional: a node timer for ``lockstep profile --kernels`` (default: None)."""

    def settings(self) -> dict[str, str]:
        """Optional: the switches set outside the code that change how the provider runs
        (default: {})."""

    def row_blocks(self, node: NodeInfo, shape_of: Callable[[str], tuple[int, ...] | None]) -> Any:
        """Optional: how ``node`` runs on a block of its output rows when its weights stream as
        row-block pages (:class:`core.runtime.rowblocks.RowSplit`), or None: it streams whole
        (default: None, no node splits)."""


#: Members every provider object must have (checked at load, named in the error).
REQUIRED_MEMBERS = (
    "name", "capabilities", "supports", "kernel", "allocate", "upload", "download", "write",
    "fill", "copy_bytes", "io_binding", "device_argmax", "decode_advance", "kv_commit", "synchronize",
)

#: Optional members of a provider that declares ``graph_capture``.
CAPTURE_MEMBERS = ("begin_capture", "end_capture", "replay")


def missing_members(provider: Any, capabilities: Capabilities | None = None) -> list[str]:
    """Names of required protocol members ``provider`` lacks (capture ones if it claims capture)."""
    names = list(REQUIRED_MEMBERS)
    if capabilities is not None and capabilities.graph_capture:
        names += CAPTURE_MEMBERS
    return [n for n in names if not hasattr(provider, n)]

"""Weights in a plan: which initializers stay host values, what storage a value lives in, the
record of a per-step weight read, and the placer interface.

Placement. With a placer (:class:`Placer`, given by the Runner under a weight budget), each
constant is handed to it once it is final, in execution order: an initializer when its last
per-step reader has been prepared, a prepared form right after its hook. The placer keeps it
on the device (uploading it if still on the host), or in pinned host memory (staged or mapped,
recorded in :attr:`Plan.staged_weights`); it also says whether a hook runs on device copies of
its node's weights or on the host arrays. So the device holds only what the placer keeps plus
one node's scratch, never the whole model (:mod:`core.runtime.placement`).

"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol

import numpy as np

from core.protocol import NodeInfo

if TYPE_CHECKING:
    from core.executor.plan import Plan

HOST_CONSTANT_MAX = 64
GATHER_OPS = ("Gather", "GatherBlockQuantized", "GatherColumns")


class Placer(Protocol):
    """Where each weight goes as a plan loads (module docstring;
    :class:`core.runtime.placement.BudgetPlacer`)."""

    def start(self, plan: Plan) -> None:
        """The graph is fused and folded; no weight is prepared yet."""

    def prepare_on_device(self, plan: Plan, node: NodeInfo) -> bool:
        """Whether ``node``'s prepare hook runs on device copies of its weights (else on the
        host arrays)."""

    def place(self, plan: Plan, name: str, value: Any, node: str, source: str) -> Any:
        """What constant ``name`` becomes now that it is final (first read by ``node``, made
        from initializer ``source``)."""


def storage(value: Any) -> Any:
    """The array that owns ``value``'s memory: ``value``'s ``.base`` chain followed while it
    holds arrays (numpy and CuPy views; a buffer object such as ``bytes`` ends it)."""
    root = value
    while True:
        base = getattr(root, "base", None)
        if base is None or not hasattr(base, "shape") or not hasattr(base, "nbytes"):
            return root
        root = base


def bytes_key(value: Any) -> tuple:
    """What identifies the bytes ``value`` shows, in order: its storage, its offset there, its
    size and, unless C-contiguous, its shape and strides (two C-contiguous views of one range
    show the same bytes in the same order, whatever their shapes)."""
    root = storage(value)

    def address(a: Any) -> int:
        ptr = getattr(getattr(a, "data", None), "ptr", None)  # CuPy
        if ptr is None:
            ptr = getattr(a, "__array_interface__", {}).get("data", (0,))[0]  # NumPy
        return int(ptr)

    flags = getattr(value, "flags", None)
    contiguous = bool(getattr(flags, "c_contiguous", True))
    key: tuple = (id(root), address(value) - address(root), int(getattr(value, "nbytes", 0)), contiguous)
    return key if contiguous else (*key, tuple(getattr(value, "shape", ())), tuple(getattr(value, "strides", ())))


class WeightRead(NamedTuple):
    """A constant read by a per-step node (:meth:`Plan.weight_reads`).

    Attributes:
        step: position in execution order (the node is ``plan.nodes[plan.steps[step]]``).
        node: name of the first per-step node that reads the constant.
        constant: key in :attr:`Plan.constants`.
        nbytes: bytes of the constant.
        gathered: True when every per-step reader gathers rows of it (a Gather,
            GatherBlockQuantized or GatherColumns table: a step reads B rows, not the whole
            tensor).
        aliases: other constants over the same storage (views of it), read by later nodes.
    """

    step: int
    node: str
    constant: str
    nbytes: int
    gathered: bool
    aliases: tuple[str, ...] = ()


def collect_reads(nodes: Any, steps: Any, key_of: Callable[[str], Any], nbytes_of: Callable[[str], int]
                  ) -> list[WeightRead]:
    """The constants the per-step nodes read, each storage once at its first reader
    (:class:`WeightRead`), the other names over it in ``aliases``; gathered only when every
    reader of every name gathers. ``key_of(name)``: the constant's storage key (None: not a
    constant); ``nbytes_of(name)``: its bytes."""
    reads: list[WeightRead] = []
    first: dict[Any, int] = {}  # storage key -> index in reads
    for pos, i in enumerate(steps):
        node = nodes[i]
        for j, x in enumerate(node.inputs):
            key = key_of(x) if x else None
            if key is None:
                continue
            gathered = node.op_type in GATHER_OPS and j != 1  # input 1 is the indices
            k = first.get(key)
            if k is None:
                first[key] = len(reads)
                reads.append(WeightRead(pos, node.name, x, nbytes_of(x), gathered))
                continue
            r = reads[k]
            if x != r.constant and x not in r.aliases:
                r = r._replace(aliases=(*r.aliases, x))
            reads[k] = r._replace(gathered=r.gathered and gathered)
    return reads


def unread_bytes(constants: dict[str, Any], read: set[str], nbytes_of: Callable[[str, Any], int]) -> int:
    """Bytes of the constants no per-step node reads (``read``: the names the nodes read), each
    storage once and none whose storage a read constant shares; ``nbytes_of(name, storage)``:
    the bytes one such constant takes where it lives."""
    read_roots = {id(storage(constants[x])) for x in read if x in constants}
    seen: set[int] = set()
    total = 0
    for name, value in constants.items():
        root = storage(value)
        if name in read or id(root) in read_roots or id(root) in seen:
            continue
        seen.add(id(root))
        total += nbytes_of(name, root)
    return total


def is_host_constant(array: np.ndarray) -> bool:
    """True for initializers kept on the host: signed integer or bool tensors (shapes, axes,
    indices) of at most HOST_CONSTANT_MAX elements. Unsigned ones are quantized data (uint8
    codes and zero points) that device kernels read, so they are uploaded whatever their size."""
    return array.dtype.kind in "ib" and array.size <= HOST_CONSTANT_MAX


"""Windowed (ring) KV geometry of sliding-window layers, as pure functions (no device, no state).

A GroupQueryAttention node with ``sliding_window_cache=1`` and ``local_window_size = W`` (what
the ONNX Runtime GenAI builder writes by default for Gemma 2/3, Mistral and SmolLM3's local
layers) reads a past buffer shorter than the sequence. Lockstep keeps that buffer as a ring
(docs/kv-geometry.md):

- the ring size is ``R = W + RING_SLACK``; a layer's buffer holds ``min(C, R)`` positions per
  row, C being the full layers' capacity (so a cache no longer than the ring never wraps and is
  laid out exactly as a full layer);
- absolute position p of a row lives at slot ``p mod capacity`` of that buffer (capacity = its
  position axis), in either layout; the slots of a row hold its last ``min(length, capacity)``
  positions;
- a decode step at position p reads positions ``(p - W, p]``, all resident because R >= W, and
  its write to slot ``p mod R`` drops position ``p - R``, which no later query reads.

Rewinding a row (a discarded run-ahead step, a finished row cut back to its own history) is
exact while the positions written past the new length overwrote only positions outside the
window of every later query: at most :func:`max_rewind` positions (``R - W + 1``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from core.runtime.kv import KVGeometry, KVLayoutError

#: Ring positions beyond the window: rewinds of up to RING_SLACK + 1 positions stay exact.
RING_SLACK = 16


def ring_size(window: int) -> int:
    """Positions of a ring for attention window ``window`` (W + :data:`RING_SLACK`)."""
    return window + RING_SLACK


def max_rewind(window: int) -> int:
    """The most positions a row of a ring layer with ``window`` may be cut back by, exactly:
    positions ``L .. L + k - 1`` written past the new length L overwrote positions
    ``L - R .. L + k - 1 - R``, and the next query (position L) reads from ``L - W + 1`` on."""
    return ring_size(window) - window + 1


def layer_windows(graph, config) -> tuple[int, ...]:
    """Per layer, the window W of its ring KV cache, or 0 for a full-length layer.

    A layer has a ring when a GroupQueryAttention node with ``sliding_window_cache=1`` and
    ``local_window_size > 0`` reads its past key (input 3, named by ``config.past_key``).

    Args:
        graph: the model's ``onnx.GraphProto``.
        config: a :class:`core.models.model.ModelConfig` (num_layers, past_key).

    Raises:
        KVLayoutError: a windowed node whose past key is not a layer's past input.
    """
    import onnx

    names = {config.past_key % i: i for i in range(config.num_layers)}
    windows = [0] * config.num_layers
    for node in graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        attrs_ = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        window = int(attrs_.get("local_window_size", -1))
        if not int(attrs_.get("sliding_window_cache", 0)) or window <= 0:
            continue
        past = node.input[3] if len(node.input) > 3 else ""
        if past not in names:
            raise KVLayoutError(f"GroupQueryAttention node {node.name!r} has sliding_window_cache=1 but reads "
                                f"past key {past!r}, not a layer's past input ({config.past_key})")
        windows[names[past]] = window
    return tuple(windows)


def layer_geometry(geo: KVGeometry, window: int) -> KVGeometry:
    """The geometry of a layer's buffer when the full layers have ``geo``: ``geo`` itself for a
    full layer (``window`` 0), else ``geo`` with ``min(geo.capacity, ring_size(window))``
    positions."""
    return geo if window <= 0 else attrs.evolve(geo, capacity=min(geo.capacity, ring_size(window)))


def resident(length: int, capacity: int) -> range:
    """The positions a ring of ``capacity`` slots holds for a row of ``length``: the last
    ``min(length, capacity)``."""
    return range(max(0, length - capacity), length)


def _runs(positions: range, src_cap: int, dst_cap: int) -> list[tuple[int, int, int]]:
    """Split ``positions`` into ``(src_slot, dst_slot, count)`` runs contiguous in both rings."""
    out = []
    p = positions.start
    while p < positions.stop:
        s, d = p % src_cap, p % dst_cap
        n = min(positions.stop - p, src_cap - s, dst_cap - d)
        out.append((s, d, n))
        p += n
    return out


def row_copies(src: KVGeometry, dst: KVGeometry, rows: Sequence[tuple[int, int, int]]
               ) -> list[tuple[int, int, int]]:
    """Copies ``(src_offset, dst_offset, nbytes)`` that move the resident positions of row ``s``
    of a ring buffer in ``src`` to row ``d`` of one in ``dst`` (slot ``p mod capacity`` in each),
    for each ``(s, d, length)`` in ``rows``: the last ``min(length, src.capacity,
    dst.capacity)`` positions. For buffers that never wrapped (length <= both capacities) this
    is :func:`core.runtime.kv.row_copies`. Used for a scratch prefill's rows and for growth.

    Raises:
        KVLayoutError: the geometries differ in layout, heads, head size or dtype, or a row is
            outside a batch.
    """
    if (src.layout, src.kv_heads, src.head_size, src.itemsize) != (dst.layout, dst.kv_heads, dst.head_size,
                                                                   dst.itemsize):
        raise KVLayoutError(f"cannot copy KV rows between {src} and {dst}")
    n, h, item = src.kv_heads, src.head_size, src.itemsize
    out = []
    for s, d, length in rows:
        if not (0 <= s < src.batch and 0 <= d < dst.batch and length >= 0):
            raise KVLayoutError(f"row copy {(s, d, length)} outside {src.shape} -> {dst.shape}")
        for s_slot, d_slot, count in _runs(resident(length, min(src.capacity, dst.capacity)),
                                           src.capacity, dst.capacity):
            if src.layout == "head_major":
                out += [(((s * n + g) * src.capacity + s_slot) * h * item,
                         ((d * n + g) * dst.capacity + d_slot) * h * item, count * h * item) for g in range(n)]
            else:
                out.append(((s * src.capacity + s_slot) * n * h * item, (d * dst.capacity + d_slot) * n * h * item,
                            count * n * h * item))
    return out

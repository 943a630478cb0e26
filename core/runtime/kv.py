"""KV-cache geometry as pure functions (no device, no state).

Layouts of one layer's K (or V) buffer with batch B, Nkv kv heads, capacity C, head size H:

- ``head_major``: ``[B, Nkv, C, H]``, the builder's BNSH (docs/ops.md 1.1, input 3);
- ``seq_major``:  ``[B, C, Nkv, H]``.

Row b holds ``length[b]`` live positions, always the prefix ``[0, length[b])`` (GQA right
padding, docs/ops.md 1.4). Policies: ``fixed`` (the full stride is reserved once; physical pages are
committed as rows grow, so pointers never move) and ``growing`` (a bucket reallocated to a larger
capacity: the live prefix is copied, the suffix zeroed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from core.errors import KVFullError, KVLayoutError  # noqa: F401 (re-exported)

LAYOUTS = ("head_major", "seq_major")
POLICIES = ("fixed", "growing")


@attrs.frozen
class KVGeometry:
    """Shape facts of one layer's K or V buffer.

    Attributes:
        layout: "head_major" or "seq_major".
        batch, kv_heads, capacity, head_size: B, Nkv, C, H.
        itemsize: bytes per element (2 for fp16, 4 for fp32).
    """

    layout: str
    batch: int
    kv_heads: int
    capacity: int
    head_size: int
    itemsize: int

    def __attrs_post_init__(self):
        if self.layout not in LAYOUTS:
            raise KVLayoutError(f"unknown KV layout {self.layout!r}; use one of {LAYOUTS}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The buffer shape in this layout."""
        b, n, c, h = self.batch, self.kv_heads, self.capacity, self.head_size
        return (b, n, c, h) if self.layout == "head_major" else (b, c, n, h)

    @property
    def nbytes(self) -> int:
        """Bytes of one buffer (B * Nkv * C * H * itemsize)."""
        return self.batch * self.kv_heads * self.capacity * self.head_size * self.itemsize

    def with_capacity(self, capacity: int) -> KVGeometry:
        """The same geometry with capacity ``capacity``."""
        return attrs.evolve(self, capacity=capacity)


def live_ranges(geo: KVGeometry, lengths: list[int]) -> list[tuple[int, int]]:
    """Byte ranges ``(offset, nbytes)`` holding live positions of every row, in address order.

    head_major: one range per (row, kv head): ``length[b] * H`` elements at
    ``((b * Nkv + g) * C) * H``. seq_major: one range per row: ``length[b] * Nkv * H`` elements at
    ``b * C * Nkv * H``.

    Raises:
        KVLayoutError: a length is negative or exceeds the capacity, or len(lengths) != batch.
    """
    _check_lengths(geo, lengths)
    h, n, c, item = geo.head_size, geo.kv_heads, geo.capacity, geo.itemsize
    out = []
    for b, length in enumerate(lengths):
        if length == 0:
            continue
        if geo.layout == "head_major":
            out += [(((b * n + g) * c) * h * item, length * h * item) for g in range(n)]
        else:
            out.append((b * c * n * h * item, length * n * h * item))
    return out


def commit_requests(geo: KVGeometry, old_lengths: list[int], new_lengths: list[int],
                    page: int) -> list[tuple[int, int]]:
    """Page-aligned byte ranges that must become backed when rows grow from old to new lengths.

    Returns merged ``(offset, nbytes)`` ranges, each a multiple of ``page`` bytes, covering every
    byte of the new live prefix not covered by the old one (already committed pages are skipped).
    """
    def pages(lengths):
        covered: set[int] = set()
        for off, size in live_ranges(geo, lengths):
            covered.update(range(off // page, (off + size + page - 1) // page))
        return covered

    need = sorted(pages(new_lengths) - pages(old_lengths))
    merged: list[tuple[int, int]] = []
    for p in need:
        if merged and merged[-1][0] + merged[-1][1] == p * page:
            merged[-1] = (merged[-1][0], merged[-1][1] + page)
        else:
            merged.append((p * page, page))
    return merged


def growth_copies(old: KVGeometry, new_capacity: int, lengths: list[int]
                  ) -> list[tuple[int, int, int]]:
    """Copies ``(src_offset, dst_offset, nbytes)`` that move every live prefix into a buffer of
    ``new_capacity``; bytes of the new buffer not written by a copy must be zeroed.

    head_major works at any batch (each (row, head) prefix moves to its new stride).
    seq_major: row b starts at ``b * C * Nkv * H``, so growing C relocates every row b > 0.

    Raises:
        KVLayoutError: seq_major at batch > 1 (refused by design: docs/design.md "KV cache"), or
            new_capacity smaller than a live length.
    """
    if old.layout == "seq_major" and old.batch > 1:
        raise KVLayoutError("a growing seq_major KV cache at batch > 1 would relocate every "
                            "sequence b > 0; use layout head_major or the fixed policy")
    _check_lengths(old.with_capacity(new_capacity), lengths)
    new = old.with_capacity(new_capacity)
    src, dst = live_ranges(old, lengths), live_ranges(new, lengths)
    return [(s_off, d_off, size) for (s_off, size), (d_off, _) in zip(src, dst)]


def row_copies(src: KVGeometry, dst: KVGeometry, rows: Sequence[tuple[int, int, int]]
               ) -> list[tuple[int, int, int]]:
    """Copies ``(src_offset, dst_offset, nbytes)`` that move the live prefix of row ``s`` of a
    buffer in geometry ``src`` to row ``d`` of one in ``dst``, for each ``(s, d, length)`` in
    ``rows`` (a scratch prefill's rows into the decode cache, core.runtime.prompts). The
    geometries may differ in batch and capacity, not in layout, heads, head size or dtype.

    Raises:
        KVLayoutError: the geometries differ otherwise, a row is outside a batch, or a length
            exceeds either capacity.
    """
    if (src.layout, src.kv_heads, src.head_size, src.itemsize) != (dst.layout, dst.kv_heads, dst.head_size,
                                                                   dst.itemsize):
        raise KVLayoutError(f"cannot copy KV rows between {src} and {dst}")
    n, h, item = src.kv_heads, src.head_size, src.itemsize
    out = []
    for s, d, length in rows:
        if not (0 <= s < src.batch and 0 <= d < dst.batch and 0 <= length <= min(src.capacity, dst.capacity)):
            raise KVLayoutError(f"row copy {(s, d, length)} outside {src.shape} -> {dst.shape}")
        if length == 0:
            continue
        if src.layout == "head_major":
            out += [((s * n + g) * src.capacity * h * item, (d * n + g) * dst.capacity * h * item, length * h * item)
                    for g in range(n)]
        else:
            out.append((s * src.capacity * n * h * item, d * dst.capacity * n * h * item, length * n * h * item))
    return out


def _check_lengths(geo: KVGeometry, lengths: list[int]) -> None:
    if len(lengths) != geo.batch:
        raise KVLayoutError(f"{len(lengths)} lengths for a batch of {geo.batch}")
    bad = [x for x in lengths if not 0 <= x <= geo.capacity]
    if bad:
        raise KVLayoutError(f"lengths {bad} outside [0, capacity={geo.capacity}]")


def cache_bytes(config, batch: int, capacity: int, itemsize: int) -> int:
    """Bytes of a KV cache of ``batch`` rows and ``capacity`` positions: K and V for every
    layer, [batch, kv heads, capacity, head size] each, ``itemsize`` bytes a value
    (``config``: a :class:`core.models.model.ModelConfig`)."""
    return 2 * config.num_layers * batch * config.num_kv_heads * capacity * config.head_size * itemsize


def round_capacity(needed: int, context_length: int, multiple: int = 64) -> int:
    """Capacity for ``needed`` tokens: rounded up to ``multiple``, at most the model context."""
    return min(context_length, -(-needed // multiple) * multiple)


class KVCache:
    """The KV cache of one batch: one K and one V buffer per layer, and the policy that sizes them.

    Owns the geometry, the capacity (the one place it is kept), page commits and growth:

    - ``fixed``: ``capacity`` positions per row, a hard limit.
    - ``growing`` without VMM: buffers of ``capacity`` positions, reallocated to a larger bucket
      (at least double, rounded to 16) when a step needs more: live prefixes copied with
      ``provider.copy_bytes``, suffix zero; the bytes copied are counted in ``kv_bytes_moved``.
    - ``growing`` with VMM (``capabilities().vmm``): the buffers reserve ``max_capacity``
      positions of address space once; growth only raises the logical capacity, pages are
      committed as rows reach them, pointers never move and nothing is copied.

    Args:
        provider: the execution provider (a :class:`core.provider.ProviderBase` or protocol object).
        layout: "head_major" ([B, Nkv, C, H]) or "seq_major" ([B, C, Nkv, H]).
        batch, kv_heads, head_size, layers: B, Nkv, H and the number of layers.
        dtype: the KV dtype (the model's io dtype).
        capacity: initial positions per row; max_capacity: the most a growing cache may reach.
        policy: "fixed" or "growing".
        counters: a :class:`core.counters.Counters` the cache keeps ``kv_bytes``,
            ``kv_committed_bytes``, ``growth_events`` and ``kv_bytes_moved`` in.
        reserve_bytes: called with the device bytes about to be allocated or committed (the
            Runner's elastic budget, :meth:`core.runtime.runner.Runner.reserve_kv`); returns
            None or the reason the weight plan changed, kept in ``replan_reasons``.
        windows: per layer, the attention window of a ring layer (sliding_window_cache=1) or 0
            for a full one (:func:`core.runtime.ring.layer_windows`; empty: every layer full).
            A ring layer's buffers hold ``min(capacity, window + RING_SLACK)`` positions
            (:func:`core.runtime.ring.layer_geometry`); ``layer_geometries`` has each layer's.

    Raises:
        KVLayoutError: an unknown layout or policy, or growing seq_major at batch > 1 (growth
            would relocate every row b > 0).
    """

    def __init__(self, provider, layout: str, batch: int, kv_heads: int, head_size: int, layers: int,
                 dtype, capacity: int, max_capacity: int, policy: str, counters, reserve_bytes=None,
                 windows: Sequence[int] = ()):
        if policy not in POLICIES:
            raise KVLayoutError(f"unknown KV policy {policy!r}; use one of {POLICIES}")
        if policy == "growing" and layout == "seq_major" and batch > 1:
            raise KVLayoutError("a growing seq_major KV cache at batch > 1 would relocate every "
                                "sequence b > 0; use kv_layout='head_major' or kv_policy='fixed'")
        self.provider, self.policy, self.layers_count, self.dtype = provider, policy, layers, dtype
        self.windows = tuple(int(w) for w in windows) or (0,) * layers
        if len(self.windows) != layers:
            raise KVLayoutError(f"{len(self.windows)} layer windows for {layers} layers")
        self.max_capacity = max_capacity
        self.vmm = bool(policy == "growing" and provider.capabilities().vmm)
        self.page = provider.capabilities().page_bytes
        self.counters = counters
        self._reserve_bytes = reserve_bytes or (lambda n: None)
        self.replan_reasons: list[str] = []
        self.device_bytes = 0  # allocated (plain buffers) or committed (VMM) bytes, all layers
        self._shape = (layout, batch, kv_heads, head_size, np.dtype(dtype).itemsize)
        self._allocate(capacity)

    @property
    def limit(self) -> int:
        """The most positions a row may ever hold in this cache (capacity if fixed)."""
        return self.capacity if self.policy == "fixed" else self.max_capacity

    @property
    def nbytes(self) -> int:
        """Bytes of every K and V buffer (reserved address space with VMM)."""
        return 2 * sum(g.nbytes for g in self.layer_geometries)

    @property
    def rewind_limit(self) -> int | None:
        """The most positions a row may be cut back by and stay exact (ring layers,
        :func:`core.runtime.ring.max_rewind`); None without ring layers."""
        from core.runtime import ring

        limits = [ring.max_rewind(w) for w in self.windows if w > 0]
        return min(limits) if limits else None

    def buffers(self) -> list:
        """Every K and V buffer, layer by layer (K0, V0, K1, V1, ...)."""
        return [t for pair in self.layers for t in pair]

    def _allocate(self, capacity: int) -> None:
        """The first buffers (the cache is built with them or not at all)."""
        self._switch(capacity, *self._build(capacity))

    def _build(self, capacity: int) -> tuple[KVGeometry, list, list]:
        """New buffers for ``capacity`` positions (the stride geometry, each layer's geometry, each
        layer's K and V buffers), charged to the runner's budget (the bytes
        beyond the current buffers', which they replace); on any failure (a budget refusal, an
        out-of-memory error, Ctrl-C) the charge is given back and nothing of the cache changed."""
        layout, batch, heads, head_size, itemsize = self._shape
        stride = self.max_capacity if self.vmm else capacity
        geometry = KVGeometry(layout, batch, heads, stride, head_size, itemsize)
        from core.runtime import ring

        geos = [ring.layer_geometry(geometry, w) for w in self.windows]
        nbytes = 2 * sum(g.nbytes for g in geos)
        charge = 0 if self.vmm else nbytes - self.device_bytes
        self._charge(charge)
        p = self.provider
        try:
            if self.vmm:
                layers = [(p.reserve(g.shape, self.dtype), p.reserve(g.shape, self.dtype)) for g in geos]
            else:
                layers = [(p.allocate(g.shape, self.dtype, zero=True), p.allocate(g.shape, self.dtype, zero=True))
                          for g in geos]
        except BaseException:
            self._charge(-charge)
            raise
        return geometry, geos, layers

    def _switch(self, capacity: int, geometry: KVGeometry, geos: list, layers: list) -> None:
        """Make built buffers the cache's (nothing here can fail): the old ones are released."""
        self.capacity, self.geometry, self.layer_geometries, self.layers = capacity, geometry, geos, layers
        if not self.vmm:
            self.device_bytes = self.nbytes  # charged by _build
        self._committed_len = 0  # positions of every row backed through kv_commit
        self.counters.kv_committed_bytes = 0  # a gauge of the current buffers
        self.counters.kv_bytes = self.nbytes

    def reserve_positions(self, needed: int, lengths: Sequence[int] | np.ndarray,
                          prepare: Callable[[KVGeometry], Any] | None = None) -> Any:
        """Make room for ``needed`` positions in every row and back them before a kernel writes.

        Growth is a transaction: the new buffers are allocated and filled (and ``prepare``
        run) while the old ones still serve; only then does the cache switch to them. When
        anything on the way fails, the cache is as before (its capacity, buffers, charge) and
        the error propagates.

        Args:
            needed: positions each row's buffer must hold (the longest row after the next write).
            lengths: each row's live length now (the prefix copied if the buffers move).
            prepare: called with the new geometry before the switch when the buffers move (the
                decode state builds its new mask there); its value is returned.

        Returns:
            None when the buffers stayed; else True, or what ``prepare`` returned (pointers
            changed: rebind, recapture).

        Raises:
            KVFullError: ``needed`` exceeds the limit (fixed capacity or max_capacity).
        """
        moved: Any = None
        if needed > self.capacity:
            if needed > self.limit:
                what = "capacity" if self.policy == "fixed" else "maximum capacity"
                raise KVFullError(f"KV cache full: a step needs {needed} positions, the {what} is {self.limit}")
            moved = self._grow(needed, lengths, prepare)
        self._commit(needed)
        return moved

    def _grow(self, needed: int, lengths: Sequence[int] | np.ndarray,
              prepare: Callable[[KVGeometry], Any] | None) -> Any:
        new_cap = round_capacity(max(needed, 2 * self.capacity), self.max_capacity, multiple=16)
        if self.vmm:  # the range is reserved: back the pages first, so a failed commit changes nothing
            self._commit(needed)
            self.counters.growth_events += 1
            self.capacity = new_cap
            return None
        from core.runtime import ring

        lens = [int(x) for x in lengths]
        full = growth_copies(self.geometry, new_cap, lens)
        geometry, geos, layers = self._build(new_cap)
        try:
            moved = 0
            for old_pair, new_pair, w, src_geo, dst_geo in zip(self.layers, layers, self.windows,
                                                               self.layer_geometries, geos):
                copies = ring.row_copies(src_geo, dst_geo, [(b, b, n) for b, n in enumerate(lens)]) if w else full
                for src, dst in zip(old_pair, new_pair):
                    moved += self.provider.copy_bytes(dst, src, copies)
            extra = prepare(geometry) if prepare is not None else True
        except BaseException:
            self._charge(self.device_bytes - 2 * sum(g.nbytes for g in geos))
            raise
        self._switch(new_cap, geometry, geos, layers)
        self.counters.growth_events += 1
        self.counters.kv_bytes_moved += moved
        return extra

    def commit_needed(self, upto: int) -> bool:
        """Whether backing positions ``[0, upto)`` would commit a new page (:meth:`reserve_positions`)."""
        return upto > self._committed_len

    def _commit(self, upto: int) -> None:
        """Back positions ``[0, upto)`` of every row, in whole pages past a high-water mark
        (a decode step costs one comparison unless a row enters a new page)."""
        if upto <= self._committed_len:
            return
        g = self.geometry
        per_position = g.head_size * g.itemsize * (g.kv_heads if g.layout == "seq_major" else 1)
        chunk = max(1, self.page // per_position)
        new = min(g.capacity, -(-upto // chunk) * chunk)
        from core.protocol import KVRequest

        # a ring layer is backed up to its own capacity: positions past it wrap into backed slots
        layer_reqs = [[KVRequest(o, n) for o, n in commit_requests(
            lg, [min(self._committed_len, lg.capacity)] * g.batch, [min(new, lg.capacity)] * g.batch,
            page=self.page)] for lg in self.layer_geometries]
        charge = 2 * sum(r.nbytes for reqs in layer_reqs for r in reqs) if self.vmm else 0
        if any(layer_reqs):
            self._charge(charge)
            self.device_bytes += charge
            try:
                done = sum(self.provider.kv_commit(t, reqs) for reqs, pair in zip(layer_reqs, self.layers)
                           if reqs for t in pair)
            except BaseException:  # a commit that failed part way is retried whole on the next step
                self._charge(-charge)
                self.device_bytes -= charge
                raise
            self.counters.kv_committed_bytes += done
        self._committed_len = new

    def _charge(self, delta: int) -> None:
        """Account ``delta`` bytes with the runner (its elastic budget may refuse an increase:
        then nothing is charged)."""
        reason = self._reserve_bytes(delta)
        if reason:
            self.replan_reasons.append(reason)

    def release(self) -> None:
        """Give every charged byte back to the runner (a cache that is dropped)."""
        self._charge(-self.device_bytes)
        self.device_bytes = 0

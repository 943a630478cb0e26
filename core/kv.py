"""KV-cache geometry as pure functions (no device, no state).

Layouts of one layer's K (or V) buffer with batch B, Nkv kv heads, capacity C, head size H:

- ``head_major``: ``[B, Nkv, C, H]``, the builder's BNSH (OPS.md 1.1, input 3);
- ``seq_major``:  ``[B, C, Nkv, H]``.

Row b holds ``length[b]`` live positions, always the prefix ``[0, length[b])`` (GQA right
padding, OPS.md 1.4). Policies: ``fixed`` (the full stride is reserved once; physical pages are
committed as rows grow, so pointers never move) and ``growing`` (a bucket reallocated to a larger
capacity: the live prefix is copied, the suffix zeroed).
"""

from __future__ import annotations

import attrs

LAYOUTS = ("head_major", "seq_major")
POLICIES = ("fixed", "growing")


class KVLayoutError(ValueError):
    """A layout/policy/batch combination that cannot work (named in the message)."""


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

    def with_capacity(self, capacity: int) -> "KVGeometry":
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
        covered = set()
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
        KVLayoutError: seq_major at batch > 1 (refused by design: DESIGN.md, Decode state), or
            new_capacity smaller than a live length.
    """
    if old.layout == "seq_major" and old.batch > 1:
        raise KVLayoutError("a growing seq_major KV cache at batch > 1 would relocate every "
                            "sequence b > 0; use layout head_major or the fixed policy")
    _check_lengths(old.with_capacity(new_capacity), lengths)
    new = old.with_capacity(new_capacity)
    src, dst = live_ranges(old, lengths), live_ranges(new, lengths)
    return [(s_off, d_off, size) for (s_off, size), (d_off, _) in zip(src, dst)]


def _check_lengths(geo: KVGeometry, lengths: list[int]) -> None:
    if len(lengths) != geo.batch:
        raise KVLayoutError(f"{len(lengths)} lengths for a batch of {geo.batch}")
    bad = [x for x in lengths if not 0 <= x <= geo.capacity]
    if bad:
        raise KVLayoutError(f"lengths {bad} outside [0, capacity={geo.capacity}]")


def round_capacity(needed: int, context_length: int, multiple: int = 64) -> int:
    """Capacity for ``needed`` tokens: rounded up to ``multiple``, at most the model context."""
    return min(context_length, -(-needed // multiple) * multiple)

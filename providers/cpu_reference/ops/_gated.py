"""Helpers of the gated-projection fusions (core.fusion.fuse_gated_matmul)."""

from __future__ import annotations

from typing import Any, Sequence

from core.opdefs import gate_view


class Projection:
    """The context one projection of a fused node runs on: the gate view of the fused node
    (``node``), a cache of its own (``cache``: the per-node caches of converted or dequantised
    weights keep both weights) and outputs in scratch slots of the fused node's context:
    ``output(slot, ...)`` is ``parent.output((name, slot), ...)``, so the projection writes into
    persistent buffers of the fused node (poisoned by the kit, frozen during capture, counted
    in its activation bytes) and a step allocates nothing once the shapes are known."""

    __slots__ = ("cache", "name", "node", "parent")

    def __init__(self, parent: Any, name: str):
        self.parent, self.name = parent, name
        self.node = gate_view(parent.node)
        self.cache: dict = {}

    def output(self, slot: Any, shape: Sequence[int], dtype: Any) -> Any:
        """The fused node's persistent buffer for scratch slot ``(name, slot)``."""
        return self.parent.output((self.name, slot), shape, dtype)


def projections(ctx) -> tuple[Projection, Projection]:
    """(gate context, up context) of a fused node's context (:class:`Projection`), made on the
    first call: each projection runs as its own op on a context of its own."""
    pair = ctx.cache.get("_projections")
    if pair is None:
        pair = ctx.cache["_projections"] = (Projection(ctx, "gate"), Projection(ctx, "up"))
    return pair

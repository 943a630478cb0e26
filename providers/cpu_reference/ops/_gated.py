"""Helpers of the gated-projection fusions (core.fusion.fuse_gated_matmul)."""

from __future__ import annotations

from types import SimpleNamespace

from core.opdefs import gate_view


def projections(ctx) -> tuple:
    """(gate context, up context) of a fused node's context, made on the first call: each
    projection runs as its own op on a context of its own (``node``, ``cache``), so the
    per-node caches of converted or dequantised weights keep both weights."""
    pair = ctx.cache.get("_projections")
    if pair is None:
        pair = ctx.cache["_projections"] = tuple(SimpleNamespace(node=gate_view(ctx.node), cache={})
                                                 for _ in range(2))
    return pair

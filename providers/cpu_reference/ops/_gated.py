"""Helper of the gated-projection fusions (core.fusion.fuse_gated_matmul): each projection
runs as its own op on a context of its own, so per-node caches (converted or dequantised
weights) are kept for both weights instead of replacing each other on every call."""

from __future__ import annotations


class _NodeView:
    """The node fields op modules read (name, attrs)."""

    __slots__ = ("name", "attrs")

    def __init__(self, name: str, attrs: dict):
        self.name, self.attrs = name, attrs


class _Projection:
    """A kernel context for one projection: ``node`` and ``cache``."""

    __slots__ = ("node", "cache")

    def __init__(self, name: str, attrs: dict):
        self.node = _NodeView(name, attrs)
        self.cache: dict = {}


def projections(ctx) -> tuple:
    """(gate context, up context) of a fused node's context, made on the first call."""
    pair = ctx.cache.get("_projections")
    if pair is None:
        attrs = dict(ctx.node.attrs)
        pair = ctx.cache["_projections"] = (_Projection(f"{ctx.node.name}/gate", attrs),
                                            _Projection(f"{ctx.node.name}/up", attrs))
    return pair

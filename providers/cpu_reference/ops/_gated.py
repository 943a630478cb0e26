"""Helpers of the gated-projection fusions (core.fusion.fuse_gated_matmul)."""

from __future__ import annotations

from types import SimpleNamespace


def gate_view(node) -> SimpleNamespace:
    """The gate projection of a fused MatMulNBits node as a MatMulNBits node: its attributes,
    inputs 0..3 and their dtypes."""
    return SimpleNamespace(name=node.name, attrs=node.attrs, inputs=tuple(node.inputs[:4]),
                           input_dtypes=tuple(node.input_dtypes[:4]))


def projections(ctx) -> tuple:
    """(gate context, up context) of a fused node's context, made on the first call: each
    projection runs as its own op on a context of its own (``node``, ``cache``), so the
    per-node caches of converted or dequantised weights keep both weights."""
    pair = ctx.cache.get("_projections")
    if pair is None:
        pair = ctx.cache["_projections"] = tuple(SimpleNamespace(node=gate_view(ctx.node), cache={})
                                                 for _ in range(2))
    return pair

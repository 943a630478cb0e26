"""Counters that explain where the bytes and microseconds of a session went."""

from __future__ import annotations

import attrs


@attrs.define
class Counters:
    """Per-session counters (reported in results, ``--json`` and ``lockstep profile``).

    Attributes:
        prefill_tokens: prompt tokens run (padding excluded).
        decode_steps: decode steps run (each advances every row by one token).
        prefill_s, decode_s: wall seconds in prefill and in decode steps (host clock, including
            the per-step read-back of the [B, 2] argmax result).
        captures, replays: graph captures made and replays run.
        fallbacks: reasons a decode step ran eagerly although capture was asked for.
        invalidations: captured graphs dropped (each with a reason in ``invalidation_reasons``).
        growth_events: KV reallocations (growing policy).
        kv_bytes_moved: bytes copied by KV growth (0 with a VMM arena).
        kv_bytes: bytes reserved for the KV cache (all layers, K and V).
        kv_committed_bytes: bytes of the current KV buffers backed through ``kv_commit`` (a
            gauge: growth that reallocates starts it again from the copied prefix).
        weight_bytes: bytes of weights resident on the provider.
    """

    prefill_tokens: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    captures: int = 0
    replays: int = 0
    fallbacks: list = attrs.Factory(list)
    invalidations: int = 0
    invalidation_reasons: list = attrs.Factory(list)
    growth_events: int = 0
    kv_bytes_moved: int = 0
    kv_bytes: int = 0
    kv_committed_bytes: int = 0
    weight_bytes: int = 0

    def to_dict(self) -> dict:
        """The counters as plain JSON-ready data."""
        return attrs.asdict(self)

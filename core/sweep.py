"""The default sweep of ``lockstep profile`` per provider, and how long a sweep will take.

A host provider (cpu_reference) runs a batch-1 SmolLM2-135M decode step in about 50 ms on two
cores and slows about linearly with the batch (batch 8: about 250 ms), so the GPU sweep up to
batch 256 would take hours there: it sweeps batches 1,2,4,8 for 16 measured steps. Any other
provider sweeps 1,2,4,...,256 for 64 steps. Before the sweep, :func:`estimate_s` turns one
timed batch-1 step into the sweep's expected seconds with :data:`GROWTH`.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Batch sizes swept when ``--batch-sweep`` is not given, per provider ("*": any other).
BATCHES = {"cpu_reference": (1, 2, 4, 8), "*": (1, 2, 4, 8, 16, 32, 64, 128, 256)}
#: Measured decode steps per batch when ``--tokens`` is not given.
TOKENS = {"cpu_reference": 16, "*": 64}
#: How a decode step's time grows with the batch B: t(B) = t(1) * (1 + GROWTH * (B - 1)).
#: cpu_reference is compute-bound (SmolLM2-135M fp32, 2 cores: batch 8 about 5x batch 1); a GPU
#: step is bound by reading the weights and barely grows over this range.
GROWTH = {"cpu_reference": 0.6, "*": 0.01}


def _of(table: dict, provider: str):
    return table.get(provider, table["*"])


def apply_defaults(args) -> None:
    """Fill ``args.batch_sweep`` and ``args.tokens`` (None when not given) for ``args.provider``."""
    if args.batch_sweep is None:
        args.batch_sweep = list(_of(BATCHES, args.provider))
    if args.tokens is None:
        args.tokens = _of(TOKENS, args.provider)


def planned_steps(batches: Sequence[int], lengths: Sequence[int], warmup: int, tokens: int) -> int:
    """Decode steps the sweep runs: warm-up and measured steps per batch and prompt length, and
    the batch-1 reference run when batch 1 is not swept."""
    per_length = len(batches) + (0 if 1 in batches else 1)
    return per_length * len(lengths) * (warmup + tokens)


def estimate_s(provider: str, batches: Sequence[int], lengths: Sequence[int], warmup: int, tokens: int,
               step_s: float, prefill_s: float) -> float:
    """Expected seconds of a sweep, from a batch-1 decode step of ``step_s`` seconds and a
    batch-1 prefill of ``prefill_s`` seconds at the first prompt length (prefills scale with
    rows x prompt tokens; steps by :data:`GROWTH`). A swept point runs two prefills (an untimed
    warm-up and the timed one, :mod:`core.profile`), the batch-1 reference run one."""
    growth = _of(GROWTH, provider)
    points = [(b, 2) for b in batches] + ([] if 1 in batches else [(1, 1)])
    total = 0.0
    for length in lengths:
        for b, prefills in points:
            total += (warmup + tokens) * step_s * (1 + growth * (b - 1))
            total += prefills * prefill_s * b * length / lengths[0]
    return total


def duration(seconds: float) -> str:
    """Seconds for a person: "40 s", "12 min", "3.5 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"

"""Weight residency under a device budget: which weights stay on the device, which stream.

The plan is static per (budget, model, provider): the Runner makes it once (and again when an
elastic device budget changes), every decode step of every batch follows it, so a captured
step copies exactly the same bytes on every replay.

Admission policy (what stays resident, and why):

1. Gathered tables (Gather / GatherBlockQuantized inputs: the embedding) are resident. A step
   reads B rows of them, so streaming one would move the whole table to use a few rows, and no
   kernel may read host memory directly.
2. Small tensors (below :data:`SMALL_BYTES`: norm weights, biases, int4 scales of small
   layers) are resident: a copy costs a few microseconds of issue and event overhead whatever
   its size, more than their bytes are worth.
3. Every other per-step weight is read exactly once per step, in full: all have the same reuse
   (one read per step), so the streamed bytes per step are the weight bytes minus the resident
   ones whatever is chosen. Weights are admitted in execution order (first read first) while
   they fit the budget left after (1), (2) and the staging ring. The head of the step is then
   resident, so the copy stream prefetches the first streamed weights while the resident
   layers compute, and the tail streams.

The staging ring is ``slots`` device buffers of ``slot_bytes`` each (the largest streamed
tensor). Streamed weight j goes to slot ``j % slots``; copy j waits for the last reader of
weight ``j - slots``. The default ring holds one layer's streamed tensors plus one (at least
2 slots), so copies run at least one layer ahead, capped so staging takes at most a quarter of
the budget.

Counters per step (:class:`ResidencyPlan` properties): ``weight_bytes_streamed_per_step``,
``page_ins_per_step`` (copies), ``evictions_per_step`` (copies into a slot that held another
weight: every copy once the ring is warm), ``hit_rate`` (resident reads / weight reads per
step, by tensor) and ``byte_hit_rate`` (by bytes).
"""

from __future__ import annotations

import re
from typing import Sequence

import attrs

#: Tensors below this many bytes are always resident (policy rule 2).
SMALL_BYTES = 256 * 1024
#: Staging may take at most this fraction of the weight budget when the slot count is automatic.
STAGING_SHARE = 0.25
_LAYER = re.compile(r"layers[./_](\d+)")


class BudgetError(ValueError):
    """A weight budget that cannot work (too small for the always-resident weights plus the
    staging ring, or malformed); the message gives the bytes needed."""


@attrs.frozen
class Weight:
    """A constant one decode step reads: name, bytes, whether it is gathered, its layer (or -1)."""

    name: str
    nbytes: int
    gathered: bool
    layer: int


@attrs.frozen
class ResidencyPlan:
    """Which weights are resident and which stream, in execution order.

    Attributes:
        budget: the weight budget in bytes (None: everything resident).
        weights: every per-step weight, in execution order of its first read.
        streamed: names of the streamed weights, in execution order.
        slots, slot_bytes: the staging ring (0 slots when nothing streams).
    """

    budget: int | None
    weights: tuple[Weight, ...]
    streamed: tuple[str, ...] = ()
    slots: int = 0
    slot_bytes: int = 0

    @property
    def streams(self) -> bool:
        """True when some weight streams."""
        return bool(self.streamed)

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the staging ring."""
        return self.slots * self.slot_bytes

    @property
    def weight_bytes_resident(self) -> int:
        """Bytes of per-step weights kept on the device (the staging ring not included)."""
        streamed = set(self.streamed)
        return sum(w.nbytes for w in self.weights if w.name not in streamed)

    @property
    def weight_bytes_streamed_per_step(self) -> int:
        """Host-to-device bytes one step (prefill or decode) copies."""
        streamed = set(self.streamed)
        return sum(w.nbytes for w in self.weights if w.name in streamed)

    @property
    def page_ins_per_step(self) -> int:
        """Weight copies into staging slots per step."""
        return len(self.streamed)

    @property
    def evictions_per_step(self) -> int:
        """Copies per step that overwrite another weight in a slot: every copy once the ring
        has been filled (from the second step on), the steady state this reports."""
        return len(self.streamed)

    @property
    def hit_rate(self) -> float:
        """Fraction of the per-step weight reads (by tensor) served by resident weights."""
        return 1.0 - len(self.streamed) / len(self.weights) if self.weights else 1.0

    @property
    def byte_hit_rate(self) -> float:
        """Fraction of the per-step weight bytes read that were resident."""
        total = sum(w.nbytes for w in self.weights)
        return 1.0 - self.weight_bytes_streamed_per_step / total if total else 1.0

    def slot_of(self) -> dict[str, int]:
        """Streamed weight name -> its staging slot."""
        return {name: j % self.slots for j, name in enumerate(self.streamed)}

    def summary(self) -> dict:
        """The residency counters of one step, by their reported names."""
        return {
            "weight_budget": self.budget,
            "weight_bytes_resident": self.weight_bytes_resident,
            "weight_bytes_streamed_per_step": self.weight_bytes_streamed_per_step,
            "staging_bytes": self.staging_bytes,
            "staging_slots": self.slots,
            "hit_rate": self.hit_rate,
            "byte_hit_rate": self.byte_hit_rate,
        }


def weights_of(reads: Sequence) -> tuple[Weight, ...]:
    """:class:`Weight` per constant of ``plan.weight_reads()`` (execution order), with the
    layer index parsed from the reading node's name (builder names: ``/model/layers.3/...``)."""
    out = []
    for r in reads:
        m = _LAYER.search(r.node)
        out.append(Weight(r.constant, int(r.nbytes), bool(r.gathered), int(m.group(1)) if m else -1))
    return tuple(out)


def parse_budget(value, total: int) -> int | None:
    """A budget in bytes from ``value``: None (everything resident), an int of bytes, a float
    fraction in (0, 1] of ``total``, or a string "2GiB", "512MB", "40%", "0.4".

    Raises:
        BudgetError: anything else, or a non-positive budget.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9,
                 "tb": 1e12, "b": 1}
        try:
            if text.endswith("%"):
                value = float(text[:-1]) / 100
            else:
                unit = next((u for u in units if text.lower().endswith(u)), None)
                value = int(float(text[: -len(unit)]) * units[unit]) if unit else (
                    float(text) if "." in text else int(text))
        except ValueError:
            raise BudgetError(f"cannot read the budget {value!r}; use bytes, a unit (2GiB, 512MB) or a "
                              "fraction (40%, 0.4)") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BudgetError(f"a budget is bytes (int) or a fraction (float), got {value!r}")
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise BudgetError(f"a fractional budget must be in (0, 1], got {value}")
        return int(value * total)
    if value <= 0:
        raise BudgetError(f"a budget must be positive, got {value}")
    return int(value)


def plan_residency(weights: Sequence[Weight], budget: int | None, slots: int | None = None) -> ResidencyPlan:
    """The residency plan for ``budget`` bytes of device weight memory (staging included).

    Args:
        weights: per-step weights in execution order (:func:`weights_of`).
        budget: bytes, or None for everything resident.
        slots: staging slots (>= 2), or None for the default (module docstring).

    Raises:
        BudgetError: the budget cannot hold the always-resident weights plus a staging ring,
            or ``slots`` < 2.
    """
    weights = tuple(weights)
    total = sum(w.nbytes for w in weights)
    if budget is None or budget >= total:
        return ResidencyPlan(budget, weights)
    if slots is not None and slots < 2:
        raise BudgetError(f"the staging ring needs at least 2 slots, got {slots}")
    pinned = [w for w in weights if w.gathered or w.nbytes < SMALL_BYTES]
    candidates = [w for w in weights if not (w.gathered or w.nbytes < SMALL_BYTES)]
    fixed = sum(w.nbytes for w in pinned)
    if not candidates:
        raise BudgetError(f"a budget of {budget:,} bytes is below the {fixed:,} bytes of weights that "
                          "must stay resident (gathered tables and small tensors)")
    slot_bytes = max(w.nbytes for w in candidates)
    streamed: list[Weight] = []
    for _ in range(2):  # the ring size depends on what streams; the second pass uses the real one
        n_slots = slots or _default_slots(streamed or candidates, slot_bytes, budget)
        room = budget - fixed - n_slots * slot_bytes
        if room < 0:
            raise BudgetError(
                f"a weight budget of {budget:,} bytes cannot hold the {fixed:,} bytes that stay resident "
                f"plus a staging ring of {n_slots} x {slot_bytes:,} bytes; the smallest working budget "
                f"is {fixed + 2 * slot_bytes:,} bytes")
        streamed = []
        for w in candidates:
            if w.nbytes <= room:
                room -= w.nbytes
            else:
                streamed.append(w)
        new_slot = max((w.nbytes for w in streamed), default=0)
        if new_slot == slot_bytes or not streamed:
            break
        slot_bytes = new_slot
    if not streamed:
        return ResidencyPlan(budget, weights)
    n_slots = min(slots or _default_slots(streamed, slot_bytes, budget), len(streamed))
    return ResidencyPlan(budget, weights, tuple(w.name for w in streamed), max(n_slots, 1), slot_bytes)


def _default_slots(streamed: Sequence[Weight], slot_bytes: int, budget: int) -> int:
    per_layer: dict[int, int] = {}
    for w in streamed:
        per_layer[w.layer] = per_layer.get(w.layer, 0) + 1
    want = max(per_layer.values(), default=1) + 1
    cap = max(2, int(budget * STAGING_SHARE) // max(slot_bytes, 1))
    return max(2, min(want, cap))

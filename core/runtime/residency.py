"""Weight residency under a device budget: which weights stay on the device, which stream.

The plan is static per (budget, model, provider): the Runner makes it once (and again when an
elastic device budget changes), every decode step of every batch follows it, so a captured
step copies exactly the same bytes on every replay.

Admission policy (what stays resident, and why):

1. Gathered tables (Gather / GatherBlockQuantized / GatherColumns inputs: the embedding) are
   not streamed: a step reads B rows of them, so streaming one would move the whole table to
   use a few rows. When the weights do not all fit and the provider can map host memory, a
   table only gathers read (one reader, no views of it) is *mapped*: it lives once in pinned
   host memory and the gather kernel reads its B rows from there (a few KB per step over the
   bus; bulk weight reads never do this), so it takes no device memory. Otherwise it is
   resident. So are weights several nodes read
   every step (the rotary cos/sin caches, read by every layer; the packed tied embedding,
   read by the lookup and the lm_head): their reuse is highest, and a page read across the
   whole step would hold its slot for the whole step. So is a weight other constants are
   views of (the int4 tied embedding's codes): streaming it would leave the views' device
   memory behind.
2. Small tensors (below :data:`SMALL_BYTES`: norm weights, biases, int4 scales of small
   layers) are resident: a copy costs a few microseconds of issue and event overhead whatever
   its size, more than their bytes are worth.
3. Every other per-step weight is read exactly once per step, in full: all have the same reuse
   (one read per step), so the streamed bytes per step are the weight bytes minus the resident
   ones, and what matters is how much room the staging ring leaves. Pages are admitted in
   execution order (first read first) while they fit the budget left after (1), (2) and the
   ring; the head of the step is then resident, so the copy stream prefetches the first
   streamed pages while the resident layers compute. The largest page sets the slot size, so
   the planner also tries admitting the largest page first (the lm_head: a slot of its size
   would be several MLP pages) and keeps whichever of the two streams fewer bytes.

Weights stream in pages: a page is the streamed weights one node reads (a fused MLP node reads
four int4 tensors: gate and up codes and scales), copied together into one staging slot, or a
row block of a node the provider can cut (:mod:`core.runtime.rowblocks`: its output rows
``a:b`` and those rows of its weights), so the page size, not the lm_head, sets the slot. The
staging ring is ``slots`` device buffers of ``slot_bytes`` each (the largest page). Page j goes
to slot ``j % slots``; its copy waits for the last reader of page ``j - slots``. The default
ring holds one layer's streamed pages plus one (at least 2 slots), so copies run at least one
layer ahead, capped so staging takes at most a quarter of the budget. Admission works on nodes:
a node's weights (all its row blocks) are resident together or stream together.

Counters per step (:class:`ResidencyPlan` properties): ``weight_bytes_streamed_per_step``,
``page_ins_per_step`` (pages copied; once the ring is warm each copy also evicts the page the
slot held, counted in ``Counters.evictions``), ``hit_rate`` (resident reads / weight reads per
step, by tensor) and ``byte_hit_rate`` (by bytes).
"""

from __future__ import annotations

import os
import re
from typing import Sequence

import attrs

from core.errors import BudgetError  # noqa: F401 (re-exported)
from core.runtime import rowblocks

#: Tensors below this many bytes are always resident (policy rule 2).
SMALL_BYTES = 256 * 1024
#: Staging may take at most this fraction of the weight budget when the slot count is automatic.
STAGING_SHARE = 0.25
_LAYER = re.compile(r"layers[./_](\d+)")
#: Byte alignment of a tensor inside a staging slot.
ALIGN = 256


@attrs.frozen
class Weight:
    """A constant one decode step reads: name, bytes, whether it is gathered, its layer (or -1),
    its page (the name of its first reading node), the per-step nodes that read it and the
    other constants that are views of it (``aliases``)."""

    name: str
    nbytes: int
    gathered: bool
    layer: int
    page: str = ""
    readers: int = 1
    aliases: tuple[str, ...] = ()
    #: a row block (core.runtime.rowblocks): the whole constant, its rows of N and its node
    source: str = ""
    rows: tuple[int, int] | None = None
    node: str = ""

    @property
    def tensor(self) -> str:
        """The plan constant this weight is (a row block: the whole constant it is cut from)."""
        return self.source or self.name


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@attrs.frozen
class ResidencyPlan:
    """Which weights are resident and which stream, in execution order.

    Attributes:
        budget: the weight budget in bytes (None: everything resident).
        weights: every per-step weight, in execution order of its first read.
        pages: the streamed pages in execution order, each the names of its weights.
        slots, slot_bytes: the staging ring (0 slots when nothing streams).
        mapped: gathered tables read from pinned host memory (policy rule 1): neither resident
            nor streamed.
        page_bytes: the page size large nodes were cut to (row blocks, :mod:`core.runtime.rowblocks`);
            0 when no node can be cut.
    """

    budget: int | None
    weights: tuple[Weight, ...]
    pages: tuple[tuple[str, ...], ...] = ()
    slots: int = 0
    slot_bytes: int = 0
    mapped: tuple[str, ...] = ()
    page_bytes: int = 0

    @property
    def streamed_tensors(self) -> tuple[str, ...]:
        """The plan constants that stream (a row-blocked weight once), in execution order."""
        tensor = {w.name: w.tensor for w in self.weights}
        return tuple(dict.fromkeys(tensor[name] for name in self.streamed))

    @property
    def row_block_pages(self) -> int:
        """Pages per step that are row blocks of a node (a part of its output rows)."""
        rows = {w.name for w in self.weights if w.rows is not None}
        return sum(1 for page in self.pages if page[0] in rows)

    @property
    def streamed(self) -> tuple[str, ...]:
        """Names of the streamed weights, in execution order."""
        return tuple(name for page in self.pages for name in page)

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
        away = set(self.streamed) | set(self.mapped)
        return sum(w.nbytes for w in self.weights if w.name not in away)

    @property
    def weight_bytes_mapped(self) -> int:
        """Bytes of the gathered tables read from pinned host memory (never copied whole)."""
        mapped = set(self.mapped)
        return sum(w.nbytes for w in self.weights if w.name in mapped)

    @property
    def weight_bytes_streamed_per_step(self) -> int:
        """Host-to-device bytes one step (prefill or decode) copies."""
        streamed = set(self.streamed)
        return sum(w.nbytes for w in self.weights if w.name in streamed)

    @property
    def page_ins_per_step(self) -> int:
        """Pages copied into staging slots per step."""
        return len(self.pages)

    @property
    def hit_rate(self) -> float:
        """Fraction of the per-step weight reads (by tensor) served by resident weights (a
        mapped table's few rows count as a hit: nothing is copied for them)."""
        return 1.0 - len(self.streamed) / len(self.weights) if self.weights else 1.0

    @property
    def byte_hit_rate(self) -> float:
        """Fraction of the per-step weight bytes read that were resident."""
        total = sum(w.nbytes for w in self.weights if w.name not in set(self.mapped))
        return 1.0 - self.weight_bytes_streamed_per_step / total if total else 1.0

    def placement(self) -> dict[str, tuple[int, int]]:
        """Streamed weight name -> (staging slot, byte offset in the slot)."""
        sizes = {w.name: w.nbytes for w in self.weights}
        out = {}
        for j, page in enumerate(self.pages):
            offset = 0
            for name in page:
                out[name] = (j % self.slots, offset)
                offset += _aligned(sizes[name])
        return out

    def summary(self) -> dict:
        """The residency counters of one step, by their reported names."""
        return {
            "weight_budget": self.budget,
            "weight_bytes_resident": self.weight_bytes_resident,
            "weight_bytes_streamed_per_step": self.weight_bytes_streamed_per_step,
            "weight_bytes_mapped": self.weight_bytes_mapped,
            "staging_bytes": self.staging_bytes,
            "staging_slots": self.slots,
            "page_bytes": self.page_bytes,
            "row_block_pages_per_step": self.row_block_pages,
            "hit_rate": self.hit_rate,
            "byte_hit_rate": self.byte_hit_rate,
        }


def weights_of(plan) -> tuple[Weight, ...]:
    """:class:`Weight` per constant of ``plan.weight_reads()`` (execution order): the layer
    index parsed from the first reader's name (builder names: ``/model/layers.3/...``), the
    page (that reader) and the number of per-step nodes that read it."""
    readers: dict[str, int] = {}
    for i in plan.steps:
        for x in set(plan.nodes[i].inputs):
            readers[x] = readers.get(x, 0) + 1
    out = []
    for r in plan.weight_reads():
        m = _LAYER.search(r.node)
        count = sum(readers.get(name, 0) for name in (r.constant, *r.aliases))
        out.append(Weight(r.constant, int(r.nbytes), bool(r.gathered), int(m.group(1)) if m else -1, r.node,
                          max(count, 1), tuple(r.aliases)))
    return tuple(out)


def unread_weight(nbytes: int) -> Weight:
    """The constants no step reads (``nbytes`` of them), as one always-resident weight: the
    Runner's plan and the plan made before loading both count them so."""
    return Weight("(constants no step reads)", nbytes, True, -1)


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (bytes), else free physical pages; None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def parse_budget(value, total: int, fractions: bool = True) -> int | None:
    """A budget in bytes from ``value``: None (everything resident), an int of bytes, a float
    fraction in (0, 1] of ``total``, or a string "2GiB", "512MB", "40%", "0.4"; without
    ``fractions`` (a device budget) only bytes and sizes.

    Raises:
        BudgetError: anything else, or a non-positive budget.
    """
    if value is None:
        return None
    given = value
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
            forms = ("bytes, a unit (2GiB, 512MB) or a fraction (40%, 0.4)" if fractions
                     else "bytes or a size (4GiB, 512MB)")
            raise BudgetError(f"cannot read the budget {given!r}; use {forms}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BudgetError(f"a budget is bytes (int) or a fraction (float), got {given!r}")
    if isinstance(value, float):
        if not fractions:
            raise BudgetError("a device budget takes bytes (4294967296) or a size (4GiB), not a fraction: "
                              f"got {given!r}")
        if not 0 < value <= 1:
            raise BudgetError(f"a fractional budget must be in (0, 1] (up to 100%), got {given!r}")
        return int(value * total)
    if value <= 0:
        raise BudgetError(f"a budget must be positive, got {value}")
    return int(value)


def plan_residency(weights: Sequence[Weight], budget: int | None, slots: int | None = None,
                   mappable: bool = False, splits: dict | None = None, page_bytes: int | None = None
                   ) -> ResidencyPlan:
    """The residency plan for ``budget`` bytes of device weight memory (staging included).

    Args:
        weights: per-step weights in execution order (:func:`weights_of`), plus any constant
            that is resident whatever the plan (``gathered=True``).
        budget: bytes, or None for everything resident.
        slots: staging slots (>= 2), or None for the default (module docstring).
        mappable: the provider can read gathered tables from pinned host memory (rule 1).
        splits: the nodes that can run in row blocks (:func:`core.runtime.rowblocks.node_splits`);
            their weights above the page size stream as pages of ``page_bytes`` (None: the
            default, :func:`core.runtime.rowblocks.default_page_bytes`).

    Raises:
        BudgetError: the budget cannot hold the always-resident weights plus a staging ring
            (the message gives the smallest budget that works), or ``slots`` < 2.
    """
    weights, page = _split(weights, splits, page_bytes)
    try:
        return attrs.evolve(_plan(weights, budget, slots, mappable), page_bytes=page)
    except BudgetError as exc:
        if budget is None or "at least 2 slots" in str(exc):
            raise
        smallest = _smallest(weights, slots, mappable)
        raise BudgetError(f"{exc}; the smallest working budget is {_bytes(smallest)}") from None


def _split(weights: Sequence[Weight], splits: dict | None, page_bytes: int | None) -> tuple[tuple[Weight, ...], int]:
    if not splits:
        return tuple(weights), 0
    return rowblocks.split_weights(weights, splits, page_bytes, _pinned)


def smallest_budget(weights: Sequence[Weight], slots: int | None = None, mappable: bool = False,
                    splits: dict | None = None, page_bytes: int | None = None) -> int:
    """The smallest weight budget :func:`plan_residency` finds a plan for (one byte less is
    refused with this number); ``splits``, ``page_bytes``: as there."""
    return _smallest(_split(weights, splits, page_bytes)[0], slots, mappable)


def _plan(weights: Sequence[Weight], budget: int | None, slots: int | None = None,
          mappable: bool = False) -> ResidencyPlan:
    """:func:`plan_residency` without the smallest working budget in its error."""
    weights = tuple(weights)
    total = sum(w.nbytes for w in weights)
    if budget is None or budget >= total:
        return ResidencyPlan(budget, weights)
    if slots is not None and slots < 2:
        raise BudgetError(f"the staging ring needs at least 2 slots, got {slots}")
    mapped = tuple(w.name for w in weights if mappable and _mappable(w))
    fixed = sum(w.nbytes for w in weights if _pinned(w) and w.name not in mapped)
    pages: dict[str, list[Weight]] = {}
    for w in weights:
        if not _pinned(w):
            pages.setdefault(w.page or w.name, []).append(w)
    if not pages and fixed <= budget:
        return ResidencyPlan(budget, weights, mapped=mapped)
    if not pages:
        raise BudgetError(f"a budget of {_bytes(budget)} is below the {_bytes(fixed)} of weights that "
                          "must stay resident (gathered tables and small tensors)")
    candidates = list(pages.values())
    units: dict[str, list] = {}  # a node's row blocks are admitted together: resident or all streamed
    for key, page in pages.items():
        units.setdefault(page[0].node or key, []).append(page)
    groups = list(units.values())
    best = None
    # two admission orders: execution order, and the largest node first (it sets the slot size:
    # keeping the lm_head resident shrinks every slot); the one streaming fewer bytes wins
    largest = max(groups, key=lambda group: sum(w.nbytes for page in group for w in page))
    error: BudgetError | None = None
    for order, keep in ((groups, None), ([largest] + [g for g in groups if g is not largest], largest)):
        try:
            plan = attrs.evolve(_admit(weights, order, candidates, budget, fixed, slots, keep), mapped=mapped)
        except BudgetError as exc:
            error = error or exc
            continue
        if best is None or plan.weight_bytes_streamed_per_step < best.weight_bytes_streamed_per_step:
            best = plan
    if best is None:
        assert error is not None  # both orders failed, so each raised
        raise error
    return best


def _admit(weights, order, candidates, budget: int, fixed: int, slots: int | None, keep=None) -> ResidencyPlan:
    """Admit nodes (``order``: lists of pages, a node's row blocks together) while they fit; the
    rest stream (in execution order). ``keep``: a node assumed resident when sizing the first
    ring (it must then fit)."""
    def page_bytes(page):
        return sum(w.nbytes for w in page)

    def slot_size(pages):
        return max((sum(_aligned(w.nbytes) for w in page) for page in pages), default=0)

    kept = {id(p) for p in keep or ()}
    slot_bytes = slot_size([p for p in candidates if id(p) not in kept])
    streamed: list = []
    for _ in range(3):  # the ring size depends on what streams; later passes use the real one
        n_slots = slots or _default_slots(streamed or candidates, slot_bytes, budget)
        room = budget - fixed - n_slots * slot_bytes
        if room < 0:
            raise BudgetError(
                f"a weight budget of {_bytes(budget)} cannot hold the {_bytes(fixed)} that stay resident "
                f"plus a staging ring of {n_slots} x {_bytes(slot_bytes)}")
        resident: set[int] = set()
        for group in order:
            size = sum(page_bytes(page) for page in group)
            if size <= room:
                room -= size
                resident.update(id(page) for page in group)
        streamed = [page for page in candidates if id(page) not in resident]
        if not streamed or slot_size(streamed) == slot_bytes:
            break
        slot_bytes = slot_size(streamed)
    if not streamed:
        return ResidencyPlan(budget, weights)
    n_slots = min(slots or _default_slots(streamed, slot_bytes, budget), len(streamed))
    return ResidencyPlan(budget, weights, tuple(tuple(w.name for w in page) for page in streamed),
                         max(n_slots, 1), slot_bytes)


def budget_for(weights: Sequence[Weight], fraction: float, slots: int | None = None, mappable: bool = False,
               splits: dict | None = None, page_bytes: int | None = None) -> int:
    """The largest budget whose plan streams at least ``fraction`` of the streamable bytes (the
    weights the admission policy does not pin), found by bisection over :func:`plan_residency`
    (``mappable``, ``splits``, ``page_bytes``: as there).

    Raises:
        BudgetError: no budget streams that much (the staging ring alone would not fit).
    """
    streamable = sum(w.nbytes for w in weights if not _pinned(w))
    want = fraction * streamable
    lo, hi = 0, sum(w.nbytes for w in weights)
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            plan = plan_residency(weights, mid, slots, mappable, splits, page_bytes)
            ok = plan.weight_bytes_streamed_per_step >= want
        except BudgetError:
            lo = mid + 1
            continue
        if ok:
            found, lo = mid, mid + 1
        else:
            hi = mid - 1
    if found is None:
        raise BudgetError(f"no weight budget streams {fraction:.0%} of the {streamable:,} streamable bytes")
    return found


def _bytes(n: int) -> str:
    return "1 byte" if n == 1 else f"{n:,} bytes"


def _smallest(weights: Sequence[Weight], slots: int | None, mappable: bool = False) -> int:
    """The smallest budget :func:`plan_residency` finds a plan for (bisection; plans are cheap)."""
    lo, hi = 0, sum(w.nbytes for w in weights)
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            _plan(weights, mid, slots, mappable)
            hi = mid
        except BudgetError:
            lo = mid + 1
    return lo


def _pinned(w: Weight) -> bool:
    # a weight other constants view stays: streaming it would leave the views' memory behind
    # a row block is as small as its page makes it: never pinned for its size
    return w.gathered or (w.nbytes < SMALL_BYTES and w.rows is None) or w.readers > 1 or bool(w.aliases)


def _mappable(w: Weight) -> bool:
    # only gathers read it, through one name and one node: its rows can come from host memory
    return w.gathered and w.readers == 1 and not w.aliases and w.nbytes >= SMALL_BYTES and bool(w.page)


def _default_slots(pages: Sequence[Sequence[Weight]], slot_bytes: int, budget: int) -> int:
    per_layer: dict[int, int] = {}
    for page in pages:
        layer = page[0].layer
        per_layer[layer] = per_layer.get(layer, 0) + 1
    want = max(per_layer.values(), default=1) + 1
    cap = max(2, int(budget * STAGING_SHARE) // max(slot_bytes, 1))
    return max(2, min(want, cap))

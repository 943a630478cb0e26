"""The engine's policy: which waiting request gets which slot, and which decode bucket runs.

Pure bookkeeping over opaque requests (anything with ``id`` and ``positions``), no device
code, so it is unit-tested and fuzzed on its own.

- **Slots.** The KV cache holds ``slots`` rows of ``capacity`` positions each. A request is
  admitted, first come first served, when a slot is free (every valid request fits any slot:
  prompt plus ``max_tokens`` - 1 <= capacity is checked when it is made), so nothing is preempted.
  It takes the lowest free slot, which keeps the running rows packed at the low slots.
- **Buckets.** A decode step runs the rows of slots ``[0, bucket)``: the smallest of
  :func:`buckets` that covers the highest occupied slot. Free slots below it are padded lanes.
- **Compaction.** When rows below end first, the rows left may sit above the smallest bucket
  that could hold them all: :meth:`Scheduler.compaction` moves the highest occupied slot to
  the lowest free one until they fit that bucket (the engine copies each row's state), so
  fewer padded lanes compute.
- **Prefill budget.** At most ``prefill_tokens`` prompt tokens are admitted per engine
  iteration (at least one request), so a burst of arrivals delays the running rows' next
  decode step by a bounded amount.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Any


def buckets(max_batch: int) -> list[int]:
    """Decode batch sizes: 1, 2, 4, ... below ``max_batch``, then ``max_batch``.

    Raises:
        ValueError: ``max_batch`` < 1.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out = [1]
    while out[-1] * 2 < max_batch:
        out.append(out[-1] * 2)
    if out[-1] != max_batch:
        out.append(max_batch)
    return out


class Scheduler:
    """Slot table and waiting queue of one engine.

    Args:
        slots: rows of the KV cache (the engine's ``max_batch``).
        prefill_tokens: prompt tokens admitted per iteration (at least one request).
        max_waiting: requests that may wait; :meth:`full` says when no more may.
    """

    def __init__(self, slots: int, prefill_tokens: int = 2048, max_waiting: int = 256):
        self.slots = slots
        self.buckets = buckets(slots)
        self.prefill_tokens = prefill_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Any] = deque()
        self.running: dict[int, Any] = {}  # slot -> request
        self._free = list(range(slots))  # sorted

    def full(self) -> bool:
        """True when the waiting queue holds ``max_waiting`` requests."""
        return len(self.waiting) >= self.max_waiting

    def submit(self, request: Any) -> None:
        """Queue ``request`` (the caller checked :meth:`full`)."""
        self.waiting.append(request)

    def admit(self) -> list[tuple[Any, int]]:
        """Move waiting requests into free slots, oldest first, within the prefill budget;
        returns ``(request, slot)`` pairs."""
        out: list[tuple[Any, int]] = []
        budget = self.prefill_tokens
        while self.waiting and self._free:
            req = self.waiting[0]
            cost = len(req.prompt_ids)
            if out and cost > budget:
                break
            self.waiting.popleft()
            slot = self._free.pop(0)
            self.running[slot] = req
            out.append((req, slot))
            budget -= cost
        return out

    def release(self, slot: int) -> Any:
        """Free ``slot``; returns the request that held it."""
        req = self.running.pop(slot)
        bisect.insort(self._free, slot)
        return req

    def find(self, request_id: str) -> tuple[str, Any, int | None] | None:
        """Where request ``request_id`` is: ("waiting", request, None), ("running", request,
        slot), or None (unknown or finished)."""
        for req in self.waiting:
            if req.id == request_id:
                return "waiting", req, None
        for slot, req in self.running.items():
            if req.id == request_id:
                return "running", req, slot
        return None

    def slot_of(self, request: Any) -> int:
        """The slot ``request`` runs in (it may have moved since a step was queued).

        Raises:
            KeyError: it is not running.
        """
        for slot, req in self.running.items():
            if req is request:
                return slot
        raise KeyError(request.id)

    def remove_waiting(self, request: Any) -> None:
        """Drop a waiting request (aborted before it got a slot)."""
        self.waiting.remove(request)

    def compaction(self) -> list[tuple[int, int]]:
        """Move running rows down so they fit the smallest bucket that holds their number: the
        highest occupied slot to the lowest free one, while a row sits at or above that bucket.
        Returns the ``(from_slot, to_slot)`` moves made (the caller copies each row's state)."""
        moves: list[tuple[int, int]] = []
        if not self.running:
            return moves
        target = self.buckets[bisect.bisect_left(self.buckets, len(self.running))]
        while max(self.running) >= target:
            old, new = max(self.running), self._free.pop(0)  # fewer than target rows below it: new < target
            self.running[new] = self.running.pop(old)
            bisect.insort(self._free, old)
            moves.append((old, new))
        return moves

    def bucket(self) -> int:
        """The decode batch: the smallest bucket covering every occupied slot (0 if none)."""
        if not self.running:
            return 0
        top = max(self.running) + 1
        return self.buckets[bisect.bisect_left(self.buckets, top)]

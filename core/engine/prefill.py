"""The engine's prompts in flight: admitted requests whose prompt is not wholly prefilled, and
the policy that prefills them each iteration (docs/engine.md, "Chunked prefill").

A prompt runs in chunks on a fixed grid of absolute positions, ``[kC, (k + 1)C)`` for the
engine's ``prefill_chunk`` C (the whole prompt without one), oldest request first, at most
``prefill_tokens`` positions an iteration (``decode_prefill_tokens`` while some row decodes;
at least one chunk); the engine's decode step of the
running rows comes between two iterations' chunks. Requests admitted together into consecutive
slots whose whole prompts are one chunk each prefill in padded runs split by length as a
fixed-batch Session's prefill groups them (:meth:`~core.engine.slots.SlotState.prefill_rows`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from core.engine.logprobs import chosen
from core.engine.request import Request
from core.runtime.prompts import plan_groups

if TYPE_CHECKING:
    from core.engine.engine import Engine

log = logging.getLogger("lockstep")


class Prefills:
    """Admitted requests not wholly prefilled yet (oldest first) and positions each has done.

    Args:
        engine: the :class:`~core.engine.Engine` whose scheduler, slots and counters it uses
            (its owner thread alone calls these methods).
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.pending: dict[Request, int] = {}

    def __contains__(self, req: object) -> bool:
        return req in self.pending

    def add(self, req: Request) -> None:
        """A request just admitted into a slot: nothing of its prompt is prefilled. Until its
        first chunk runs, its slot steps as a padded lane held at length 0 (whatever length
        the slot's last request left there, it writes only at position 0, which the first chunk
        overwrites)."""
        self.pending[req] = 0
        self.engine.slots.filled[self.engine.scheduler.slot_of(req)] = 0

    def clear(self) -> None:
        """Forget every pending prompt (the engine shut down)."""
        self.pending.clear()

    def run(self, events: list) -> bool:
        """Prefill the admitted requests, oldest first, a chunk at a time (the whole prompt
        without ``prefill_chunk``) within ``prefill_tokens`` positions (at least one chunk). A
        chunk ends at the next multiple of ``prefill_chunk`` in absolute position, so a row's
        chunks, and so its numbers, never depend on its neighbours or its arrival. The chunk
        that ends a prompt chooses the first token; a failure fails its request only (or, with
        the engine's ``reraise``, raises). Returns whether a prefill ran."""
        e = self.engine
        for req in [r for r in self.pending if r.finish_reason is not None]:
            del self.pending[req]  # aborted (or failed) before its prompt was done: its slot is free
        budget, ran = e.prefill_budget(), False
        t0 = time.perf_counter()
        for run in self._batched_runs(budget):
            budget -= sum(len(r.prompt_ids) for _, r in run)
            ran = True
            self._prefill_rows(run, events)
        for req, done in list(self.pending.items()):
            n, chunk = len(req.prompt_ids), e.prefill_chunk
            while req.finish_reason is None:
                stop = n if chunk is None else min(n, (done // chunk + 1) * chunk)
                if ran and stop - done > budget:
                    break
                ran, budget = True, budget - (stop - done)
                slot = e.scheduler.slot_of(req)
                try:
                    out = e.slots.prefill(slot, req.prompt_ids, req.sampling, done, stop)
                except Exception as exc:  # noqa: BLE001 - the request fails, the engine serves on
                    if e.reraise:
                        raise
                    log.exception("prefill of %s failed", req.id)
                    e.scheduler.release(slot)
                    events.append((req, req.finish("error", error=f"prefill failed: {exc}")))
                    break
                done = self.pending[req] = stop
                if out is not None:
                    token, error = int(out.tokens[0]), bool(out.errors[0])
                    lp = chosen(e.slots.row_logits(slot), token) if req.logprobs and not error else None
                    e._feed(req, slot, token, error, events, lp)
                    break
            if req.finish_reason is not None or done == n:
                del self.pending[req]
            if budget <= 0:
                break
        if ran:
            e.counters.prefill_s += max(time.perf_counter() - t0 - e._take_compile_s(), 0.0)
        return ran

    def _batched_runs(self, budget: int) -> list[list[tuple[int, Request]]]:
        """Requests whose whole prompt is one chunk, not started, oldest first within
        ``budget`` positions, in runs of consecutive slots split by prompt length as a
        fixed-batch Session's prefill groups them (:func:`core.runtime.prompts.plan_groups`),
        two or more to a run: each run is one padded prefill (requests arriving together, as
        ``core.run`` submits them, longest first, prefill as the Session's groups do)."""
        e = self.engine
        chosen_rows: list[tuple[int, Request]] = []
        for req, done in self.pending.items():
            n = len(req.prompt_ids)
            if done or (e.prefill_chunk is not None and n > e.prefill_chunk) or n > budget:
                break
            budget -= n
            chosen_rows.append((e.scheduler.slot_of(req), req))
        runs: list[list[tuple[int, Request]]] = []
        for slot, req in sorted(chosen_rows, key=lambda x: x[0]):
            if runs and runs[-1][-1][0] == slot - 1:
                runs[-1].append((slot, req))
            else:
                runs.append([(slot, req)])
        out: list[list[tuple[int, Request]]] = []
        for run in runs:
            groups = plan_groups([len(r.prompt_ids) for _, r in run]) or [list(range(len(run)))]
            for group in groups:  # each group's consecutive pieces
                piece: list[int] = []
                for i in group + [-2]:
                    if piece and i != piece[-1] + 1:
                        out.append([run[j] for j in piece])
                        piece = []
                    piece.append(i)
        return [run for run in out if len(run) > 1]

    def _prefill_rows(self, run: list[tuple[int, Request]], events: list) -> None:
        """One padded prefill of whole prompts into consecutive slots (:meth:`_batched_runs`);
        a failure fails those requests only."""
        e = self.engine
        reqs = [req for _, req in run]
        try:
            out = e.slots.prefill_rows(run[0][0], [r.prompt_ids for r in reqs], [r.sampling for r in reqs])
        except Exception as exc:  # noqa: BLE001 - the requests fail, the engine serves on
            if e.reraise:
                raise
            log.exception("prefill of %s failed", ", ".join(r.id for r in reqs))
            for slot, req in run:
                del self.pending[req]
                e.scheduler.release(slot)
                events.append((req, req.finish("error", error=f"prefill failed: {exc}")))
            return
        for b, (slot, req) in enumerate(run):
            del self.pending[req]
            token, error = int(out.tokens[b]), bool(out.errors[b])
            lp = chosen(e.slots.row_logits(slot), token) if req.logprobs and not error else None
            e._feed(req, slot, token, error, events, lp)

"""TensorParallelRunner: tensor parallel as a step runner the engine drives.

``TensorParallelRunner(model, provider, tensor_parallel=R)`` plans the shards (a KV-head count
R does not divide is a ``ModelError`` before any process starts), then starts R rank processes
(:class:`~core.parallel.ranks.RankCalls`, mode "runner"): each holds its shard on an ordinary
:class:`~core.runtime.runner.Runner` (:class:`~core.parallel.slots.RankSlots`). An
:class:`~core.engine.Engine` on this runner gets a :class:`TensorParallelSlots`
(``engine_slots``): the interface of :class:`~core.engine.slots.SlotState`, each call sent to
every rank, which runs the same call on its own ``SlotState`` over its shard. The ranks must
agree on every token (they read the same all-reduced values); rank 0's answer is used.

So ``core.run(..., tensor_parallel=R)`` and ``lockstep run --tensor-parallel R`` decode on the
engine like any request: its rows are bitwise the fixed-batch
:class:`~core.parallel.session.TensorParallelSession`'s (every shard kernel is batch
invariant and the all-reduce is elementwise). Greedy only (no sampler over vocab-sharded
logits: the slots cannot sample); steps are eager and synchronous (the all-reduce is a host
call), so a decode step is read when it is queued.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from core.counters import Counters
from core.errors import RequestError
from core.models.model import Model, load_model
from core.parallel.ranks import RankCalls, RankError, rank_timeout
from core.parallel.session import TensorParallelCounters
from core.parallel.shard import ShardPlan, plan_shards
from core.provider import ReadyDownload
from core.runtime.step import StepOutput

#: Counters the engine itself fills; every other field is the rank's slot state's (rank 0's).
ENGINE_OWNED = frozenset({"engine_requests", "prefill_s", "decode_s", "compile_s", "run_ahead_steps",
                          "decode_device_s", "discarded_steps"})


@attrs.frozen
class RankProvider:
    """What the coordinator knows of the ranks' provider: its name and capabilities (no
    ``device_sample``: the ranks decode greedily)."""

    name: str
    caps: Any

    def capabilities(self) -> Any:
        """The rank provider's capabilities (no graph capture: the host all-reduce is eager)."""
        return self.caps


class TensorParallelRunner(RankCalls):
    """A model sharded over ``tensor_parallel`` rank processes, driven by an engine (module
    docstring).

    Args:
        model: a model folder or a loaded :class:`~core.models.model.Model` (the unsharded model:
            its config and tokenizer stay here).
        provider: the provider name each rank creates.
        tensor_parallel: the rank count R >= 2.
        kv_layout, weight_budget, device_budget: each rank's :class:`~core.runtime.runner.Runner`'s.

    Attributes:
        model, provider, kv_layout, lock, kv_windows: what an engine reads of a runner.
        vocab_ranges: each rank's token ids ``(start, end)``.
        all_reduces_per_run: all-reduces of one graph run (1 + 2 x layers).

    Raises:
        RequestError: R < 2, a bad provider or ``$LOCKSTEP_RANK_TIMEOUT``, or a refusal of the
            ranks' Runner (a budget, a KV layout).
        core.models.model.ModelError: the model cannot be sharded for R, before any rank starts.
        RankError: a rank failed to start or did not answer within the timeout.
    """

    closed_noun = "runner"

    def __init__(self, model: str | Path | Model, provider: Any = "cpu_reference", tensor_parallel: int = 2,
                 kv_layout: str = "head_major", weight_budget: Any = None, device_budget: Any = None):
        if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, (int, np.integer)) \
                or tensor_parallel < 2:
            raise RequestError(f"tensor_parallel must be an integer >= 2 here, got {tensor_parallel!r}")
        self.ranks, self.timeout = int(tensor_parallel), rank_timeout()
        self.model = model if isinstance(model, Model) else load_model(model)
        self.shard_plan: ShardPlan = plan_shards(self.model, self.ranks)  # ModelError before any process
        name = provider if isinstance(provider, str) else getattr(provider, "name", None)
        if not isinstance(name, str):
            raise RequestError(f"tensor_parallel needs a provider name, got {provider!r}")
        kwargs = dict(kv_layout=kv_layout, weight_budget=weight_budget, device_budget=device_budget)
        ready = self._start_ranks(str(self.model.folder), name, kwargs, "runner")
        info = ready[0]
        self.provider = RankProvider(name, info["capabilities"])
        self.kv_layout, self.weight_budget = kv_layout, weight_budget
        self.kv_windows = info["kv_windows"]
        self.residency_summary, self.weight_bytes = info["residency"], info["weight_bytes"]
        self.vocab_ranges = [r["vocab"] for r in ready]
        self.all_reduces_per_run = info["all_reduces_per_run"]
        #: serialises the engine iterations of threads sharing this runner (as Runner.lock)
        self.lock = threading.RLock()
        self._ids = itertools.count()

    def engine_slots(self, slots: int, capacity: int, capture: bool | None,
                     prefill: list[tuple[int, int]] | None = None) -> TensorParallelSlots:
        """The slot state of an :class:`~core.engine.Engine` on this runner: ``slots`` rows of
        ``capacity`` positions on every rank (``capture`` is moot: the ranks' steps are eager;
        ``prefill`` too: each rank reserves the workspace of every slot's whole prompt)."""
        return TensorParallelSlots(self, next(self._ids), slots, capacity)


class TensorParallelSlots:
    """:class:`~core.engine.slots.SlotState`'s interface over the ranks' slot states (module
    docstring); ``counters`` is a :class:`~core.parallel.session.TensorParallelCounters` the
    engine fills with its own counts, the rest copied from rank 0 after each call.

    Raises:
        RankError: a rank failed (every rank is stopped, the runner closed).
    """

    can_sample = False  # greedy only: no sampler over vocab-sharded logits
    capture = False  # the host all-reduce cannot be captured

    def __init__(self, runner: TensorParallelRunner, sid: int, slots: int, capacity: int):
        self.runner, self.sid, self.slots, self.capacity = runner, sid, slots, capacity
        self.counters = TensorParallelCounters(tensor_parallel=runner.ranks)
        self.counters.set_residency(runner.residency_summary, runner.weight_bytes)
        #: slots part-way through a chunked prefill -> positions done (as SlotState.filled)
        self.filled: dict[int, int] = {}
        self._open = False
        self._take(runner._call("open", sid, slots, capacity)[0])
        self._open = True

    def _take(self, stats: dict) -> None:
        """Copy rank 0's slot-state counters (all but the engine's own) and the all-reduces."""
        c = self.counters
        for a in attrs.fields(Counters):
            if a.name not in ENGINE_OWNED and not a.name.startswith("_"):
                setattr(c, a.name, getattr(stats["counters"], a.name))
        c.all_reduces, c.all_reduce_bytes = stats["all_reduces"], stats["all_reduce_bytes"]

    def _call(self, name: str, *args: Any) -> list:
        """Run slot call ``name`` on every rank; returns each rank's value, in rank order."""
        replies = self.runner._call("call", self.sid, name, args, dict(self.filled))
        _, filled, stats = replies[0]
        self.filled.clear()
        self.filled.update(filled)
        self._take(stats)
        return [value for value, _, _ in replies]

    def _agreed(self, what: str, outs: list) -> Any:
        first = outs[0]
        for r, out in enumerate(outs[1:], 1):
            same = (out is None and first is None) or (
                out is not None and first is not None and (
                    np.array_equal(out.tokens, first.tokens) and np.array_equal(out.errors, first.errors)
                    if isinstance(out, StepOutput) else np.array_equal(out, first)))
            if not same:
                raise self.runner._fail(f"rank {r}'s {what} chose other tokens than rank 0's")
        return first

    def prefill(self, slot: int, prompt_ids: list[int], sampling: Any, start: int = 0,
                stop: int | None = None) -> StepOutput | None:
        """As :meth:`core.engine.slots.SlotState.prefill`, on every rank."""
        return self._agreed("prefill", self._call("prefill", slot, list(prompt_ids), sampling, start, stop))

    def prefill_rows(self, first: int, prompt_ids: list[list[int]], sampling: list) -> StepOutput:
        """As :meth:`core.engine.slots.SlotState.prefill_rows`, on every rank."""
        return self._agreed("prefill", self._call("prefill_rows", first, [list(p) for p in prompt_ids],
                                                  list(sampling)))

    def decode(self, batch: int, live: set[int]) -> ReadyDownload:
        """As :meth:`core.engine.slots.SlotState.decode`, on every rank; the step is read now
        (a finished download: ``wait()`` gives int32 ``[batch, 2]``)."""
        return ReadyDownload(self._agreed("decode step", self._call("decode", batch, set(live))))

    def move(self, old: int, new: int) -> int:
        """As :meth:`core.engine.slots.SlotState.move`, on every rank; returns rank 0's bytes."""
        return int(self._call("move", old, new)[0])

    def start_logits(self, batch: int) -> ReadyDownload:
        """The logits of the last decode step of bucket ``batch``, every rank's vocab shard
        concatenated in rank (= vocab) order: ``[batch, 1, V]``."""
        return ReadyDownload(np.concatenate(self._call("logits", batch), axis=-1))

    def row_logits(self, slot: int) -> np.ndarray:
        """The logits of the last prefill of ``slot``, ``[1, 1, V]`` (every rank's shard)."""
        return np.concatenate(self._call("row_logits", slot), axis=-1)

    def close(self) -> None:
        """Close the ranks' slot states (once; nothing when the ranks are gone already)."""
        if self._open:
            self._open = False
            if self.runner._release.alive:
                with contextlib.suppress(RankError, RequestError):  # ranks stopped meanwhile: nothing left
                    self.runner._call("close", self.sid)

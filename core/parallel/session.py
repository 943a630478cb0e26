"""TensorParallelSession: a Session whose model runs as R rank processes.

``Session(model, ..., tensor_parallel=R)`` (R >= 2) makes one. It plans the shards first
(:func:`~core.parallel.shard.plan_shards`: a KV-head count R does not divide is a
``ModelError`` before any process starts), then starts R processes
(:class:`~core.parallel.ranks.RankCalls`), each running its shard in an ordinary
:class:`~core.session.Session`. ``prefill`` and ``step`` are sent to every rank; the ranks must
agree on every token (they read the same all-reduced values), and rank 0's answer is returned.
:class:`~core.generation.stream.Generation` drives it like any session; the tokenizer and stop
rules run here. ``core.run`` decodes on the engine's step runner instead
(:class:`~core.parallel.runner.TensorParallelRunner`), bitwise this session's rows; this
fixed-batch session stays the facade of ``Session(tensor_parallel=R)``.

Failures (a dead, failed or silent rank: :class:`~core.parallel.ranks.RankError`, every rank
stopped, the session closed) are :mod:`core.parallel.ranks`'.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence, cast

import attrs
import numpy as np

from core.counters import Counters
from core.generation import sampling as sampling_mod
from core.models.model import Model, load_model
from core.parallel.ranks import RankCalls, RankError, rank_timeout
from core.parallel.shard import ShardPlan, plan_shards
from core.runtime.runner import Runner
from core.runtime.step import StepOutput
from core.session import PendingStep, RequestError, Session

__all__ = ["GREEDY_ONLY", "RankError", "TensorParallelCounters", "TensorParallelSession", "check_greedy",
           "rank_timeout"]


@attrs.define
class TensorParallelCounters(Counters):
    """Rank 0's :class:`~core.counters.Counters` plus the tensor-parallel ones.

    Attributes:
        tensor_parallel: the rank count R.
        all_reduces: all-reduce calls rank 0 made (1 + 2 x layers per graph run).
        all_reduce_bytes: bytes rank 0 contributed to them.
    """

    tensor_parallel: int = 1
    all_reduces: int = 0
    all_reduce_bytes: int = 0


#: Why a sampled request is refused with tensor_parallel > 1.
GREEDY_ONLY = ("tensor_parallel decodes greedily only (no sampler over vocab-sharded logits yet): it needs "
               "do_sample=False and repetition_penalty=1")


def check_greedy(sampling: Any, batch: int, model: Model) -> list:
    """The per-row sampling options (:func:`core.generation.sampling.resolve_rows`, defaults
    from the model's "search" section) when every row is plain greedy.

    Raises:
        RequestError: a bad option, or a sampled row (do_sample or a repetition penalty):
            tensor-parallel decoding is greedy only.
    """
    try:
        rows = sampling_mod.resolve_rows(sampling, batch, sampling_mod.search_defaults(model.config.search))
    except sampling_mod.SamplingError as exc:
        raise RequestError(str(exc)) from None
    if not all(r.greedy_plain for r in rows):
        raise RequestError(GREEDY_ONLY)
    return rows


class TensorParallelSession(RankCalls, Session):
    """A :class:`~core.session.Session` sharded over ``tensor_parallel`` rank processes
    (module docstring). Arguments as :class:`~core.session.Session`, plus:

    Args:
        tensor_parallel: the rank count R >= 2.

    Differences: greedy decoding only (sampling over vocab-sharded logits is not built);
    ``all_logits`` and a :class:`~core.runtime.runner.Runner` are refused; graph capture is
    off (the host all-reduce runs eagerly), and so is ``run_ahead`` (each step is a round trip to
    the ranks). :meth:`last_logits` gathers every rank's vocab
    shard. ``counters`` is a :class:`TensorParallelCounters`.

    Raises:
        RequestError: R < 2, a Runner, ``all_logits=True``, a bad ``$LOCKSTEP_RANK_TIMEOUT``,
            or any refusal of :class:`~core.session.Session` (reported by the ranks).
        core.models.model.ModelError: the model cannot be sharded for R (KV heads not divisible,
            an unknown pattern), before any rank starts.
        RankError: a rank failed to start or did not answer within the timeout.
    """

    def __init__(self, model: str | Path | Model | Runner, provider: Any = "cpu_reference", batch: int = 1,
                 capacity: int | None = None, kv_layout: str = "head_major",
                 kv_policy: str | None = None, capture: bool | None = None,
                 max_capacity: int | None = None, weight_budget: int | float | str | None = None,
                 device_budget: int | str | None = None, all_logits: bool = False,
                 prefill_groups: str = "auto", tensor_parallel: int = 2, run_ahead: bool = True):
        if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, (int, np.integer)) \
                or tensor_parallel < 2:
            raise RequestError(f"tensor_parallel must be an integer >= 2 here, got {tensor_parallel!r}")
        if isinstance(model, Runner):
            raise RequestError("tensor_parallel needs a model folder or a loaded Model; a Runner holds one "
                               "provider's unsharded weights")
        if all_logits:
            raise RequestError("tensor_parallel does not keep the prompt logits (all_logits=True)")
        self.ranks = int(tensor_parallel)
        self.run_ahead = False  # every step is a round trip to the ranks (their host all-reduce)
        self._unread, self._logits_stale = [], False
        self.timeout = rank_timeout()
        self._model = model if isinstance(model, Model) else load_model(model)
        self.shard_plan: ShardPlan = plan_shards(self._model, self.ranks)  # ModelError before any process
        name = provider if isinstance(provider, str) else getattr(provider, "name", None)
        if not isinstance(name, str):
            raise RequestError(f"tensor_parallel needs a provider name, got {provider!r}")
        self._provider = SimpleNamespace(name=name)
        self.batch, self.kv_layout = int(batch), kv_layout
        self.all_logits, self.prefill_groups = False, prefill_groups
        self.kv_policy = kv_policy or ("growing" if capacity is None else "fixed")
        self.sampling = []
        self.request_id = 0  # as Session.request_id
        self.counters = TensorParallelCounters(tensor_parallel=self.ranks)
        kwargs = dict(batch=batch, capacity=capacity, kv_layout=kv_layout, kv_policy=kv_policy, capture=capture,
                      max_capacity=max_capacity, weight_budget=weight_budget, device_budget=device_budget,
                      prefill_groups=prefill_groups)
        ready = self._start_ranks(str(self._model.folder), name, kwargs, "session")
        info = ready[0]
        self.state = SimpleNamespace(kv=SimpleNamespace(limit=info["limit"]))
        self.vocab_ranges = [r["vocab"] for r in ready]
        self.all_reduces_per_run = info["all_reduces_per_run"]
        self._stats: dict = {"lengths": np.zeros(self.batch, np.int64), "capacity": None, "started": False}

    # -- rank calls ------------------------------------------------------------------------
    def _stepped(self, outs: list) -> StepOutput:
        first = outs[0][0]
        for r, (out, _) in enumerate(outs[1:], 1):
            if not (np.array_equal(out.tokens, first.tokens) and np.array_equal(out.errors, first.errors)):
                raise self._fail(f"rank {r} chose tokens {out.tokens.tolist()}, rank 0 {first.tokens.tolist()}")
        self._take_stats(outs[0][1])
        return first

    def _take_stats(self, stats: dict) -> None:
        for a in attrs.fields(Counters):
            setattr(self.counters, a.name, getattr(stats["counters"], a.name))
        counters = cast(TensorParallelCounters, self.counters)
        counters.all_reduces = stats["all_reduces"]
        counters.all_reduce_bytes = stats["all_reduce_bytes"]
        self._stats = stats

    # -- the Session surface ---------------------------------------------------------------
    @property
    def model(self) -> Model:
        """The full (unsharded) model: its config and tokenizer."""
        return self._model

    @property
    def provider(self):
        """An object naming each rank's provider (``.name``)."""
        return self._provider

    @property
    def plan(self):
        raise RequestError("a tensor-parallel session has one plan per rank, in the rank processes")

    @property
    def capacity(self) -> int:
        """KV positions per row each rank's cache holds now (after the last call)."""
        return int(self._stats["capacity"] or self._call("stats", targets=[0])[0]["capacity"])

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[B]``: tokens in each row's KV cache (as of the last prefill or step)."""
        return self._stats["lengths"]

    @property
    def started(self) -> bool:
        """True once a prefill ran for the current request."""
        return bool(self._stats["started"])

    def check_prompts(self, input_ids: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 1) -> None:
        """As :meth:`core.session.Session.check_prompts` (rank 0 checks)."""
        self._call("check_prompts", input_ids, max_new_tokens, targets=[0])

    def check_sampling(self, sampling: Any = None) -> list:
        """As :meth:`core.session.Session.check_sampling`, greedy rows only.

        Raises:
            RequestError: a bad option, or a sampled row (do_sample or a repetition penalty).
        """
        self._check_open()
        return check_greedy(sampling, self.batch, self._model)

    def set_sampling(self, rows: Sequence[Any], history: Sequence[Sequence[int]] | None = None) -> None:
        """As :meth:`core.session.Session.set_sampling`, on every rank."""
        self._call("set_sampling", list(rows), history)
        self.sampling = list(rows)

    def rewind(self, lengths: Sequence[int], history: Sequence[Sequence[int]] | None = None) -> None:
        """As :meth:`core.session.Session.rewind`, on every rank."""
        self._call("rewind", list(lengths), history)
        self.request_id += 1
        self._stats = {**self._stats, "lengths": np.asarray(lengths, np.int64)}

    def prefill(self, input_ids: Sequence[Sequence[int]], sampling: Any = None) -> StepOutput:
        """As :meth:`core.session.Session.prefill`, every rank on its shard; greedy only."""
        self.check_sampling(sampling)
        self.request_id += 1
        return self._stepped(self._call("prefill", input_ids, sampling))

    def step(self, force_tokens: Sequence[int] | None = None) -> StepOutput:
        """As :meth:`core.session.Session.step`, every rank on its shard."""
        return self._stepped(self._call("step", force_tokens))

    def step_async(self, force_tokens: Sequence[int] | None = None) -> PendingStep:
        """As :meth:`step` (the ranks step synchronously), returned as a finished
        :class:`~core.session.PendingStep`."""
        return PendingStep.finished(self, self.step(force_tokens))

    def last_logits(self) -> np.ndarray:
        """fp32 ``[B, V]``: every rank's vocab shard of the logits the last step chose from,
        concatenated in rank (= vocab) order."""
        return np.concatenate(self._call("shard_logits"), axis=-1)

    def prompt_logits(self) -> np.ndarray:
        raise RequestError("tensor_parallel does not keep the prompt logits (all_logits)")

"""A rank's engine slots: its shard on a :class:`~core.runtime.runner.Runner`, with one
:class:`~core.engine.slots.SlotState` per engine of the coordinator.

:class:`RankSlots` lives in a rank process (:func:`core.parallel.worker.rank_main`, mode
"runner"). The coordinator's :class:`~core.parallel.runner.TensorParallelSlots` sends it
every slot call of the engine (open, prefill, prefill_rows, decode, move, the logits, close);
each rank runs the same call on its shard, in the same order, so the plan's all-reduces and
the cross-rank argmax (:class:`~core.parallel.provider.TensorParallelProvider`) meet. A
decode step is read before the reply (the ranks' steps are synchronous: the all-reduce is a
host call). With every call the coordinator sends the slots part-way through a chunked prefill
(``filled``: the engine's scheduler writes them) and gets back the rank's after the call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.counters import Counters
from core.engine.slots import SlotState
from core.runtime.runner import Runner


class RankSlots:
    """The rank side of the tensor-parallel engine slots (module docstring).

    Args:
        model: this rank's shard (:meth:`~core.parallel.shard.ShardPlan.shard`).
        provider: the rank's :class:`~core.parallel.provider.TensorParallelProvider`.
        comm: the rank's :class:`~core.parallel.comm.HostCommunicator` (its call counts).
        kwargs: the Runner's ``kv_layout``, ``weight_budget`` and ``device_budget``.
    """

    def __init__(self, model: Any, provider: Any, comm: Any, kwargs: dict):
        self.runner = Runner(model, provider, kwargs.get("kv_layout", "head_major"),
                             weight_budget=kwargs.get("weight_budget"), device_budget=kwargs.get("device_budget"))
        self.comm = comm
        self.states: dict[int, SlotState] = {}
        self._base: dict[int, tuple[int, int]] = {}  # the communicator's counts when each opened

    def info(self) -> dict:
        """What the coordinator's runner reports: the provider's capabilities, the ring KV
        windows, the residency summary and resident weight bytes of this rank."""
        r = self.runner
        return {"capabilities": r.provider.capabilities(), "kv_windows": list(r.kv_windows),
                "residency": r.residency.summary(), "weight_bytes": r.weight_bytes}

    def handle(self, op: str, args: tuple) -> Any:
        """One call: ("open", id, slots, capacity), ("close", id) or ("call", id, name, args,
        filled). Returns the call's value, the slots mid-prefill after it and the stats."""
        if op == "open":
            sid, slots, capacity = args
            counters = Counters()
            counters.set_residency(self.runner.residency.summary(), self.runner.weight_bytes)
            self._base[sid] = (self.comm.calls, self.comm.bytes)
            self.states[sid] = SlotState(self.runner, slots, capacity, False, counters)
            return self._stats(sid)
        if op == "close":
            state = self.states.pop(args[0], None)
            if state is not None:
                state.close()
            return None
        if op == "call":
            sid, name, call_args, filled = args
            state = self.states[sid]
            state.filled.clear()
            state.filled.update(filled)
            value = self._run(state, name, call_args)
            return value, dict(state.filled), self._stats(sid)
        raise ValueError(f"unknown rank slot call {op!r}")

    @staticmethod
    def _run(state: SlotState, name: str, args: tuple) -> Any:
        if name == "decode":
            return state.decode(*args).wait()
        if name == "logits":
            return np.ascontiguousarray(state.start_logits(*args).wait())
        if name == "row_logits":
            return np.ascontiguousarray(state.row_logits(*args))
        if name in ("prefill", "prefill_rows", "move"):
            return getattr(state, name)(*args)
        raise ValueError(f"unknown slot call {name!r}")

    def _stats(self, sid: int) -> dict:
        calls, nbytes = self._base[sid]
        return {"counters": self.states[sid].counters, "all_reduces": self.comm.calls - calls,
                "all_reduce_bytes": self.comm.bytes - nbytes}

    def close(self) -> None:
        """Close every slot state (their KV goes back to the runner)."""
        for state in self.states.values():
            state.close()
        self.states.clear()

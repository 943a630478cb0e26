"""The rank process: one shard of the model in an ordinary Session or Runner, driven over a pipe.

:func:`rank_main` is the target of each spawned rank. It loads the model folder, cuts its
own shard with the same :class:`~core.parallel.shard.ShardPlan` as every other rank, wraps
its provider in :class:`~core.parallel.provider.TensorParallelProvider` and makes, in mode
"session", a :class:`~core.session.Session` on the shard (the fixed-batch
:class:`~core.parallel.session.TensorParallelSession`), or in mode "runner" a
:class:`~core.runtime.runner.Runner` whose engine slot states
(:class:`~core.engine.slots.SlotState`, :mod:`core.parallel.slots`) the coordinator's
:class:`~core.parallel.runner.TensorParallelRunner` makes and drives. Then it answers the coordinator's calls, one
``(op, args)`` message at a time, with ``("ok", value)``, ``("error", exc)`` for an error the
user caused (raised before any work: the rank stays usable), or ``("fatal", text)`` after
which it exits (a communicator failure or a bug: its state can no longer be trusted).
It exits when told ``("close",)`` or when the coordinator's pipe closes.
"""

from __future__ import annotations

import os
import pickle
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

#: Set in every rank process: NVLink multicast can take a multi-GPU host's GPUs out of service
#: (docs/parallel.md "What a GPU backend needs").
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _portable(exc: BaseException) -> BaseException:
    """``exc`` itself when it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def rank_main(rank: int, size: int, folder: str, provider: str, session_kwargs: dict, ctrl: Connection,
              peers: dict[int, Connection], timeout: float, mode: str = "session") -> None:
    """Run rank ``rank`` of ``size`` until closed (module docstring).

    Args:
        folder: the model folder; provider: the provider name each rank creates.
        session_kwargs: :class:`~core.session.Session` keyword arguments (batch, capacity, ...),
            or in mode "runner" the :class:`~core.runtime.runner.Runner`'s (kv_layout, budgets).
        ctrl: the pipe to the coordinator; peers: the communicator's pipes
            (:class:`~core.parallel.comm.HostCommunicator`); timeout: its receive timeout (s).
    """
    os.environ.update(MULTICAST_OFF)  # before any library that could start NCCL or NVSHMEM
    try:  # a failure at start, imports included, reaches the coordinator as this rank's own error
        from core.errors import USER_ERRORS
        from core.models.model import load_model
        from core.parallel.comm import CommError, HostCommunicator
        from core.parallel.provider import TensorParallelProvider
        from core.parallel.shard import plan_shards
        from core.parallel.slots import RankSlots
        from core.plugins import get_provider
        from core.session import Session
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator, then exit
        ctrl.send(("fatal", f"rank {rank} failed to start: {type(exc).__name__}: {exc}\n"
                            f"{traceback.format_exc(limit=6)}"))
        return
    comm = HostCommunicator(rank, size, peers, timeout)
    try:
        model = load_model(folder)
        plan = plan_shards(model, size)
        start, end = plan.vocab_range(rank)
        wrapped = TensorParallelProvider(get_provider(provider), comm, start)
        if mode == "runner":
            slots = RankSlots(plan.shard(model, rank), wrapped, comm, session_kwargs)
            ctrl.send(("ok", {"vocab": (start, end), "all_reduces_per_run": plan.all_reduces_per_run(),
                              **slots.info()}))
            _serve(rank, ctrl, comm, slots.handle, USER_ERRORS, CommError)
            slots.close()
            return
        session = Session(plan.shard(model, rank), wrapped, **session_kwargs)
        ctrl.send(("ok", {"vocab": (start, end), "limit": session.state.kv.limit,
                          "all_reduces_per_run": plan.all_reduces_per_run()}))
    except USER_ERRORS as exc:
        ctrl.send(("error", _portable(exc)))
        return
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator, then exit
        ctrl.send(("fatal", f"rank {rank} failed to start: {type(exc).__name__}: {exc}\n"
                            f"{traceback.format_exc(limit=6)}"))
        return

    def stats() -> dict:
        return {"counters": session.counters, "all_reduces": comm.calls, "all_reduce_bytes": comm.bytes,
                "argmax_calls": comm.argmax_calls, "lengths": session.lengths.copy(),
                "capacity": session.capacity, "started": session.started}

    def handle(op: str, args: tuple) -> Any:
        if op in ("prefill", "step"):
            out = getattr(session, op)(*args)
            return out, stats()
        if op in ("check_prompts", "check_sampling", "set_sampling", "rewind"):
            return getattr(session, op)(*args)
        if op == "shard_logits":
            return np.ascontiguousarray(session.last_logits())
        if op == "stats":
            return stats()
        raise ValueError(f"unknown rank call {op!r}")

    _serve(rank, ctrl, comm, handle, USER_ERRORS, CommError)
    session.close()


def _serve(rank: int, ctrl: Connection, comm: Any, handle: Any, user_errors: tuple,
           comm_error: type[BaseException]) -> None:
    """Answer the coordinator's calls with ``handle(op, args)`` until closed (module docstring)."""
    while True:
        try:
            msg = ctrl.recv()
        except (EOFError, OSError):
            break  # the coordinator is gone
        if msg[0] == "close":
            break
        try:
            ctrl.send(("ok", handle(msg[0], msg[1])))
        except comm_error as exc:
            ctrl.send(("fatal", str(exc)))
            break
        except user_errors as exc:
            ctrl.send(("error", _portable(exc)))
        except BaseException as exc:  # noqa: BLE001 - reported, then exit
            ctrl.send(("fatal", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"))
            break
    comm.close()

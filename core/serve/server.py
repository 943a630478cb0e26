"""``lockstep serve``: load a model into an engine and serve it over HTTP with uvicorn.

The HTTP server starts at once; the model loads (and the decode buckets are captured) on a
thread meanwhile, and /health answers 503 until it is ready.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from core.engine import Engine, StepRunner
from core.engine.engine import DEFAULT_CAPACITY, DEFAULT_PREFILL_CHUNK
from core.runtime.runner import Runner
from core.serve.app import Server, make_app

log = logging.getLogger("lockstep")


def build_server(model: str | Path, provider: Any = "cpu_reference", max_batch: int = 64, capacity: int | None = None,
                 max_waiting: int = 256, capture: bool | None = None, served: str | None = None,
                 api_key: str | None = None, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
                 weight_budget: int | float | str | None = None, device_budget: int | str | None = None,
                 tensor_parallel: int = 1, decode_prefill_tokens: int | None = None,
                 expert_budget: int | float | str | None = None) -> Server:
    """A :class:`~core.serve.app.Server` that loads ``model`` on ``provider`` into an engine of
    ``max_batch`` slots of ``capacity`` positions, prompts prefilled in chunks of
    ``prefill_chunk`` positions (see :class:`core.engine.Engine`). ``weight_budget`` and
    ``device_budget`` are the Runner's (:class:`~core.runtime.runner.Runner`): the weights past
    them stream every step (the KV slots are charged to a device budget once, at load);
    ``expert_budget`` pages a MoE model's experts within them (docs/moe.md).
    ``tensor_parallel`` R > 1 shards the model over R rank processes
    (:class:`~core.parallel.runner.TensorParallelRunner`, each rank's Runner taking the
    budgets): greedy requests only, each rank's KV slots holding its shard.
    ``decode_prefill_tokens`` bounds the prefill between two decode steps (:class:`Engine`)."""
    if tensor_parallel > 1 and expert_budget is not None:
        from core.session import RequestError

        raise RequestError("an expert budget is not offered with tensor parallelism: drop --expert-budget "
                         "or --tensor-parallel")

    def load() -> Engine:
        runner: StepRunner
        if tensor_parallel > 1:
            from core.parallel.runner import TensorParallelRunner

            runner = TensorParallelRunner(model, provider, tensor_parallel, weight_budget=weight_budget,
                                          device_budget=device_budget)
        else:
            runner = Runner(model, provider, weight_budget=weight_budget, device_budget=device_budget,
                            expert_budget=expert_budget, reserve_for=(max_batch, capacity or DEFAULT_CAPACITY))
        engine = Engine(runner, max_batch=max_batch, capacity=capacity, max_waiting=max_waiting, capture=capture,
                        prefill_chunk=prefill_chunk, decode_prefill_tokens=decode_prefill_tokens)
        log.info("engine: %d slots of %d positions, %.2f GB of KV%s", max_batch, engine.capacity,
                 engine.counters.kv_bytes / 1e9, f" per rank, {tensor_parallel} ranks" if tensor_parallel > 1 else "")
        return engine.start()

    return Server(load, served or Path(str(model)).name, api_key)


def serve(server: Server, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run ``server`` with uvicorn until interrupted (the engine shuts down with the app). A
    model that fails to load stops the server, and the load's error is raised here (the command
    line prints it and exits with status 2), not left behind a /health of 503."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    web = uvicorn.Server(uvicorn.Config(make_app(server), host=host, port=port, log_level=log_level))
    server.on_failure = lambda: setattr(web, "should_exit", True)
    web.run()
    if server.error is not None:
        raise server.error

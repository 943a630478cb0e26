"""``lockstep serve``: load a model into an engine and serve it over HTTP with uvicorn.

The HTTP server starts at once; the model loads (and the decode buckets are captured) on a
thread meanwhile, and /health answers 503 until it is ready.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from core.engine import Engine
from core.engine.engine import DEFAULT_PREFILL_CHUNK
from core.runtime.runner import Runner
from core.serve.app import Server, make_app

log = logging.getLogger("lockstep")


def build_server(model: str | Path, provider: Any = "cpu_reference", max_batch: int = 64, capacity: int | None = None,
                 max_waiting: int = 256, capture: bool | None = None, served: str | None = None,
                 api_key: str | None = None, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
                 weight_budget: int | float | str | None = None, device_budget: int | str | None = None,
                 expert_budget: int | float | str | None = None) -> Server:
    """A :class:`~core.serve.app.Server` that loads ``model`` on ``provider`` into an engine of
    ``max_batch`` slots of ``capacity`` positions, prompts prefilled in chunks of
    ``prefill_chunk`` positions (see :class:`core.engine.Engine`). ``weight_budget`` and
    ``device_budget`` are the Runner's (:class:`~core.runtime.runner.Runner`): the weights past
    them stream every step (the KV slots are charged to a device budget once, at load);
    ``expert_budget`` pages a MoE model's experts within them (docs/moe.md)."""
    def load() -> Engine:
        runner = Runner(model, provider, weight_budget=weight_budget, device_budget=device_budget,
                        expert_budget=expert_budget)
        engine = Engine(runner, max_batch=max_batch, capacity=capacity, max_waiting=max_waiting, capture=capture,
                        prefill_chunk=prefill_chunk)
        log.info("engine: %d slots of %d positions, %.2f GB of KV", max_batch, engine.capacity,
                 engine.slots.state.kv.device_bytes / 1e9)
        return engine.start()

    return Server(load, served or Path(str(model)).name, api_key)


def serve(server: Server, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run ``server`` with uvicorn until interrupted (the engine shuts down with the app)."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(make_app(server), host=host, port=port, log_level=log_level)

"""Where a decode run's device bytes go, phase by phase: the CuPy pool's total (what the process
holds on the device) and used bytes after the load, the bandwidth probe, ``reset_peak()``, the
session, the prefill and the decode steps, then ``Runner.memory()``.

    python benchmarks/memory_phases.py FOLDER [BATCH] [PROMPT_LEN]
"""

from __future__ import annotations

import sys

import numpy as np


def main(folder: str, batch: int = 1, prompt_len: int = 32) -> None:
    import cupy

    from core.runtime.runner import Runner
    from core.session import Session

    pool = cupy.get_default_memory_pool()

    def show(what: str) -> None:
        cupy.cuda.get_current_stream().synchronize()
        print(f"{what:28s} pool total {pool.total_bytes() / 2**20:9.1f} used {pool.used_bytes() / 2**20:9.1f} MiB",
              flush=True)

    runner = Runner(folder, "cuda")
    show("load")
    provider = runner.provider
    provider.device_bandwidth()
    show("bandwidth measured")
    provider.reset_peak()
    show("reset_peak")
    session = Session(runner, batch=batch, capacity=max(512, prompt_len + 64), kv_policy="fixed")
    show("session")
    rng = np.random.default_rng(0)
    session.prefill([list(rng.integers(3, 1000, prompt_len)) for _ in range(batch)])
    show("prefill")
    print(f"prefill activations at most {runner.plan.transient_peak_bytes / 2**20:.1f} MiB")
    for i in range(3):
        session.step()
        show(f"step {i} ({session.counters.captures} captures)")
    for _ in range(20):
        session.step()
    show("23 steps")
    print("Runner.memory:", runner.memory(session.state))
    provider.reset_peak()
    show("reset_peak again")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:4]))

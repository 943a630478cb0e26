"""Per-kernel GPU time and DRAM traffic of captured decode steps, measured by Nsight Compute.

    python benchmarks/ncu_step.py MODEL_DIR [--batch 1] [--steps 1] [--out report.csv]

Prefills ``batch`` random 32-token prompts on the cuda provider, captures the decode step, and
replays ``steps`` steps between cudaProfilerStart/Stop while ``ncu`` (re-invoked on this script)
profiles every kernel node of the graph alone: duration, DRAM bytes and their rate, registers and
grid. The table folds kernels by name (the layers' instances of one launch add up) and gives
each its share of the summed kernel time. ncu serialises kernels and flushes caches between
them (``--cache-control all``), so a kernel's time here is its time alone from cold L2: the sum
is a lower bound on the captured step, and the step minus the sum is the launch gaps.
``lockstep profile MODEL --kernels`` gives event times per node without ncu.

Needs ``ncu`` on PATH (``--clock-control none`` is passed: the GPU's clocks are left alone).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed", "launch__registers_per_thread",
           "launch__grid_size", "launch__block_size", "sm__warps_active.avg.pct_of_peak_sustained_active")


def run_steps(model: str, batch: int, steps: int) -> None:
    """The profiled process: prefill, capture, then ``steps`` replays inside the profiler range."""
    import cupy
    import numpy as np

    from core.runtime.runner import Runner
    from core.session import Session

    runner = Runner(model, "cuda")
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, runner.model.config.vocab_size, 32)) for _ in range(batch)]
    session = Session(runner, batch=batch, capacity=128, kv_policy="fixed", capture=True)
    session.prefill(prompts)
    for _ in range(3):  # the capture happens in these
        session.step()
    assert session.counters.captures >= 1, "the decode step was not captured"
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.start()
    for _ in range(steps):
        session.step()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.stop()


def parse(text: str) -> list[dict]:
    """ncu ``--csv --page raw`` output -> one dict per profiled kernel (metric -> value)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    return [r for r in rows if r.get("Kernel Name")
            and r.get("gpu__time_duration.sum", "").replace(",", "").replace(".", "").isdigit()]


def _num(row: dict, key: str) -> float:
    return float(row.get(key, "0").replace(",", "") or 0)


def table(rows: list[dict], steps: int) -> str:
    """Kernels folded by name: calls and us per step, DRAM MB per step, GB/s, % of peak DRAM
    throughput, registers, grid (of the first instance); sorted by time."""
    groups: dict[str, dict] = {}
    for r in rows:
        name = r["Kernel Name"].split("(")[0]
        g = groups.setdefault(name, {"calls": 0, "ns": 0.0, "bytes": 0.0, "pct": 0.0, "first": r})
        ns = _num(r, "gpu__time_duration.sum")
        g["calls"] += 1
        g["ns"] += ns
        g["bytes"] += _num(r, "dram__bytes_read.sum") + _num(r, "dram__bytes_write.sum")
        g["pct"] += _num(r, "dram__throughput.avg.pct_of_peak_sustained_elapsed") * ns
    total = sum(g["ns"] for g in groups.values()) or 1.0
    out = [f"{'kernel':<44} {'calls':>6} {'us/step':>9} {'share':>6} {'MB/step':>9} {'GB/s':>7} "
           f"{'%dram':>6} {'regs':>5} {'grid':>8}"]
    for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["ns"]):
        f = g["first"]
        out.append(f"{name[:44]:<44} {g['calls'] / steps:6.0f} {g['ns'] / steps / 1e3:9.1f} "
                   f"{g['ns'] / total:6.1%} {g['bytes'] / steps / 1e6:9.2f} "
                   f"{g['bytes'] / max(g['ns'], 1):7.0f} {g['pct'] / max(g['ns'], 1):6.1f} "
                   f"{f.get('launch__registers_per_thread', '')[:5]:>5} {f.get('launch__grid_size', '')[:8]:>8}")
    out.append(f"{'sum of kernels':<44} {len(rows) / steps:6.0f} {total / steps / 1e3:9.1f}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--out", help="also write ncu's raw CSV here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_steps(args.model, args.batch, args.steps)
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        print("ncu (Nsight Compute) is not on PATH", file=sys.stderr)
        return 2
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--graph-profiling", "node",
           "--csv", "--page", "raw", "--metrics", ",".join(METRICS),
           sys.executable, os.path.abspath(__file__), args.model, "--batch", str(args.batch),
           "--steps", str(args.steps), "--child"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(proc.stdout)
    rows = parse(proc.stdout)
    if proc.returncode or not rows:
        print(proc.stderr[-4000:] or proc.stdout[-4000:], file=sys.stderr)
        return proc.returncode or 1
    print(f"{args.model}, batch {args.batch}: {len(rows)} kernels in {args.steps} captured step(s)")
    print(table(rows, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Greedy decode on the cuda provider through the loop users run (Session + core.generation.loop):
eager and captured tokens/s per batch size, a per-op-type time profile and host time by function.

    python benchmarks/cuda_decode.py MODEL_DIR [--batches 1,8,32] [--steps 32] [--profile 1,256]
                                     [--cprofile 8]

One Runner serves every batch (the weights are uploaded once). For parity against cpu_reference
use ``lockstep parity``; for the sweep users see use ``lockstep profile``.
"""

from __future__ import annotations

import argparse

import numpy as np

from core.generation.loop import decode
from core.runtime.runner import Runner
from core.session import Session


def op_profile(session: Session, steps: int = 3) -> dict:
    """Milliseconds per op type for one decode step, nodes folded at plan time left out (events
    around every node, synchronised per node: launch + kernel, an upper bound on GPU time)."""
    import cupy

    plan, state, acc = session.plan, session.state, {}
    for _ in range(steps):
        values = dict(plan.constants)
        values.update(state.binding.inputs)
        for i in plan.steps:
            node, kernel, ctx = plan.nodes[i], plan.kernels[i], plan.contexts[i]
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            outs = kernel(ctx, *[values[x] if x else None for x in node.inputs])
            end.record()
            end.synchronize()
            acc[node.op_type] = acc.get(node.op_type, 0.0) + cupy.cuda.get_elapsed_time(start, end) / steps
            values.update((n, v) for n, v in zip(node.outputs, outs) if n)
    return acc


def tok_s(runner: Runner, prompts, steps: int, capacity: int, capture: bool) -> tuple[float, Session]:
    """Decode tokens/s over ``steps`` steps after 3 warm-up steps (capture happens in those)."""
    s = Session(runner, batch=len(prompts), capacity=capacity, kv_policy="fixed", capture=capture)
    trace = decode(s, prompts, steps + 3)
    return len(prompts) * steps / sum(trace.seconds[4:]), s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,8,32,64,256")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--profile", default="1,256", type=lambda t: [int(x) for x in t.split(",") if x])
    ap.add_argument("--cprofile", default="", type=lambda t: [int(x) for x in t.split(",") if x],
                    help="batch sizes whose eager decode steps are run under cProfile (host time by function)")
    args = ap.parse_args()
    runner = Runner(args.model, "cuda")
    rng = np.random.default_rng(0)
    vocab = runner.model.config.vocab_size
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [list(rng.integers(3, vocab, 16)) for _ in range(b)]
        eager, s = tok_s(runner, prompts, args.steps, args.capacity, capture=False)
        captured, c = tok_s(runner, prompts, args.steps, args.capacity, capture=True)
        print(f"batch {b:4d}: eager {b / eager * 1e3:7.3f} ms/step, {eager:10.0f} tok/s; captured "
              f"{b / captured * 1e3:7.3f} ms/step, {captured:10.0f} tok/s "
              f"(captures {c.counters.captures}, fallbacks {c.counters.fallbacks})", flush=True)
        if b in args.cprofile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                s.step()
            prof.disable()
            print(f"  host time of {args.steps} eager steps at batch {b}, by function:")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        if b in args.profile:
            prof = op_profile(s)
            print("  GPU ms per op type:", {k: round(v, 3) for k, v in sorted(prof.items(), key=lambda kv: -kv[1])})
        s.close()
        c.close()


if __name__ == "__main__":
    main()

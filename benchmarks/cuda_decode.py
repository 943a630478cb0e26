"""Greedy decode on the cuda provider through core.executor.Plan (no Session): parity against
cpu_reference, batch invariance, and eager decode tokens/s per batch size.

    python benchmarks/cuda_decode.py MODEL_DIR [--batches 1,8,32] [--steps 32] [--parity]

Prefill runs S = longest prompt (right padded, mask width S: the GQA first prompt); each decode
step runs S = 1 against a persistent [B, capacity] mask, with device_argmax and decode_advance
feeding tokens back on the device (no host round trip per step).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from core.executor import Plan
from core.model import load_model


class Loop:
    def __init__(self, model, provider, batch: int, capacity: int):
        self.m, self.p, self.b, self.cap = model, provider, batch, capacity
        self.plan = Plan(model.graph, model.initializers, provider)
        c = model.config
        nkv, h = c.num_kv_heads, c.head_size
        self.kv = {}
        for name in self.plan.input_names:
            if name.startswith("past_key_values"):
                self.kv[name] = provider.allocate((batch, nkv, capacity, h), model.io_dtype, zero=True)

    def _feeds(self, ids, mask):
        feeds = {"input_ids": ids, "attention_mask": mask}
        feeds.update(self.kv)
        return feeds

    def prefill(self, prompts):
        p = self.p
        s = max(len(x) for x in prompts)
        ids = np.zeros((self.b, s), np.int64)
        mask = np.zeros((self.b, s), np.int64)
        for i, x in enumerate(prompts):
            ids[i, :len(x)] = x
            mask[i, :len(x)] = 1
        out = self.plan.run(self._feeds(p.upload(ids), p.upload(mask)))
        lengths = np.array([len(x) for x in prompts], np.int32)
        self.result = p.allocate((self.b, 2), np.int32)
        self.lengths = p.upload(lengths)
        self.positions = p.upload(lengths - 1)
        p.device_argmax(out["logits"], self.positions, self.result)
        full = np.zeros((self.b, self.cap), np.int64)
        full[:, :s] = mask
        self.mask = p.upload(full)
        self.ids = p.allocate((self.b, 1), np.int64, zero=True)
        self.zero_pos = p.upload(np.zeros(self.b, np.int32))
        p.decode_advance(self.result, self.ids, self.mask, self.lengths)
        return out["logits"]

    def step(self):
        out = self.plan.run(self._feeds(self.ids, self.mask))
        self.p.device_argmax(out["logits"], self.zero_pos, self.result)
        self.p.decode_advance(self.result, self.ids, self.mask, self.lengths)
        return out["logits"]


def profile(loop, steps: int = 3) -> dict:
    """Milliseconds per op type for one decode step, nodes folded at plan time left out (events
    around every node, synchronised per node: launch + kernel, an upper bound on GPU time)."""
    import cupy

    plan, acc = loop.plan, {}
    for _ in range(steps):
        values = dict(plan.constants)
        values.update(loop._feeds(loop.ids, loop.mask))
        for node, kernel, ctx in [(plan.nodes[i], plan.kernels[i], plan.contexts[i]) for i in plan.steps]:
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            outs = kernel(ctx, *[values[x] if x else None for x in node.inputs])
            end.record()
            end.synchronize()
            acc[node.op_type] = acc.get(node.op_type, 0.0) + cupy.cuda.get_elapsed_time(start, end) / steps
            for name, value in zip(node.outputs, outs):
                if name:
                    values[name] = value
    return acc


def captured_ms(loop, replays: int) -> float:
    """ms per decode step replayed from a CUDA graph (plan + argmax + decode_advance)."""
    p = loop.p
    loop.plan.set_frozen(True)
    p.begin_capture()
    loop.step()
    graph = p.end_capture()
    p.replay(graph)
    p.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        p.replay(graph)
    p.synchronize()
    loop.plan.set_frozen(False)
    return (time.perf_counter() - t0) / replays * 1e3


def tokens(loop, prompts, steps):
    """Greedy tokens per row [B, steps + 1] and the host logits of every step."""
    toks, logits = [], []
    lg = loop.prefill(prompts)
    for t in range(steps + 1):
        res = loop.p.download(loop.result)
        toks.append(res[:, 0].copy())
        logits.append(loop.p.download(lg) if t else None)
        if t < steps:
            lg = loop.step()
    return np.stack(toks, 1), logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,8,32,64,256")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--parity", action="store_true")
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--profile", default="1,256", type=lambda t: [int(x) for x in t.split(",") if x])
    ap.add_argument("--cprofile", default="", type=lambda t: [int(x) for x in t.split(",") if x],
                    help="batch sizes whose eager decode steps are run under cProfile (host time by function)")
    args = ap.parse_args()
    from core.plugins import Registry

    reg = Registry()
    cuda = reg.create("cuda")
    model = load_model(args.model)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    if args.parity:
        prompts = [list(rng.integers(3, vocab, n)) for n in (5, 12, 1, 9)]
        ref = reg.create("cpu_reference")
        t_ref, _ = tokens(Loop(model, ref, 4, 64), prompts, 6)
        t_gpu, _ = tokens(Loop(model, cuda, 4, 64), prompts, 6)
        print("parity tokens cuda vs cpu_reference: equal =", np.array_equal(t_ref, t_gpu))
        print(" ref", t_ref.tolist(), "\n gpu", t_gpu.tolist())
        rows = []
        for i, pr in enumerate(prompts):
            t1, _ = tokens(Loop(model, cuda, 1, 64), [pr], 6)
            rows.append(np.array_equal(t1[0], t_gpu[i]))
        print("batch invariance (row i of B=4 == B=1 run, tokens):", rows)
        same = [prompts[1]] * 3
        t3, _ = tokens(Loop(model, cuda, 3, 64), same, 6)
        print("row identity (3 copies):", all(np.array_equal(t3[0], t3[i]) for i in range(3)))
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [list(rng.integers(3, vocab, 16)) for _ in range(b)]
        loop = Loop(model, cuda, b, args.capacity)
        loop.prefill(prompts)
        for _ in range(3):
            loop.step()
        cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loop.step()
        cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
        cap_ms = float("nan")
        try:
            cap_ms = captured_ms(loop, args.steps)
        except Exception as exc:  # noqa: BLE001 - report and keep measuring
            print(f"capture failed: {exc!r}")
        print(f"batch {b:4d}: {dt * 1e3:7.2f} ms/step eager, {b / dt:10.0f} tok/s; captured "
              f"{cap_ms:7.3f} ms/step, {b / cap_ms * 1e3:10.0f} tok/s", flush=True)
        if b in args.cprofile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                loop.step()
            cuda.synchronize()
            prof.disable()
            print(f"  host time of {args.steps} eager steps at batch {b}, by function:")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        if b in args.profile:
            prof = profile(loop)
            print("  GPU ms per op type:", {k: round(v, 3) for k, v in sorted(prof.items(), key=lambda kv: -kv[1])})


if __name__ == "__main__":
    main()

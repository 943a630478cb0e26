"""Decode with weights streamed under a device budget: tok/s against batch and offload fraction,
the copy floor beside each, and Hugging Face accelerate offload at the same budget.

    python benchmarks/streaming.py MODEL_DIR --offload 0,0.25,0.5,0.75 --batches 1,2,4,8,16,32,64 \\
        [--tokens 32] [--hf HF_DIR --hf-batches 1,32] [--json out.json] [--plot out.png]

For each offload fraction f, one Runner with ``weight_budget = (1 - f) x weight bytes`` (f = 0:
everything resident) serves every batch; each batch decodes ``--tokens`` captured steps after
4 warm-up steps. The copy floor is the streamed bytes per step over the measured pinned
host-to-device bandwidth: no step can be faster while the weights stream. accelerate's
``device_map="auto"`` with ``max_memory`` (the GPU given the same weight bytes) is the baseline
users have today for models larger than the device.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from core.generation.loop import decode
from core.profile import batch_axes
from core.runtime import residency
from core.runtime.runner import Runner
from core.session import Session


def lockstep_rows(model_dir: str, fractions, batches, tokens: int) -> list[dict]:
    rows = []
    total = None
    for f in fractions:
        budget = None if f == 0 else (1 - f)
        try:
            runner = Runner(model_dir, "cuda", weight_budget=budget)
        except residency.BudgetError as exc:
            print(json.dumps({"offload": f, "skipped": str(exc)}), flush=True)
            continue
        r = runner.residency
        total = total or sum(w.nbytes for w in residency.weights_of(runner.plan))
        h2d = runner.provider.host_to_device_bandwidth()
        floor_ms = r.weight_bytes_streamed_per_step / h2d * 1e3
        vocab = runner.model.config.vocab_size
        for b in batches:
            prompts = [list(np.random.default_rng(b).integers(3, vocab, 16)) for _ in range(b)]
            s = Session(runner, batch=b, capacity=64, kv_policy="fixed", capture=True)
            trace = decode(s, prompts, tokens + 4)
            ms = float(np.median(trace.seconds[5:])) * 1e3
            c = s.counters
            rows.append(dict(offload=f, batch=b, tok_s=b / ms * 1e3, step_ms=ms, copy_floor_ms=floor_ms,
                             streamed_bytes_per_step=r.weight_bytes_streamed_per_step, weight_bytes=total,
                             htod_bytes_per_token=c.htod_bytes_per_token, page_ins_per_token=c.page_ins_per_token,
                             staging_bytes=r.staging_bytes, slots=r.slots, byte_hit_rate=r.byte_hit_rate,
                             captures=c.captures, invalidations=c.invalidations, fallbacks=len(c.fallbacks),
                             h2d_gb_s=h2d / 1e9))
            print(json.dumps(rows[-1]), flush=True)
            s.close()
        del runner
    return rows


def accelerate_rows(hf_dir: str, fractions, batches, weight_bytes: int, tokens: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    rows = []
    for f in fractions:
        if f == 0:
            continue
        gpu = int(weight_bytes * (1 - f))
        model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float16, device_map="auto",
                                                     max_memory={0: gpu, "cpu": 200 * 2**30})
        for b in batches:
            ids = torch.randint(3, model.config.vocab_size, (b, 16), device="cuda")
            with torch.inference_mode():
                out = model(input_ids=ids, use_cache=True)
                cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                times = []
                for _ in range(tokens):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                    cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
            ms = float(np.median(times[1:])) * 1e3
            rows.append(dict(offload=f, batch=b, accelerate_tok_s=b / ms * 1e3, accelerate_step_ms=ms))
            print(json.dumps(rows[-1]), flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for f in sorted({r["offload"] for r in rows}):
        pts = [r for r in rows if r["offload"] == f]
        label = "all resident" if not f else f"budget {1 - f:.0%} of the weights"
        ax.plot([r["batch"] for r in pts], [r["tok_s"] for r in pts], marker="o", label=label)
        if f:
            ax.plot([r["batch"] for r in pts], [r["batch"] / r["copy_floor_ms"] * 1e3 for r in pts], ls=":",
                    color=ax.lines[-1].get_color(), label=f"copy floor, budget {1 - f:.0%}")
    batch_axes(ax, title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--offload", default="0,0.25,0.5,0.75")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--hf", help="the HF checkpoint of the same architecture (accelerate baseline)")
    p.add_argument("--hf-batches", default="1,32")
    p.add_argument("--hf-tokens", type=int, default=6)
    p.add_argument("--json")
    p.add_argument("--plot")
    a = p.parse_args(argv)
    fractions = [float(x) for x in a.offload.split(",")]
    rows = lockstep_rows(a.model, fractions, [int(x) for x in a.batches.split(",")], a.tokens)
    if a.hf:
        rows += accelerate_rows(a.hf, fractions, [int(x) for x in a.hf_batches.split(",")],
                                rows[0]["weight_bytes"], a.hf_tokens)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    if a.plot:
        plot([r for r in rows if "tok_s" in r], a.plot, f"{a.model}: decode under a weight budget")


if __name__ == "__main__":
    main()

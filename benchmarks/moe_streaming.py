"""Expert streaming on cuda: a gpt-oss-20b-shaped folder (random weights), all experts resident
against expert residency under device budgets for the experts; tok/s at each batch, hit rate,
host-to-device bytes per token and the copy floor (docs/moe.md, "Expert streaming on cuda").

    python benchmarks/moe_streaming.py --out /tmp/moe20b [--layers 8] [--precision fp16] \\
        [--budgets all,8,4] [--batches 1,8,32,64] [--tokens 32] [--ring-slots 8] [--calibrate] [--json out.json]

The folder is built once under ``--out`` (``--build-only`` stops there) from a random gpt-oss
checkpoint of gpt-oss-20b's geometry (hidden 2880, 32 experts of inter 2880, top 4, 64 query
and 8 KV heads of 64, vocabulary 201,088) with ``--layers`` layers (24 in the released model;
fewer keep the disk and the build time down: the fp16 checkpoint takes about 1.6 GB a layer
plus 2.3 GB of embedding and lm_head, the build as much again): fp16 is the builder's CUDA build (MoE),
int4 its CPU build (QMoE, fp32 activations; an fp32 + MXFP4 checkpoint, about 4 GB a layer).
The checkpoint is deleted after the build unless ``--keep-hf``.

Each budget (GiB of expert pages: resident experts plus a ring of ``--ring-slots`` slots; ``all``:
every expert resident in the paged layout, the paged kernels' cost without copies) gets
one Runner whose experts are paged (``use_expert_residency``, uniform plan, or the routing
frequencies of a resident calibration run with ``--calibrate``); every batch decodes
``--tokens`` captured steps after 4 warm-up steps from 16-token random prompts. The copy floor
of a row is the page-in bytes of its decode steps over the measured pinned host-to-device
bandwidth: no step can be faster while those experts are copied. Random routers route about
uniformly, so the hit rate is near the resident share of the experts; a trained router's skew
is what a measured plan exploits.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import time
from pathlib import Path

import numpy as np

from core.generation.loop import decode
from core.runtime.experts import moe_layout
from core.runtime.runner import Runner
from core.session import Session

WARMUP = 4
PROMPT = 16


def geometry(layers: int) -> dict:
    """gpt-oss-20b's config fields (over core.testing.families.TINY and the gpt-oss family's)."""
    return dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                vocab_size=201088, max_position_embeddings=131072, sliding_window=128,
                layer_types=(["sliding_attention", "full_attention"] * layers)[:layers],
                rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096,
                                 "rope_theta": 150000.0})


def write_hf(out: Path, layers: int, precision: str) -> Path:
    """A random checkpoint of :func:`geometry`: fp16 dense experts for the fp16 build (the
    builder's CUDA build reads the dense weights; half the disk of fp32), the tiny family's
    fp32 + MXFP4 checkpoint for the int4 build (which reads the MXFP4 tensors)."""
    from core.testing.families import write_checkpoint

    if precision == "int4":
        return write_checkpoint("gpt-oss", out, init_std=0.02, overrides=geometry(layers))
    import torch
    from transformers import AutoModelForCausalLM

    from core.testing.families import _placeholder_tokenizer, hf_config

    torch.manual_seed(0)
    cfg = hf_config("gpt-oss", 0.02, geometry(layers))
    AutoModelForCausalLM.from_config(cfg).to(torch.float16).save_pretrained(out)
    _placeholder_tokenizer(cfg.vocab_size).save_pretrained(out)
    return out


def build(out: Path, layers: int, precision: str, keep_hf: bool) -> Path:
    """The builder folder ``out/model-{precision}-{layers}`` (built on first use)."""
    from core.testing.families import run_builder

    folder = out / f"model-{precision}-{layers}"
    if (folder / "model.onnx").exists():
        return folder
    hf = write_hf(out / f"hf-{precision}-{layers}", layers, precision)
    proc = run_builder(hf, folder, precision, "cuda" if precision == "fp16" else "cpu", out / "builder-cache")
    shutil.rmtree(out / "builder-cache", ignore_errors=True)
    if not keep_hf:
        shutil.rmtree(hf)
    if proc.returncode != 0 or not (folder / "model.onnx").exists():
        raise RuntimeError(f"the builder failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return folder


def _counts(residency) -> tuple[int, int, int, int]:
    c = residency.counters
    return c.routed, c.hits, c.page_ins, c.page_in_bytes


def _timed(s, prompts, tokens: int, residency) -> tuple[float, list]:
    """(ms per step, counters before and after) of ``tokens`` decode steps after the prefill and
    WARMUP steps, queued ahead as core.generation.loop.decode does (MAX_UNREAD unread)."""
    from core.session import MAX_UNREAD

    s.prefill(prompts)
    for _ in range(WARMUP):
        s.step()
    marks = [] if residency is None else [_counts(residency)]
    t0 = time.perf_counter()
    queued: list = []
    for _ in range(tokens):
        if len(queued) == MAX_UNREAD or (queued and not s.can_run_ahead()):
            queued.pop(0).result()
        queued.append(s.step_async())
    for q in queued:
        q.result()
    ms = (time.perf_counter() - t0) / tokens * 1e3
    if residency is not None:
        marks.append(_counts(residency))
    return ms, marks


def rows_for(model, budget_gib: float | str | None, batches, tokens: int, ring_slots: int,
             frequencies) -> list[dict]:
    """One Runner over every batch; ``budget_gib`` None: every expert resident, the plain kernels;
    "all": every expert resident in the paged layout (the paged kernels' own cost)."""
    from providers.cuda.expert_pager import use_expert_residency

    runner = Runner(model, "cuda")
    vocab = runner.model.config.vocab_size
    h2d = runner.provider.host_to_device_bandwidth()
    residency = None
    rows = []
    for b in batches:
        s = Session(runner, batch=b, capacity=PROMPT + WARMUP + tokens + 8, kv_policy="fixed", capture=True)
        if budget_gib is not None and residency is None:
            nbytes = None if budget_gib == "all" else int(float(budget_gib) * 2**30)
            residency = use_expert_residency(s, nbytes, ring_slots, frequencies)
        prompts = [list(np.random.default_rng(b).integers(3, vocab, PROMPT)) for _ in range(b)]
        ms, marks = _timed(s, prompts, tokens, residency)
        row = dict(budget_gib=budget_gib, batch=b, tok_s=b / ms * 1e3, step_ms=ms, captures=s.counters.captures,
                   fallbacks=len(s.counters.fallbacks), h2d_gb_s=h2d / 1e9)
        if residency is not None and len(marks) == 2:
            routed, hits, page_ins, moved = (after - before for before, after in zip(*marks))
            floor_ms = moved / tokens / h2d * 1e3
            plan = residency.plan
            row.update(ring_slots=plan.ring_slots, resident_experts=sum(len(r) for r in plan.resident.values()),
                       experts=sum(plan.num_experts.values()), resident_gib=plan.resident_bytes / 2**30,
                       ring_gib=plan.ring_bytes / 2**30, hit_rate=hits / routed if routed else 1.0,
                       page_ins_per_step=page_ins / tokens, htod_bytes_per_token=moved / (tokens * b),
                       copy_floor_ms=floor_ms, floor_ratio=ms / floor_ms if floor_ms else None)
        rows.append(row)
        print(json.dumps(row), flush=True)
        s.close()
    runner.release_states()
    gc.collect()
    return rows


def calibrate(model, tokens: int) -> dict:
    """Routing frequencies of a resident run at batch 8 (use_expert_residency with no budget)."""
    from providers.cuda.expert_pager import use_expert_residency

    runner = Runner(model, "cuda")
    s = Session(runner, batch=8, capacity=64, kv_policy="fixed", capture=True)
    residency = use_expert_residency(s, None)
    prompts = [list(np.random.default_rng(100 + i).integers(3, runner.model.config.vocab_size, 16)) for i in range(8)]
    decode(s, prompts, tokens)
    freq = residency.counters.frequencies()
    s.close()
    del runner, residency, s
    gc.collect()
    return freq


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/lockstep-moe-streaming"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--precision", choices=("fp16", "int4"), default="fp16")
    p.add_argument("--budgets", default="all,8,4",
                   help="GiB of expert pages, comma-separated; all: every expert resident, paged")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--ring-slots", type=int, default=8)
    p.add_argument("--calibrate", action="store_true", help="plan from a resident run's routing frequencies")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--keep-hf", action="store_true")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    folder = build(a.out, a.layers, a.precision, a.keep_hf)
    print(json.dumps({"folder": str(folder), "layers": a.layers, "precision": a.precision}), flush=True)
    if a.build_only:
        return
    from core.models.model import load_model

    model = load_model(folder)
    counts, sizes = moe_layout(model.graph, model.initializers)
    expert_gib = sum(counts[n] * sizes[n] for n in counts) / 2**30
    print(json.dumps({"moe_nodes": len(counts), "expert_gib": expert_gib, "page_mib": max(sizes.values()) / 2**20}),
          flush=True)
    batches = [int(b) for b in a.batches.split(",")]
    frequencies = calibrate(model, a.tokens) if a.calibrate else None
    rows = rows_for(model, None, batches, a.tokens, a.ring_slots, None)
    for budget in a.budgets.split(","):
        rows += rows_for(model, budget if budget == "all" else float(budget), batches, a.tokens, a.ring_slots,
                         frequencies)
    if a.json:
        a.json.write_text(json.dumps({"title": f"gpt-oss-20b geometry, {a.layers} layers, {a.precision}",
                                      "expert_gib": expert_gib, "calibrated": a.calibrate, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

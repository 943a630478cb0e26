"""Load generator for `lockstep serve`: Poisson arrivals at several rates, streamed completions
through the official openai client; throughput, time to first token and inter-chunk latency at
p50/p90/p99 per rate, then a solo-equivalence check: a sample of the requests re-run one at a
time (alone on the server) must give the same text and token count.

    python benchmarks/serve_load.py --model FOLDER --provider cuda --max-batch 64 --capacity 2048 \
        --rates 2,8,32 --requests 200 --check 200 [--url http://127.0.0.1:8000] [--json out.json]

Without --url it starts `lockstep serve` itself (core.testing.serving). Prompts are random token
ids (--prompt-len lo,hi), max_tokens uniform in --max-tokens lo,hi; half the requests sample with
a seed, half are greedy (--greedy: all greedy). Inter-chunk latency is measured between SSE
chunks (a chunk carries the text that settled, usually one token).

**The ORT GenAI anchor** (on by default where --model is a folder; --no-ort skips it): the last
rate's requests (the same prompts, max_tokens and sampling options) through ONNX Runtime GenAI on
the same folder, one request at a time in arrival order (a sequential ``og.Generator`` loop, no
queueing: its TTFT is the prefill plus the first token), in a subprocess whose PYTHONPATH starts
with --ort-pythonpath (the CUDA onnxruntime-genai module lives apart from the builder's CPU
one). Where ``import onnxruntime_genai`` fails there, the anchor says so and the rest stands.

The last line on stdout is one JSON object: per rate, Lockstep's throughput (completion tokens
per second of wall time), TTFT and ITL p50/p99, the solo-equivalence check, and the anchor's
figures (``"ort_genai"``); --json FILE writes the full results (p90 and latencies too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def _pct(values: list[float]) -> dict:
    if not values:
        return {}
    a = np.asarray(values)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


async def _one(client, model: str, body: dict, start_at: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    sent = time.perf_counter()
    stamps, text, usage = [], [], None
    stream = await client.completions.create(model=model, stream=True, stream_options={"include_usage": True}, **body)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    done = time.perf_counter()
    return {"body": body, "sent": sent, "stamps": stamps, "done": done, "text": "".join(text),
            "tokens": usage.completion_tokens if usage else 0}


async def _rate(client, model: str, bodies: list[dict], rate: float, seed: int) -> dict:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(bodies))
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(_one(client, model, b, float(t), t0) for b, t in zip(bodies, np.cumsum(gaps))))
    wall = max(r["done"] for r in runs) - t0
    ttft = [r["stamps"][0] - r["sent"] for r in runs if r["stamps"]]
    itl = [b - a for r in runs for a, b in zip(r["stamps"], r["stamps"][1:])]
    tokens = sum(r["tokens"] for r in runs)
    return {"rate": rate, "requests": len(runs), "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_s": _pct(ttft), "itl_s": _pct(itl), "latency_s": _pct([r["done"] - r["sent"] for r in runs]),
            "runs": runs}


async def _main(a) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=a.url + "/v1", api_key=a.api_key, max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    rng = np.random.default_rng(a.seed)
    out = {"model": model, "rates": []}
    samples = []
    for i, rate in enumerate(a.rates):
        bodies = []
        for j in range(a.requests):
            body = {"prompt": rng.integers(3, a.vocab, int(rng.integers(*a.prompt_len))).tolist(),
                    "max_tokens": int(rng.integers(*a.max_tokens))}
            if j % 2 and not a.greedy:
                body.update(temperature=0.8, top_p=0.95, seed=int(rng.integers(0, 2**31)))
            bodies.append(body)
        res = await _rate(client, model, bodies, rate, a.seed + i)
        samples += res.pop("runs")
        out["rates"].append(res)
        out["last_bodies"] = bodies
        print(f"rate {rate:6.1f}/s: {res['tokens_per_s']:9.1f} tok/s  ttft {res['ttft_s']}  itl {res['itl_s']}",
              flush=True)
    check = [samples[k] for k in rng.choice(len(samples), min(a.check, len(samples)), replace=False)]
    mismatches = 0
    for r in check:  # one at a time: each request alone on the server
        solo = await _one(client, model, r["body"], 0.0, time.perf_counter())
        mismatches += (solo["text"], solo["tokens"]) != (r["text"], r["tokens"])
    out["solo_check"] = {"checked": len(check), "mismatches": int(mismatches)}
    print(f"solo equivalence: {mismatches} mismatches in {len(check)} requests re-run alone", flush=True)
    return out


def ort_anchor(folder: str, bodies: list[dict]) -> dict:
    """The ORT GenAI anchor (module docstring): each request alone, in order, on ``folder``;
    throughput and TTFT / ITL / latency percentiles as :func:`_rate` reports them."""
    import onnxruntime_genai as og

    model = og.Model(folder)
    ttft, itl, latency, tokens = [], [], [], 0
    t0 = time.perf_counter()
    for body in bodies:
        params = og.GeneratorParams(model)
        sample = "temperature" in body
        options = dict(max_length=len(body["prompt"]) + body["max_tokens"], do_sample=sample)
        if sample:
            options.update(temperature=body["temperature"], top_p=body["top_p"], random_seed=body["seed"])
        params.set_search_options(**options)
        sent = time.perf_counter()
        gen = og.Generator(model, params)
        gen.append_tokens([body["prompt"]])
        stamps = []
        while not gen.is_done():
            gen.generate_next_token()
            stamps.append(time.perf_counter())
        tokens += len(stamps)
        ttft.append(stamps[0] - sent)
        itl += [b - a for a, b in zip(stamps, stamps[1:])]
        latency.append(stamps[-1] - sent)
    wall = time.perf_counter() - t0
    return {"anchor": "ort_genai", "version": og.__version__, "mode": "sequential", "requests": len(bodies),
            "wall_s": wall, "tokens_per_s": tokens / wall, "ttft_s": _pct(ttft), "itl_s": _pct(itl),
            "latency_s": _pct(latency)}


def _run_anchor(a, bodies: list[dict]) -> dict:
    """:func:`ort_anchor` in a subprocess (PYTHONPATH led by ``--ort-pythonpath``)."""
    if a.no_ort or not a.model or not Path(a.model).is_dir():
        return {"skipped": "--no-ort, or --model is not a model folder"}
    env = dict(os.environ)
    if a.ort_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (a.ort_pythonpath, env.get("PYTHONPATH")) if p)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(bodies, f)
    try:
        done = subprocess.run([sys.executable, __file__, "--ort-worker", f.name, "--model", a.model], env=env,
                              capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        return {"skipped": f"the ORT GenAI run failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(out: dict) -> dict:
    """The one-line result: per rate throughput, TTFT and ITL p50/p99, the solo check, the anchor."""
    def short(r: dict) -> dict:
        keep = {k: r[k] for k in ("rate", "requests", "tokens_per_s") if k in r}
        for key in ("ttft_s", "itl_s"):
            keep[key] = {q: r[key][q] for q in ("p50", "p99") if q in r.get(key, {})}
        return keep
    anchor = out.get("ort_genai", {})
    return {"model": out["model"], "lockstep": [short(r) for r in out["rates"]], "solo_check": out["solo_check"],
            "ort_genai": short(anchor) | {k: anchor[k] for k in ("mode", "version", "skipped") if k in anchor}}


def _worker(path: str, folder: str) -> None:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError as exc:
        print(json.dumps({"skipped": f"import onnxruntime_genai failed: {exc}"}))
        return
    print(json.dumps(ort_anchor(folder, json.loads(Path(path).read_text()))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start lockstep serve --model ...)")
    p.add_argument("--model", help="model folder or name for the server this script starts")
    p.add_argument("--provider", default="cuda")
    p.add_argument("--max-batch", default="64")
    p.add_argument("--capacity", default="2048")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--rates", type=lambda t: [float(x) for x in t.split(",")], default=[2.0, 8.0, 32.0])
    p.add_argument("--requests", type=int, default=200, help="requests per rate")
    p.add_argument("--prompt-len", type=_pair, default=(16, 512))
    p.add_argument("--max-tokens", type=_pair, default=(16, 256))
    p.add_argument("--check", type=int, default=200, help="requests re-run alone to check solo equivalence")
    p.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn from [3, vocab)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--greedy", action="store_true", help="every request greedy (default: half sample)")
    p.add_argument("--server-flag", action="append", default=[], help="one more lockstep serve argument "
                   "(repeat it: --server-flag=--tensor-parallel --server-flag=2)")
    p.add_argument("--no-ort", action="store_true", help="skip the ORT GenAI anchor")
    p.add_argument("--ort-pythonpath", help="leads the anchor's PYTHONPATH (where the CUDA onnxruntime-genai is)")
    p.add_argument("--ort-worker", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    if a.ort_worker:
        _worker(a.ort_worker, a.model)
        return
    proc = None
    if a.url is None:
        from core.testing.serving import start_server

        proc, a.url = start_server(a.model, "--provider", a.provider, "--max-batch", a.max_batch, "--capacity",
                                   a.capacity, "--max-waiting", "100000", *a.server_flag, timeout=1800)
    try:
        out = asyncio.run(_main(a))
    finally:
        if proc is not None:
            from core.testing.serving import stop_server

            stop_server(proc)
    out["ort_genai"] = _run_anchor(a, out.pop("last_bodies"))  # the server is stopped: the device is the anchor's
    print(json.dumps(summary(out)), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

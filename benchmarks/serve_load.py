"""Load generator for `lockstep serve`: Poisson arrivals at several rates, streamed completions
through the official openai client; throughput, time to first token and inter-chunk latency at
p50/p90/p99 per rate, then a solo-equivalence check: a sample of the requests re-run one at a
time (alone on the server) must give the same text and token count.

    python benchmarks/serve_load.py --model FOLDER --provider cuda --max-batch 64 --capacity 2048 \
        --rates 2,8,32 --requests 200 --check 200 [--url http://127.0.0.1:8000] [--json out.json]

Without --url it starts `lockstep serve` itself (core.testing.serving). Prompts are random token
ids (--prompt-len lo,hi), max_tokens uniform in --max-tokens lo,hi; half the requests sample with
a seed, half are greedy. Inter-chunk latency is measured between SSE chunks (a chunk carries the
text that settled, usually one token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

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
            if j % 2:
                body.update(temperature=0.8, top_p=0.95, seed=int(rng.integers(0, 2**31)))
            bodies.append(body)
        res = await _rate(client, model, bodies, rate, a.seed + i)
        samples += res.pop("runs")
        out["rates"].append(res)
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
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    proc = None
    if a.url is None:
        from core.testing.serving import start_server

        proc, a.url = start_server(a.model, "--provider", a.provider, "--max-batch", a.max_batch, "--capacity",
                                   a.capacity, "--max-waiting", "100000", timeout=1800)
    try:
        out = asyncio.run(_main(a))
    finally:
        if proc is not None:
            from core.testing.serving import stop_server

            stop_server(proc)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

"""ONNX Runtime GenAI (CUDA) decode tokens/s on a builder folder: the anchor beside Lockstep's tables.

    PYTHONPATH=/tmp/ort python benchmarks/ort_genai_decode.py MODEL_DIR --batches 1,8,32 \\
        [--prompt-len 32,512,1024,4096] [--tokens 64] [--graph] [--json ort.json]

Greedy, ``batch_size`` rows of ``--prompt-len`` random tokens (each length of the list in turn:
the context sweep of ``lockstep profile --prompt-len``), ``--tokens`` generated per row; the
prefill (timed on its own) and the first token are left out of the decode timing.

Steady state: each grid point runs twice in the same ``og.Model`` with the same max_length, and
the second run is the one reported (the first is kept in the JSON as ``first_*``). A warm-up
with another max_length would make ORT GenAI capture its CUDA graph inside the timed run (its
graph is keyed by max_length) and halve its batch-1 figure. ``--graph``
sets enable_cuda_graph (ORT GenAI 0.18 allows it at batch 1 only); ORT GenAI refuses batch > 32
on these models, which is reported as "refused" with its first error line. Each grid point
runs in a fresh ``og.Model`` (so no state leaks between points). Run it in its own process:
the CUDA onnxruntime-genai module clashes with the CPU one the model builder uses.

Output: one JSON line per point on stdout, and with ``--json FILE`` the whole grid as
``{"title", "anchor": "ort_genai", "rows": [{"prompt_len", "batch", "graph", "tokens_per_s",
"prefill_ms", "first_tokens_per_s", "first_prefill_ms", "refused"}]}`` (``tokens_per_s`` and
``prefill_ms`` are the steady-state run): the file ``lockstep profile --anchor FILE`` puts beside its own
rows (matched by prompt length and batch).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

#: Runs of each grid point in one model, the same max_length each time; the last is reported.
RUNS = 2


def decode_tps(folder: str, batch: int, prompt_len: int, tokens: int, graph: bool) -> list[tuple[float, float]]:
    """(decode tokens/s, prefill milliseconds) of each of :data:`RUNS` identical greedy runs of
    ``batch`` random prompts, in order (the last is the steady state)."""
    import onnxruntime_genai as og

    config = og.Config(folder)
    if graph:
        config.clear_providers()
        config.append_provider("cuda")
        config.set_provider_option("cuda", "enable_cuda_graph", "1")
    model = og.Model(config)
    vocab = json.loads((Path(folder) / "genai_config.json").read_text())["model"]["vocab_size"]
    ids = np.random.default_rng(0).integers(3, vocab, (batch, prompt_len)).astype(np.int32)

    def one_run() -> tuple[float, float]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=prompt_len + tokens, min_length=prompt_len + tokens,
                                  do_sample=False, batch_size=batch)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(ids)
        gen.generate_next_token()
        prefill_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            gen.generate_next_token()
        return batch * (tokens - 1) / (time.perf_counter() - t0), prefill_ms

    return [one_run() for _ in range(RUNS)]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--batches", type=_ints, default=[1, 8, 32])
    p.add_argument("--prompt-len", type=_ints, default=[32], help="prompt tokens, comma-separated for a sweep")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--graph", action="store_true", help="enable_cuda_graph (batch 1 only)")
    p.add_argument("--json", dest="json_out", help="write the grid as JSON (lockstep profile --anchor reads it)")
    a = p.parse_args(argv)
    rows = []
    for length in a.prompt_len:
        for b in a.batches:
            graph = a.graph and b == 1
            row = {"prompt_len": length, "batch": b, "graph": graph, "tokens_per_s": None, "prefill_ms": None,
                   "first_tokens_per_s": None, "first_prefill_ms": None, "refused": None}
            try:
                runs = decode_tps(a.model, b, length, a.tokens, graph)
                row["first_tokens_per_s"], row["first_prefill_ms"] = runs[0]
                row["tokens_per_s"], row["prefill_ms"] = runs[-1]
            except Exception as exc:  # noqa: BLE001 - ORT GenAI refuses some batch sizes: report it
                row["refused"] = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            rows.append(row)
            print(json.dumps({"model": a.model, **row}), flush=True)
    if a.json_out:
        title = f"ONNX Runtime GenAI CUDA on {a.model}, {a.tokens} tokens per row"
        Path(a.json_out).write_text(json.dumps({"title": title, "anchor": "ort_genai", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

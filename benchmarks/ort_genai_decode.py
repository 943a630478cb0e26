"""ONNX Runtime GenAI (CUDA) decode tokens/s on a builder folder: the anchor beside Lockstep's tables.

    PYTHONPATH=/tmp/ort python benchmarks/ort_genai_decode.py MODEL_DIR --batches 1,8,32 \\
        [--prompt-len 32] [--tokens 64] [--graph]

Greedy, ``batch_size`` rows of ``--prompt-len`` random tokens, ``--tokens`` generated per row; the
prefill and the first token are left out of the timing. ``--graph`` sets enable_cuda_graph
(ORT GenAI 0.18 allows it at batch 1 only); ORT GenAI refuses batch > 32 on these models, which
is reported as "refused". Run it in its own process: the CUDA onnxruntime-genai module clashes
with the CPU one the model builder uses.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def decode_tps(folder: str, batch: int, prompt_len: int, tokens: int, graph: bool) -> float:
    import onnxruntime_genai as og

    config = og.Config(folder)
    if graph:
        config.clear_providers()
        config.append_provider("cuda")
        config.set_provider_option("cuda", "enable_cuda_graph", "1")
    model = og.Model(config)
    vocab = json.loads((Path(folder) / "genai_config.json").read_text())["model"]["vocab_size"]
    ids = np.random.default_rng(0).integers(3, vocab, (batch, prompt_len)).astype(np.int32)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt_len + tokens, min_length=prompt_len + tokens, do_sample=False,
                              batch_size=batch)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    gen.generate_next_token()
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        gen.generate_next_token()
    return batch * (tokens - 1) / (time.perf_counter() - t0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--graph", action="store_true", help="enable_cuda_graph (batch 1 only)")
    a = p.parse_args(argv)
    for b in map(int, a.batches.split(",")):
        try:
            tps = f"{decode_tps(a.model, b, a.prompt_len, a.tokens, a.graph and b == 1):,.0f}"
        except Exception as exc:  # noqa: BLE001 - ORT GenAI refuses some batch sizes: report it
            tps = f"refused ({str(exc).splitlines()[0][:80]})"
        print(json.dumps({"model": a.model, "batch": b, "graph": a.graph and b == 1, "ort_genai_tok_s": tps}),
              flush=True)


if __name__ == "__main__":
    main()

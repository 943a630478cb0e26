"""Decode tokens/s of cpu_reference beside ONNX Runtime GenAI on the same CPU, same prompts.

    python benchmarks/cpu_vs_ort_genai.py [--tokens 32] [--batches 1,8] [--precisions fp32,int4]

Both run greedy decoding of the same chat-templated prompts on the same model folder
(SmolLM2-135M, prepared with ``lockstep prepare``). Decode tokens/s counts generated tokens of
all rows over the decode wall time (prefill excluded). ORT GenAI batches with right padding
too; its rows may stop at EOS while Lockstep's batch runs every row for the full token count
(EOS ignored here so both do the same work: min_length is set to the token count).
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from core.generation.generate import encode_prompts
from core.models.model import load_model
from core.models.prepare import Variant, prepare
from core.session import Session

PROMPTS = ["What is the capital of France?", "Name three primary colors.",
           "Write a haiku about the sea.", "Hi", "Why is the sky blue?", "Count to five.",
           "What is 2 + 2?", "Tell me a fun fact about octopuses."]


def lockstep_decode(model, rows, tokens):
    session = Session(model, "cpu_reference", batch=len(rows), capacity=256)
    session.prefill(rows)
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        session.step()
    return len(rows) * (tokens - 1) / (time.perf_counter() - t0)


def ort_decode(folder, rows, tokens, pad_id):
    import onnxruntime_genai as og

    m = og.Model(str(folder))
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=max(map(len, rows)) + tokens, min_length=max(map(len, rows)) + tokens,
                              do_sample=False, batch_size=len(rows))
    gen = og.Generator(m, params)
    width = max(map(len, rows))
    padded = np.array([r + [pad_id] * (width - len(r)) for r in rows], np.int32)
    gen.append_tokens(padded)
    gen.generate_next_token()
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        gen.generate_next_token()
    return len(rows) * (tokens - 1) / (time.perf_counter() - t0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--precisions", default="fp32,int4")
    a = p.parse_args(argv)
    print(f"# {platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores, "
          f"decode tok/s over {a.tokens} tokens per row")
    print("| model | batch | lockstep cpu_reference | ORT GenAI (CPU EP) |")
    print("|---|---|---|---|")
    for precision in a.precisions.split(","):
        folder = prepare(Variant("smollm2-135m", precision, "cpu"))
        model = load_model(folder)
        for batch in map(int, a.batches.split(",")):
            rows = encode_prompts(model, (PROMPTS * 4)[:batch], chat=True)
            ours = lockstep_decode(model, rows, a.tokens)
            theirs = ort_decode(folder, rows, a.tokens, model.config.pad_token_id)
            print(f"| SmolLM2-135M {precision} | {batch} | {ours:,.1f} | {theirs:,.1f} |", flush=True)


if __name__ == "__main__":
    main()

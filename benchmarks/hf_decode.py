"""Hugging Face transformers (torch fp16, eager) decode tokens/s for a SmolLM2-135M-shaped model.

The baseline beside Lockstep's cuda provider on the same GPU (run by benchmarks/gpu_suite.sh):

    python benchmarks/hf_decode.py --batches 1,8,32,64,256 --prompt-len 16 --tokens 64

Random weights (the same architecture as SmolLM2-135M: LlamaForCausalLM, 30 layers), greedy,
a DynamicCache; tokens/s counts B tokens per decode step over the timed steps (prefill and a
warm-up excluded), timed with CUDA synchronisation around the loop.
"""

from __future__ import annotations

import argparse
import time

from build_test_model import SMOLLM2_135M


def decode_tps(model, batch: int, prompt_len: int, tokens: int, warmup: int = 4) -> float:
    import torch

    ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), device="cuda")
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for i in range(warmup + tokens):
            if i == warmup:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    return batch * tokens / (time.perf_counter() - t0)


def main(argv=None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32,64,256")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to("cuda", torch.float16).eval()
    print("| batch | HF transformers fp16 tok/s |")
    print("|---|---|")
    for b in map(int, a.batches.split(",")):
        print(f"| {b} | {decode_tps(model, b, a.prompt_len, a.tokens):,.0f} |", flush=True)


if __name__ == "__main__":
    main()

"""Build a SmolLM2-135M-shaped builder model with random weights (for GPU speed and parity runs).

Real weights do not travel well to the GPU machine; random weights exercise the same graph,
kernels and shapes. ``--init-std`` above the HF default (0.02) makes logits peaky, so greedy
tokens are well separated and cross-provider token comparisons are meaningful.

    python benchmarks/build_test_model.py OUT --precision fp16 --target cuda [--layers 30]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, num_hidden_layers=30,
    vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, hidden_act="silu",
)


def _placeholder_tokenizer(vocab_size: int):
    """A word-level tokenizer over names t0..t{V-1} (the builder requires some tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                   eos_token="t2", pad_token="t2")


def build(out: Path, precision: str, target: str, layers: int, init_std: float, seed: int,
          tokenizer_from: Path | None) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers, "initializer_range": init_std})
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        model.save_pretrained(hf)
        if tokenizer_from is not None:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                if (tokenizer_from / name).exists():
                    shutil.copy(tokenizer_from / name, hf / name)
        else:
            _placeholder_tokenizer(cfg.vocab_size).save_pretrained(hf)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
               "-p", precision, "-e", target, "-c", str(Path(tmp) / "cache")]
        subprocess.run(cmd, check=True, env=env)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "int4"])
    p.add_argument("--target", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--init-std", type=float, default=0.06)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-from", type=Path, default=None)
    a = p.parse_args(argv)
    print(build(a.out, a.precision, a.target, a.layers, a.init_std, a.seed, a.tokenizer_from))


if __name__ == "__main__":
    main()

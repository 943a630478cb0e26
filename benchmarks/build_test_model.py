"""Build a builder model of a known architecture with random weights (GPU speed and parity runs).

Real weights do not travel well to the GPU machine; random weights exercise the same graph,
kernels and shapes. ``--init-std`` above the HF default (0.02) makes logits peaky, so greedy
tokens are well separated and cross-provider token comparisons are meaningful.

    python benchmarks/build_test_model.py OUT --precision fp16 --target cuda [--layers 30]
    python benchmarks/build_test_model.py OUT --arch qwen2.5-1.5b --precision int4 --keep-hf HF_DIR

Architectures: smollm2-135m (LlamaForCausalLM, the default) and qwen2.5-1.5b (Qwen2ForCausalLM:
hidden 1536, 28 layers, 12 heads / 2 kv heads, intermediate 8960, vocab 151,936, QKV bias,
tied embeddings; the public config's geometry), qwen2.5-0.5b, llama-3.2-1b and llama-3.1-8b
(hidden 4096, 32 layers, 32 / 8 heads of 128, intermediate 14336, vocab 128,256, untied: 16 GB
in fp16; ``--hf-dtype float16`` halves the random checkpoint the builder reads) and qwen2.5-14b
(hidden 5120, 48 layers, 40 / 8 heads of 128, intermediate 13824, vocab 152,064, untied).
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


QWEN25_1_5B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536, intermediate_size=8960,
    num_attention_heads=12, num_key_value_heads=2, num_hidden_layers=28, vocab_size=151936,
    max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
    bos_token_id=151643, eos_token_id=151645, pad_token_id=151643, hidden_act="silu",
)
QWEN25_0_5B = dict(QWEN25_1_5B, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                   num_key_value_heads=2, num_hidden_layers=24)
# Llama-3.2-1B (its published config.json, llama3 rope scaling included)
LLAMA32_1B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, num_hidden_layers=16, vocab_size=128256,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    bos_token_id=128000, eos_token_id=128001, pad_token_id=128001, hidden_act="silu",
)
# Llama-3.1-8B (its published config.json geometry: untied embeddings, llama3 rope scaling)
LLAMA31_8B = dict(LLAMA32_1B, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, num_hidden_layers=32, tie_word_embeddings=False,
                  rope_scaling=dict(LLAMA32_1B["rope_scaling"], factor=8.0))
# Qwen2.5-14B (its published config.json geometry: untied embeddings, QKV bias)
QWEN25_14B = dict(QWEN25_1_5B, hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                  num_key_value_heads=8, num_hidden_layers=48, vocab_size=152064, tie_word_embeddings=False)
ARCHS = {"smollm2-135m": SMOLLM2_135M, "qwen2.5-0.5b": QWEN25_0_5B, "qwen2.5-1.5b": QWEN25_1_5B,
         "llama-3.2-1b": LLAMA32_1B, "llama-3.1-8b": LLAMA31_8B, "qwen2.5-14b": QWEN25_14B}


def _placeholder_tokenizer(vocab_size: int):
    """A word-level tokenizer over names t0..t{V-1} (the builder requires some tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                   eos_token="t2", pad_token="t2")


def build(out: Path, precision: str, target: str, layers: int | None, init_std: float, seed: int,
          tokenizer_from: Path | None, arch: str = "smollm2-135m", keep_hf: Path | None = None,
          hf_dtype: str = "float32") -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    spec = dict(ARCHS[arch])
    if layers is not None:
        spec["num_hidden_layers"] = layers
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec, initializer_range=init_std)
    with tempfile.TemporaryDirectory() as tmp:
        hf = keep_hf or Path(tmp) / "hf"
        if not (hf / "config.json").exists():
            # initialised in the checkpoint's dtype: a 14B model in fp32 would need 56 GB of host memory
            AutoModelForCausalLM.from_config(cfg, torch_dtype=getattr(torch, hf_dtype)).save_pretrained(hf)
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
    p.add_argument("--arch", default="smollm2-135m", choices=sorted(ARCHS))
    p.add_argument("--layers", type=int, default=None, help="layers (default: the architecture's)")
    p.add_argument("--keep-hf", type=Path, default=None, help="keep (or reuse) the random HF checkpoint here")
    p.add_argument("--init-std", type=float, default=0.06)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-from", type=Path, default=None)
    p.add_argument("--hf-dtype", default="float32", choices=["float32", "float16"],
                   help="dtype of the random checkpoint the builder reads (default: %(default)s)")
    a = p.parse_args(argv)
    print(build(a.out, a.precision, a.target, a.layers, a.init_std, a.seed, a.tokenizer_from, a.arch, a.keep_hf,
                a.hf_dtype))


if __name__ == "__main__":
    main()

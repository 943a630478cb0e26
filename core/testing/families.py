"""Tiny random-weight checkpoints of the dense decoder families the ONNX Runtime GenAI builder writes.

Each family is one transformers config, scaled down (hidden 64, 2 layers, 4 heads / 2 kv heads,
head 16, vocab 256, context 256) but keeping the features that make its graph differ from
Llama's: Llama 3 rope scaling, Mistral's sliding window, Qwen2's QKV bias, Qwen3's q/k RMSNorm,
Phi-3's packed projections and LongRoPE, Gemma's soft-capping, GeGLU and sandwich norms, Gemma 3's
local/global layers, SmolLM3's layers without RoPE, Granite's multipliers, OLMo's LayerNorm.
The sliding windows are shorter than a test's prompt plus its 32 decode steps, so the window
is exercised.

:func:`build_family` writes the random checkpoint (config.json, safetensors, a placeholder
word-level tokenizer) and runs the real builder on it, in a few seconds per family:

    python -m core.testing.families OUT_DIR [--family qwen3] [--precision fp32 --target cpu]

Needs the ``models`` extra (torch, transformers, onnxruntime-genai).
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

#: Geometry shared by every family (the builder's "tiny" scale).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)

#: family name -> (model_type, extra config fields over TINY).
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama3": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                             rope_theta=500000.0)),
    # the 0.18 builder windows only the layers layer_types marks "sliding_attention"
    "mistral": ("mistral", dict(sliding_window=24, layer_types=["sliding_attention"] * 2)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", dict(original_max_position_embeddings=256)),
    "phi3-longrope": ("phi3", dict(original_max_position_embeddings=64, rope_scaling={
        "type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.0 + 0.5 * i for i in range(8)]})),
    "gemma2": ("gemma2", dict(sliding_window=24, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              query_pre_attn_scalar=16, tie_word_embeddings=True)),
    # written as a Gemma 3 checkpoint is: rope_theta and rope_local_base_freq, which transformers 5
    # nests per layer type in rope_parameters (core/models/builder_compat.py restores them)
    "gemma3": ("gemma3_text", dict(sliding_window=24, query_pre_attn_scalar=16, tie_word_embeddings=True,
                                   layer_types=["sliding_attention", "full_attention"],
                                   rope_theta=1000000.0, rope_local_base_freq=10000.0)),
    # no_rope_layers=[1, 1]: the 0.18 builder cannot build a layer without RoPE (it asks for a
    # position_ids input the graph does not have), so every layer keeps RoPE
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 1], use_sliding_window=True, sliding_window=24,
                                layer_types=["sliding_attention", "full_attention"])),
    "granite": ("granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                attention_multiplier=0.0625, logits_scaling=8.0)),
    "olmo": ("olmo", {}),
}


def _placeholder_tokenizer(vocab_size: int):
    """A word-level tokenizer over t0..t{V-1} (the builder copies some tokenizer into the folder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                   eos_token="t2", pad_token="t2")


def hf_config(family: str, init_std: float = 0.15, overrides: dict | None = None):
    """The transformers config of a tiny ``family`` checkpoint; ``overrides`` replace fields of
    the geometry (e.g. ``{"intermediate_size": 2304}`` for a down projection of 9 K segments).

    Raises:
        KeyError: unknown family (see :data:`FAMILIES` and
            :data:`core.testing.moe_families.MOE_FAMILIES`).
    """
    from transformers import AutoConfig

    from core.testing.moe_families import MOE_FAMILIES

    model_type, extra = {**FAMILIES, **MOE_FAMILIES}[family]
    fields = {**TINY, **extra, **(overrides or {}), "initializer_range": init_std}
    return AutoConfig.for_model(model_type, **fields)


def write_checkpoint(family: str, out: str | Path, seed: int = 0, init_std: float = 0.15,
                     overrides: dict | None = None) -> Path:
    """Write a random-weight Hugging Face folder of ``family`` (config.json, model.safetensors,
    tokenizer files; geometry :data:`TINY` with ``overrides``) into ``out`` and return it.
    ``init_std`` above the HF default makes the logits peaky, so greedy tokens are well
    separated."""
    import torch
    from transformers import AutoModelForCausalLM

    from core.testing.moe_families import MXFP4_FAMILIES, add_tensors, mxfp4_experts

    out = Path(out)
    torch.manual_seed(seed)
    cfg = hf_config(family, init_std, overrides)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with torch.no_grad():  # RMSNorm weights of 1 (or 0 for Gemma's 1 + w) make every family alike
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    extra = mxfp4_experts(model, seed) if family in MXFP4_FAMILIES else {}
    model.save_pretrained(out)
    if extra:
        add_tensors(out, extra)
    _placeholder_tokenizer(cfg.vocab_size).save_pretrained(out)
    return out


def run_builder(source: str | Path, out: str | Path, precision: str, target: str, cache: str | Path,
                extra: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run the builder offline on ``source`` (a Hugging Face folder, or a .gguf file with its
    config folder) through the config shim of :mod:`core.models.builder_compat`, as
    :func:`core.models.prepare.prepare` does; returns the finished process (not checked)."""
    from core.models.prepare import BUILDER_COMMAND

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    src = Path(source)
    cmd = [*BUILDER_COMMAND, "-o", str(out), "-p", precision, "-e", target, "-c", str(cache)]
    if src.suffix == ".gguf":
        cmd += ["-m", str(src.parent), "-i", str(src)]
    else:
        cmd += ["-i", str(src)]
    return subprocess.run(cmd + list(extra or []), capture_output=True, text=True, env=env)


def build_family(family: str, out: str | Path, precision: str = "fp32", target: str = "cpu",
                 seed: int = 0) -> Path:
    """Build the tiny ``family`` model with the real builder into ``out`` (the builder folder;
    the checkpoint goes to ``out/hf``) and return ``out``.

    Raises:
        RuntimeError: the builder failed (its output tail is in the message).
    """
    out = Path(out)
    hf = write_checkpoint(family, out / "hf", seed)
    proc = run_builder(hf, out, precision, target, out / "cache")
    if proc.returncode != 0 or not (out / "model.onnx").exists():
        raise RuntimeError(f"builder failed for {family}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return out


def prepared_family(family: str, root: str | Path, precision: str = "fp32", target: str = "cpu",
                    overrides: dict | None = None) -> Path:
    """The tiny ``family`` checkpoint (geometry :data:`TINY` with ``overrides``) written to
    ``root/hf/family`` and prepared by :func:`core.models.prepare.prepare` with its cache under
    ``root/cache`` (LOCKSTEP_CACHE is set for the call and restored); returns the builder folder.

    Raises:
        core.models.prepare.PrepareError: the builder failed.
    """
    from core.models.prepare import Variant, prepare

    root = Path(root)
    hf = write_checkpoint(family, root / "hf" / family, overrides=overrides)
    old = os.environ.get("LOCKSTEP_CACHE")
    os.environ["LOCKSTEP_CACHE"] = str(root / "cache")
    try:
        return prepare(Variant(str(hf), precision, target))
    finally:
        if old is None:
            del os.environ["LOCKSTEP_CACHE"]
        else:
            os.environ["LOCKSTEP_CACHE"] = old


def main(argv=None) -> None:
    from core.testing.moe_families import MOE_FAMILIES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--family", action="append", choices=sorted({**FAMILIES, **MOE_FAMILIES}),
                   help="default: every dense family")
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "int4"])
    p.add_argument("--target", default="cpu", choices=["cpu", "cuda"])
    a = p.parse_args(argv)
    for family in a.family or sorted(FAMILIES):
        print(build_family(family, a.out / f"{family}-{a.precision}-{a.target}", a.precision, a.target))


if __name__ == "__main__":
    main()

"""Tiny mixture-of-experts checkpoints for core.testing.families (docs/moe.md).

:data:`MOE_FAMILIES` holds the MoE families the 0.18 builder writes for the CPU that Lockstep
runs, in :data:`core.testing.families.FAMILIES`' form (model_type, extra config over TINY):

- ``gpt-oss``: GptOssForCausalLM, 8 experts, top 2, the clamped SwiGLU (alpha 1.702, limit 7,
  interleaved gate/up, expert biases), attention sinks, alternating sliding/full layers, YaRN
  (betas 2 and 0.5: the builder needs both correction dims inside a head of 16).
  The released checkpoints store the experts in MXFP4 and the builder's int4 build reads those
  tensors (``*_blocks``, ``*_scales``), so :func:`mxfp4_experts` gives the random experts MXFP4
  values and writes both forms: the fp32 build (MoE) and the int4 build (QMoE) hold one model.
- ``lfm2-moe``: Lfm2MoeForCausalLM with attention layers only (the short-convolution layers of
  the released checkpoints need a convolution state Lockstep does not feed), one dense layer
  then two MoE layers of 8 experts, top 2. The expert layer is the Qwen-MoE one (SwiGLU with
  alpha 1 and beta 0, i.e. silu(g) * u, no expert biases, normalized top-k); the router is
  computed in the graph (sigmoid + expert bias, TopK, the chosen scores scattered into sentinel
  logits) and feeds MoE. The builder's int4 build quantizes the dense experts to QMoE itself.
  (The builder's Qwen-MoE, Qwen3_5MoeForConditionalGeneration, needs 3-D MRoPE position ids
  that ONNX Runtime 1.32's CPU RotaryEmbedding refuses, so ORT GenAI cannot run it on the CPU.)
"""

from __future__ import annotations

from pathlib import Path

#: family name -> (model_type, extra config fields over core.testing.families.TINY).
MOE_FAMILIES: dict[str, tuple[str, dict]] = {
    "gpt-oss": ("gpt_oss", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
                                sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                                swiglu_limit=7.0, rope_parameters={
                                    "rope_type": "yarn", "factor": 4.0, "beta_fast": 2.0, "beta_slow": 0.5,
                                    "truncate": False, "original_max_position_embeddings": 64,
                                    "rope_theta": 150000.0})),
    # attention layers only: Lockstep does not feed the short-convolution state of LFM2's conv layers
    "lfm2-moe": ("lfm2_moe", dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_dense_layers=1,
                                  num_hidden_layers=3, layer_types=["full_attention"] * 3, tie_word_embeddings=True)),
}

#: Families whose experts are written in MXFP4 too (:func:`mxfp4_experts`).
MXFP4_FAMILIES = ("gpt-oss",)

#: FP4 E2M1 magnitudes of codes 0..7 (bit 3 is the sign).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _decode(blocks, scales):
    """MXFP4 ``blocks`` uint8 [E, N, K/32, 16] and ``scales`` uint8 [E, N, K/32] (exponent + 127)
    as fp32 [E, N, K]: element 2i of a block is the low nibble of byte i (the builder's loader)."""
    import torch

    codes = torch.empty((*blocks.shape[:-1], 32), dtype=torch.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    values = torch.tensor(_E2M1)[(codes & 0x07).long()]
    values = torch.where((codes & 0x08) != 0, -values, values)
    values = values * torch.pow(2.0, scales.to(torch.float32) - 127.0).unsqueeze(-1)
    return values.reshape(blocks.shape[0], blocks.shape[1], -1)


def mxfp4_experts(model, seed: int) -> dict:
    """Give every expert projection of a gpt-oss ``model`` random MXFP4 values (codes uniform,
    block scales 2^-6..2^-4) and set its dense fp32 parameter ([E, K, N], input-major) to their
    decoded values; returns the ``model.layers.L.mlp.experts.{proj}_blocks`` / ``_scales``
    tensors that a released checkpoint stores."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    extra = {}
    for i, layer in enumerate(model.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            dense = getattr(layer.mlp.experts, proj)
            e, k, n = dense.shape
            blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(121, 124, (e, n, k // 32), generator=gen, dtype=torch.uint8)
            with torch.no_grad():
                dense.copy_(_decode(blocks, scales).transpose(1, 2))
            prefix = f"model.layers.{i}.mlp.experts.{proj}"
            extra[f"{prefix}_blocks"], extra[f"{prefix}_scales"] = blocks, scales
    return extra


def add_tensors(folder: str | Path, tensors: dict) -> None:
    """Add ``tensors`` to the single ``model.safetensors`` of a saved checkpoint ``folder``."""
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    save_file({**load_file(str(path)), **tensors}, str(path), metadata={"format": "pt"})


def released_layout(folder: str | Path) -> Path:
    """Rewrite a gpt-oss checkpoint ``folder`` written by :func:`core.testing.families.write_checkpoint`
    the way the released checkpoints are: the experts only as MXFP4 tensors (the dense
    ``gate_up_proj`` / ``down_proj`` removed) and ``quantization_config`` naming mxfp4."""
    import json

    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    path = folder / "model.safetensors"
    dense = ("experts.gate_up_proj", "experts.down_proj")
    tensors = {k: v for k, v in load_file(str(path)).items() if not k.endswith(dense)}
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder

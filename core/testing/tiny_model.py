"""A tiny random decoder written directly with onnx.helper, in the ONNX Runtime GenAI builder's pattern.

The graph has the node pattern the builder writes for a Llama-family model (SmolLM2), so every
kernel and decode path of a provider is exercised in milliseconds, without torch:

- attention-mask subgraph: ReduceSum(mask, axis 1) - 1 -> Cast int32 (seqlens_k) and
  Shape(mask)[1] -> Cast int32 (total_sequence_length);
- embedding tied to the lm_head: Transpose(lm_head weight) -> Gather (fp32/fp16), or
  Reshape(lm_head Q4) -> GatherBlockQuantized (int4);
- per layer: SimplifiedLayerNormalization (layer 0) or SkipSimplifiedLayerNormalization outputs
  [y, "", "", sum]; packed QKV MatMul (or MatMulNBits); GroupQueryAttention (com.microsoft,
  do_rotary=1, cos/sin caches); o_proj; SkipSimplifiedLayerNormalization; gate/up MatMul,
  Sigmoid, Mul (SiLU), Mul, down MatMul;
- final SkipSimplifiedLayerNormalization and the lm_head MatMul (or MatMulNBits) -> logits.

Default geometry: hidden 64, 4 heads, 2 kv heads, head 16, intermediate 128, vocab 256,
context 128, 2 layers. The model folder holds model.onnx and genai_config.json (no tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

EPS = 1e-5
#: Gain of the o_proj/down_proj weights: large enough that the layers, not the tied embedding
#: (logit of the input token), decide the next token, so greedy decoding does not just repeat.
OUT_GAIN = 8.0


@attrs.frozen
class TinyConfig:
    """Geometry of the tiny model (defaults: SmolLM2-shaped, scaled down)."""

    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_size: int = 16
    intermediate: int = 128
    vocab: int = 256
    context: int = 128
    layers: int = 2
    block_size: int = 32
    rope_theta: float = 10000.0
    tied: bool = True  # the embedding is the lm_head's weight; else a float table of its own (a Gather)


def quantize_int4(w: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits codes of a weight ``w`` [K, N] (symmetric, no zero points: zp = 8).

    Returns:
        (B uint8 [N, n_blocks, block_size/2], scales fp32 [N, n_blocks]); element 2i of a
        block is the low nibble of byte i (docs/ops.md 2). K is zero-padded to whole blocks.
    """
    k, n = w.shape
    n_blocks = -(-k // block_size)
    wt = np.zeros((n, n_blocks * block_size), np.float32)
    wt[:, :k] = w.T
    blocks = wt.reshape(n, n_blocks, block_size)
    scales = np.abs(blocks).max(axis=-1) / 7.0
    scales = np.where(scales == 0, 1.0, scales).astype(np.float32)
    codes = np.clip(np.round(blocks / scales[..., None]) + 8, 0, 15).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(packed), scales


class _Graph:
    """Collects nodes and initializers; names follow the builder's."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], name: str, n_out: int = 1, outputs=None,
             domain: str | None = None, **attrs) -> list[str]:
        outputs = outputs or [f"{name}/output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs


def _matmul(g: _Graph, x: str, w: np.ndarray, wname: str, name: str, quant: str | None,
            block: int) -> str:
    if quant is None:
        return g.node("MatMul", [x, g.init(wname, w.astype(g.dtype))], name)[0]
    packed, scales = quantize_int4(w, block)
    b = g.init(wname + "_Q4", packed)
    s = g.init(wname + "_scales", scales.astype(g.dtype).reshape(-1))
    return g.node("MatMulNBits", [x, b, s], name + "_Q4", outputs=[f"{name}/output_0"],
                  domain="com.microsoft", K=w.shape[0], N=w.shape[1], bits=4, block_size=block,
                  accuracy_level=4)[0]


def _rope_caches(cfg: TinyConfig) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_size, 2, dtype=np.float64) / cfg.head_size)
    angles = np.arange(cfg.context, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles), np.sin(angles)


def build_graph(cfg: TinyConfig, dtype: str = "float32", quant: str | None = None,
                seed: int = 0) -> onnx.ModelProto:
    """The tiny model as an in-memory ModelProto (see the module docstring for the pattern)."""
    if quant not in (None, "int4"):
        raise ValueError(f"quant must be None or 'int4', got {quant!r}")
    np_dtype = np.dtype(dtype)
    if np_dtype not in (np.float32, np.float16):
        raise ValueError(f"dtype must be float32 or float16, got {dtype!r}")
    elem = helper.np_dtype_to_tensor_dtype(np_dtype)
    rng = np.random.default_rng(seed)
    g = _Graph(np_dtype)
    h, nq, nkv, hd = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_size

    def weight(k: int, n: int, gain: float = 1.0) -> np.ndarray:
        return (gain * rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)

    def norm_weight() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(h)).astype(np_dtype)

    m = "/model/attn_mask_reformat/attn_mask_subgraph"
    one_vec = g.node("Constant", [], "/model/constant_nodes/INT64/[1]",
                     outputs=["/model/constants/INT64/[1]"],
                     value=numpy_helper.from_array(np.array([1], np.int64)))[0]
    one = g.node("Constant", [], "/model/constant_nodes/INT64/1", outputs=["/model/constants/INT64/1"],
                 value=numpy_helper.from_array(np.array(1, np.int64)))[0]
    rsum = g.node("ReduceSum", ["attention_mask", one_vec], f"{m}/ReduceSum", keepdims=0)[0]
    sub = g.node("Sub", [rsum, one_vec], f"{m}/Sub")[0]
    seqlens = g.node("Cast", [sub], f"{m}/Sub/Cast", to=TensorProto.INT32)[0]
    shape = g.node("Shape", ["attention_mask"], f"{m}/Shape")[0]
    total = g.node("Gather", [shape, one], f"{m}/Gather", axis=0)[0]
    total = g.node("Cast", [total], f"{m}/Gather/Cast", to=TensorProto.INT32)[0]

    lm_head = (rng.standard_normal((h, cfg.vocab))).astype(np.float32)
    if not cfg.tied:
        table = g.init("model.embed_tokens.weight", rng.standard_normal((cfg.vocab, h)).astype(np_dtype))
        x = g.node("Gather", [table, "input_ids"], "/model/embed_tokens/Gather")[0]
        if quant is None:
            g.init("lm_head.MatMul.weight", lm_head.astype(np_dtype))
        else:
            packed, scales = quantize_int4(lm_head, cfg.block_size)
            g.init("lm_head.MatMul.weight_Q4", packed)
            g.init("lm_head.MatMul.weight_scales", scales.astype(np_dtype))
    elif quant is None:
        lm_name = g.init("lm_head.MatMul.weight", lm_head.astype(np_dtype))
        table = g.node("Transpose", [lm_name], "/model/embed_tokens/Transpose", perm=[1, 0])[0]
        x = g.node("Gather", [table, "input_ids"], "/model/embed_tokens/Gather")[0]
    else:
        packed, scales = quantize_int4(lm_head, cfg.block_size)
        q4 = g.init("lm_head.MatMul.weight_Q4", packed)
        sc = g.init("lm_head.MatMul.weight_scales", scales.astype(np_dtype))
        shp = g.init(f"/model/constants/INT64/[{cfg.vocab}, {h // 2}]", np.array([cfg.vocab, h // 2], np.int64))
        data = g.node("Reshape", [q4, shp], "/model/embed_tokens/Reshape")[0]
        x = g.node("GatherBlockQuantized", [data, "input_ids", sc], "/model/embed_tokens/GatherBlockQuantized",
                   domain="com.microsoft", bits=4, block_size=cfg.block_size, gather_axis=0,
                   quantize_axis=1)[0]
    cos, sin = _rope_caches(cfg)
    g.init("cos_cache", cos.astype(np_dtype))
    g.init("sin_cache", sin.astype(np_dtype))

    residual: str | None = None
    for i in range(cfg.layers):
        p, w = f"/model/layers.{i}", f"model.layers.{i}"
        ln_w = g.init(f"{w}.input_layernorm.weight", norm_weight())
        if residual is None:
            normed = g.node("SimplifiedLayerNormalization", [x, ln_w], f"{p}/input_layernorm/LayerNorm",
                            outputs=[f"{p}/input_layernorm/output_0"], epsilon=EPS, axis=-1, stash_type=1)[0]
            residual = x
        else:
            normed, _, _, residual = g.node(
                "SkipSimplifiedLayerNormalization", [residual, x, ln_w], f"{p}/input_layernorm/SkipLayerNorm",
                outputs=[f"{p}/input_layernorm/output_0", "", "", f"{p}/input_layernorm/output_3"],
                domain="com.microsoft", epsilon=EPS)
        qkv = _matmul(g, normed, weight(h, (nq + 2 * nkv) * hd), f"{w}.attn.qkv_proj.MatMul.weight",
                      f"{p}/attn/qkv_proj/MatMul", quant, cfg.block_size)
        attn = g.node("GroupQueryAttention",
                      [qkv, "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens, total,
                       "cos_cache", "sin_cache", "", "", ""], f"{p}/attn/GroupQueryAttention",
                      outputs=[f"{p}/attn/GroupQueryAttention/output_0", f"present.{i}.key", f"present.{i}.value"],
                      domain="com.microsoft", num_heads=nq, kv_num_heads=nkv, scale=1.0 / np.sqrt(hd),
                      local_window_size=-1, softcap=0.0, do_rotary=1, rotary_interleaved=0)[0]
        o = _matmul(g, attn, weight(nq * hd, h, OUT_GAIN), f"{w}.attn.o_proj.MatMul.weight", f"{p}/attn/o_proj/MatMul",
                    quant, cfg.block_size)
        post_w = g.init(f"{w}.post_attention_layernorm.weight", norm_weight())
        normed, _, _, residual = g.node(
            "SkipSimplifiedLayerNormalization", [residual, o, post_w], f"{p}/post_attention_layernorm/SkipLayerNorm",
            outputs=[f"{p}/post_attention_layernorm/output_0", "", "", f"{p}/post_attention_layernorm/output_3"],
            domain="com.microsoft", epsilon=EPS)
        gate = _matmul(g, normed, weight(h, cfg.intermediate), f"{w}.mlp.gate_proj.MatMul.weight",
                       f"{p}/mlp/gate_proj/MatMul", quant, cfg.block_size)
        up = _matmul(g, normed, weight(h, cfg.intermediate), f"{w}.mlp.up_proj.MatMul.weight",
                     f"{p}/mlp/up_proj/MatMul", quant, cfg.block_size)
        sig = g.node("Sigmoid", [gate], f"{p}/mlp/act_fn/Sigmoid")[0]
        act = g.node("Mul", [gate, sig], f"{p}/mlp/act_fn/Mul")[0]
        prod = g.node("Mul", [act, up], f"{p}/mlp/Mul")[0]
        x = _matmul(g, prod, weight(cfg.intermediate, h, OUT_GAIN), f"{w}.mlp.down_proj.MatMul.weight",
                    f"{p}/mlp/down_proj/MatMul", quant, cfg.block_size)

    p = f"/model/layers.{cfg.layers}"
    final_w = g.init(f"model.layers.{cfg.layers}.final_norm_layernorm.weight", norm_weight())
    assert residual is not None  # cfg.layers >= 1
    final = g.node("SkipSimplifiedLayerNormalization", [residual, x, final_w],
                   f"{p}/final_norm_layernorm/SkipLayerNorm", outputs=[f"{p}/final_norm_layernorm/output_0"],
                   domain="com.microsoft", epsilon=EPS)[0]
    if quant is None:
        g.node("MatMul", [final, "lm_head.MatMul.weight"], "/lm_head/MatMul", outputs=["logits"])
    else:
        g.node("MatMulNBits", [final, "lm_head.MatMul.weight_Q4", "lm_head.MatMul.weight_scales"],
               "/lm_head/MatMul_Q4", outputs=["logits"], domain="com.microsoft", K=h, N=cfg.vocab,
               bits=4, block_size=cfg.block_size, accuracy_level=4)

    kv_shape: list[str | int] = ["batch_size", nkv, "past_sequence_length", hd]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                            ["batch_size", "total_sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", elem, ["batch_size", "sequence_length", cfg.vocab])]
    for kind in ("key", "value"):
        inputs += [helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", elem, kv_shape)
                   for i in range(cfg.layers)]
        outputs += [helper.make_tensor_value_info(f"present.{i}.{kind}", elem,
                                                  ["batch_size", nkv, "total_sequence_length", hd])
                    for i in range(cfg.layers)]
    graph = helper.make_graph(g.nodes, "main_graph", inputs, outputs, g.inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10, producer_name="lockstep-tiny")


def genai_config(cfg: TinyConfig) -> dict:
    """The genai_config.json of the tiny model (the builder's fields that Lockstep reads)."""
    return {
        "model": {
            "bos_token_id": 1, "context_length": cfg.context, "eos_token_id": 2, "pad_token_id": 2,
            "type": "llama", "vocab_size": cfg.vocab,
            "decoder": {
                "filename": "model.onnx", "head_size": cfg.head_size, "hidden_size": cfg.hidden,
                "num_attention_heads": cfg.heads, "num_hidden_layers": cfg.layers,
                "num_key_value_heads": cfg.kv_heads,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        "search": {"do_sample": False, "max_length": cfg.context, "num_beams": 1,
                   "past_present_share_buffer": True},
    }


def make_tiny_model(folder: str | Path, dtype: str = "float32", quant: str | None = None,
                    seed: int = 0, config: TinyConfig | None = None, external: bool = False) -> Path:
    """Write a tiny random builder-pattern model into ``folder`` and return the folder.

    Args:
        folder: created if missing; model.onnx and genai_config.json are (over)written.
        dtype: "float32" or "float16" (activations, KV cache, logits and float weights).
        quant: None, or "int4" (MatMulNBits weights, GatherBlockQuantized tied embedding).
        seed: weights are a deterministic function of the seed.
        config: geometry (default :class:`TinyConfig`).
        external: write every initializer into ``model.onnx.data`` (external data, as the
            builder does for real models) instead of inline.

    Raises:
        ValueError: unknown dtype or quant.
    """
    cfg = config or TinyConfig()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(build_graph(cfg, dtype, quant, seed), str(folder / "model.onnx"), save_as_external_data=external,
              all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=0)
    (folder / "genai_config.json").write_text(json.dumps(genai_config(cfg), indent=2))
    return folder


#: The chat template of :func:`write_byte_tokenizer`: plain-text role markers, and a default system
#: prompt unless the messages start with one (the shape of SmolLM2's ChatML template).
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<system>default\n{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_byte_tokenizer(folder: str | Path) -> Path:
    """Write a byte-level tokenizer (token id = byte value, 256 tokens: the tiny model's
    vocabulary) and a tokenizer_config.json with :data:`BYTE_CHAT_TEMPLATE` into ``folder``.

    Decoding follows the ByteLevel decoder: an incomplete UTF-8 sequence decodes to U+FFFD, so
    random tokens exercise the incremental detokenizer (docs/cases.md).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": BYTE_CHAT_TEMPLATE}))
    return folder

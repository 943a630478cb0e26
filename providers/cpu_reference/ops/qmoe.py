"""QMoE (com.microsoft): MoE with integer-quantized expert weights, docs/moe.md.

Inputs: input, router_probs (as MoE); fc1_experts_weights uint8 [E, F*I, H*b1/8],
fc1_scales, fc1_experts_bias, fc2_experts_weights uint8 [E, H, I*b2/8], fc2_scales,
fc2_experts_bias, fc3_experts_weights, fc3_scales, fc3_experts_bias, fc1/fc2/fc3_zero_points;
inputs 14..20 (router_weights, FP4/FP8 scales) are refused (core.opdefs.moe_unsupported).
Attributes: those of MoE, plus expert_weight_bits (2/4/8, default 4), fc1/fc2/fc3_expert_weight_bits
(per-projection overrides), block_size, quant_type (only "int"), weights_prepacked (0: the
raw [E, N, K*bits/8] layout the builder writes for CPU; 1, or absent with the CUDA build's
shapes: ONNX Runtime's CUDA layout [E, K, N*bits/8], repacked to raw once, core.qmoe_layout),
accuracy_level (ignored: exact fp32, as MatMulNBits).
Dequantization of projection row n of expert e, codes LSB-first along K (ops._quant):
W[n, k] = (q - zp) * scale, with per block of ``block_size`` along K scales [E, N, K/bs] and
zero points uint8 [E, N, ceil(K/bs*bits/8)]; without block_size one scale per row, scales
[E, N], zero points [E, ceil(N*bits/8)]; zp = 2^(bits-1) when absent. The dequantized fp32
experts are cached per node for read-only inputs; routing and mixing are MoE's (ops._moe).
ORT's CPU QMoE ignores normalize_routing_weights=0 (it always mixes by the softmax of the k
selected logits); this kernel follows the attribute, as MoE does; the builder writes 1.
Bad shapes raise ValueError. Source: ORT contrib_ops/cpu/moe/moe_quantization_cpu.cc and the
contrib op schema (onnxruntime 1.32).
"""

import numpy as np

from core import qmoe_layout
from core.opdefs import moe_unsupported
from core.ops import run_memos
from providers.cpu_reference.ops import matmul_nbits
from providers.cpu_reference.ops._moe import Activation, Experts, expert_bias, mix, route, token_rows
from providers.cpu_reference.ops._out import write
from providers.cpu_reference.ops._quant import unpack

OP_TYPE = "QMoE"
DOMAIN = "com.microsoft"


def supports(node) -> bool:
    return not moe_unsupported(node)


def support_reason(node) -> str | None:
    return "; ".join(moe_unsupported(node)) or None


def dequantize(w, scales, zero_points, k: int, bits: int, block_size: int) -> np.ndarray:
    """The fp32 transposed weights [E, K, N] of one QMoE projection (module docstring).

    Raises:
        ValueError: shapes or dtypes that do not fit the layout.
    """
    w, scales = np.asarray(w), np.asarray(scales)
    if w.ndim != 3 or w.dtype != np.uint8 or w.shape[2] * 8 != k * bits:
        raise ValueError(f"QMoE: weights {w.dtype}{w.shape}, expected uint8 (E, N, {k * bits // 8})")
    e, n = w.shape[:2]
    zps = [None] * e if zero_points is None else np.asarray(zero_points)
    if block_size:
        return np.stack([matmul_nbits.dequantize(w[i], scales.reshape(e, -1)[i], zps[i], k, n, bits, block_size)
                         for i in range(e)])
    if scales.shape != (e, n) or scales.dtype.kind != "f":
        raise ValueError(f"QMoE: scales {scales.dtype}{scales.shape}, expected ({e}, {n}) without block_size")
    codes = unpack(w, bits, k).astype(np.float32)
    if zero_points is None:
        zp = np.full((e, n), float(1 << (bits - 1)), np.float32)
    else:
        zp = unpack(np.asarray(zero_points).reshape(e, -1), bits, n).astype(np.float32)
    deq = (codes - zp[:, :, None]) * scales.astype(np.float32)[:, :, None]
    return np.ascontiguousarray(np.swapaxes(deq, 1, 2))


def experts_of(ctx, hidden: int, fc1, s1, b1, fc2, s2, b2, fc3, s3, b3, z1, z2, z3) -> Experts:
    """The dequantized fp32 experts of a QMoE node; cached while the same read-only arrays come back.

    Raises:
        ValueError: shapes that do not fit each other, ``hidden`` or the attributes.
    """
    attrs = ctx.node.attrs
    parts = (fc1, s1, b1, fc2, s2, b2, fc3, s3, b3, z1, z2, z3)
    constant = all(x is None or (isinstance(x, np.ndarray) and not x.flags.writeable) for x in parts)
    hit = run_memos(ctx).get("experts")
    if constant and hit is not None and all(x is y for x, y in zip(hit[0], parts)):
        return hit[1]
    raw = qmoe_layout.as_raw(attrs, fc1, s1, fc2, s2, fc3, s3)
    if raw is not None:
        fc1, fc2, fc3 = raw
    bits = int(attrs.get("expert_weight_bits", 4))
    b1_bits = int(attrs.get("fc1_expert_weight_bits", bits))
    b2_bits = int(attrs.get("fc2_expert_weight_bits", bits))
    b3_bits = int(attrs.get("fc3_expert_weight_bits", b1_bits))
    bs = int(attrs.get("block_size", 0))
    fc2 = np.asarray(fc2)
    if fc2.ndim != 3 or fc2.shape[1] != hidden:
        raise ValueError(f"QMoE: fc2_experts_weights has shape {fc2.shape}, expected (E, {hidden}, I*bits/8)")
    inter = fc2.shape[2] * 8 // b2_bits
    w1 = dequantize(fc1, s1, z1, hidden, b1_bits, bs)
    w2 = dequantize(fc2, s2, z2, inter, b2_bits, bs)
    w3 = None if fc3 is None else dequantize(fc3, s3, z3, hidden, b3_bits, bs)
    e, f_i = w1.shape[0], w1.shape[2]
    if w2.shape[0] != e or f_i not in (inter, 2 * inter) or (w3 is not None and w3.shape != (e, hidden, inter)):
        raise ValueError(f"QMoE: fc1 {w1.shape[::-1]}, fc2 {w2.shape[::-1]} do not fit (E, F*I, H), (E, H, I)")
    experts = Experts(w1, w2, w3, expert_bias(b1, "fc1_experts_bias", (e, f_i)),
                      expert_bias(b2, "fc2_experts_bias", (e, hidden)),
                      expert_bias(b3, "fc3_experts_bias", (e, inter)))
    if constant:
        run_memos(ctx)["experts"] = (parts, experts)
    return experts


def run(ctx, x, router_probs, fc1, s1, b1=None, fc2=None, s2=None, b2=None, fc3=None, s3=None, b3=None,
        z1=None, z2=None, z3=None, *unsupported):
    attrs = ctx.node.attrs
    if any(u is not None for u in unsupported):
        raise ValueError("QMoE: inputs 14..20 (router_weights, global / activation scales) are not supported")
    x = np.asarray(x)
    experts = experts_of(ctx, x.shape[-1], fc1, s1, b1, fc2, s2, b2, fc3, s3, b3, z1, z2, z3)
    act = Activation.of(attrs)
    if act.kind == "swiglu" and act.fusion and experts.fc1.shape[2] != 2 * experts.fc2.shape[1]:
        raise ValueError("QMoE: a fused SwiGLU needs 2 * inter_size fc1 outputs")
    rows, router = token_rows(x, router_probs, experts.fc1.shape[0])
    routing = route(router, int(attrs.get("k", 1)), bool(attrs.get("normalize_routing_weights", 0)))
    pager = getattr(ctx.provider, "expert_residency", None)
    return (write(ctx, 0, mix(rows, routing, experts, act, pager, ctx.node.name).reshape(x.shape), x.dtype),)

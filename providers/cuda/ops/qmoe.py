"""QMoE (com.microsoft), docs/moe.md: MoE with integer-quantized experts (block-wise).

Inputs: input, router_probs (as MoE); fc1_experts_weights uint8 [E, F*I, H*b/8], fc1_scales
[E, F*I, H/block_size], fc1_experts_bias, fc2_experts_weights uint8 [E, H, I*b/8], fc2_scales,
fc2_experts_bias, fc3_experts_weights, fc3_scales, fc3_experts_bias, fc1/fc2/fc3_zero_points
(packed uint8 [E, N, ceil(K/block_size*b/8)]); scales and biases in the input dtype.
Codes LSB-first along K, dequantised in registers as (q - zp) * scale in fp32 (zp 2^(b-1)
when absent); b = 2, 4 or 8 (expert_weight_bits, fc*_expert_weight_bits). This provider
runs the block-wise layout the builder writes (block_size set, K a multiple of it); a node
without block_size is refused (support_reason). The int4 CUDA build's codes (ONNX Runtime's
CUDA layout) are repacked to the raw layout at plan time (prepare, core.qmoe_layout).
Kernels: kernels/moe.cu through ops/_moe.py.
Bad shapes or dtypes raise ValueError. Source: ORT contrib op schema (1.32).
"""

import numpy as np

from core import qmoe_layout
from providers.cuda.ops import _moe, array_module

OP_TYPE = "QMoE"
DOMAIN = "com.microsoft"
_FLOATS = (0, 1, 4, 7)  # input, router_probs, fc1_scales, fc2_scales: the float inputs


_bits = qmoe_layout.projection_bits  # (fc1, fc2, fc3) bit widths


def support_reason(node) -> str | None:
    """Why this provider does not run ``node``, or None."""
    reasons = []
    dense = _moe.support_reason(node, _FLOATS)
    if dense:
        reasons.append(dense)
    if "block_size" not in node.attrs:
        reasons.append("QMoE without block_size (cuda runs the block-wise layout)")
    b1, _, b3 = _bits(node.attrs)
    if b3 != b1:
        reasons.append(f"fc3_expert_weight_bits={b3} other than fc1's {b1}")
    return "; ".join(reasons) or None


def supports(node) -> bool:
    return support_reason(node) is None


def run(ctx, x, router_probs, fc1, s1, b1=None, fc2=None, s2=None, b2=None, fc3=None, s3=None, b3=None,
        z1=None, z2=None, z3=None, *rest):
    if fc2 is None or any(r is not None for r in rest):
        raise ValueError("QMoE: fc2_experts_weights is required; inputs 14..20 are not supported")
    b1_bits, b2_bits, b3_bits = _bits(ctx.node.attrs)
    block = int(ctx.node.attrs.get("block_size", 0))
    return _moe.run(ctx, x, router_probs, _moe.Projection(fc1, b1_bits, s1, z1, b1),
                    _moe.Projection(fc2, b2_bits, s2, z2, b2),
                    None if fc3 is None else _moe.Projection(fc3, b3_bits, s3, z3, b3), block)


def prepare(ctx, x, router_probs, fc1, s1, b1=None, fc2=None, s2=None, b2=None, fc3=None, s3=None, *rest):
    """Plan-time hook (core.ops): expert codes in ONNX Runtime's CUDA layout (the builder's int4
    CUDA build: fc1 [E, H, F*I*bits/8], packed along the outputs; core.qmoe_layout) become
    the raw [E, N, K*bits/8] codes the kernels read, once; raw codes prepare nothing.

    Raises:
        ValueError: codes that fit neither layout, or sizes the CUDA layout cannot have.
    """
    if any(getattr(a, "ndim", 0) != 3 for a in (fc1, fc2)) or s1 is None or s2 is None:
        return None
    xp = array_module(fc1)
    host = [a if a is None or xp is np else a.get() for a in (fc1, s1, fc2, s2, fc3, s3)]
    raw = qmoe_layout.as_raw(ctx.node.attrs, *host)
    if raw is None:
        return None
    return {i: xp.asarray(w) for i, w in zip((2, 5, 8), raw) if w is not None}

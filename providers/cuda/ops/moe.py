"""MoE (com.microsoft), docs/moe.md: a mixture of dense experts over token rows.

Inputs: input [T, H] or [B, S, H] fp16/fp32; router_probs [T, E] (router logits, same dtype);
fc1_experts_weights [E, F*I, H] (F = 2 for a fused SwiGLU); fc1_experts_bias [E, F*I];
fc2_experts_weights [E, H, I]; fc2_experts_bias [E, H]; fc3_experts_weights [E, I, H] and
fc3_experts_bias [E, I] (SwiGLU's up projection with swiglu_fusion=0); all in the input dtype.
Attributes and refusals: core.opdefs.moe_unsupported. Kernels: kernels/moe.cu through
ops/_moe.py (routing on the device, one warp dot product per (row, slot, output), the mix in
rank order). Bad shapes or dtypes raise ValueError. Source: ORT contrib op schema (1.32).
"""

from providers.cuda.ops import _moe

OP_TYPE = "MoE"
DOMAIN = "com.microsoft"


def support_reason(node) -> str | None:
    """Why this provider does not run ``node``, or None (ops/_moe.support_reason)."""
    return _moe.support_reason(node)


def supports(node) -> bool:
    return support_reason(node) is None


def run(ctx, x, router_probs, fc1, b1=None, fc2=None, b2=None, fc3=None, b3=None):
    if fc2 is None:
        raise ValueError("MoE: fc2_experts_weights is required")
    return _moe.run(ctx, x, router_probs, _moe.Projection(fc1, bias=b1), _moe.Projection(fc2, bias=b2),
                    None if fc3 is None else _moe.Projection(fc3, bias=b3))

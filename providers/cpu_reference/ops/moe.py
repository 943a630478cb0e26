"""MoE (com.microsoft): a mixture of experts over token rows, docs/moe.md.

Inputs: input [T, H] or [B, S, H] (fp32/fp16); router_probs [T, E] (router logits);
fc1_experts_weights [E, F*I, H] (F = 2 for a fused SwiGLU, else 1); fc1_experts_bias [E, F*I];
fc2_experts_weights [E, H, I]; fc2_experts_bias [E, H]; fc3_experts_weights [E, I, H] and
fc3_experts_bias [E, I] (the SwiGLU up projection when swiglu_fusion=0).
Attributes: k, activation_type (relu, gelu, silu, identity, swiglu), normalize_routing_weights,
activation_alpha, activation_beta, swiglu_fusion, swiglu_limit; use_sparse_mixer and
swiglu_limit_after_activation are refused (core.opdefs.moe_unsupported).
Routing, activations and the rank-order mix: ops._moe (fp32; the output rounded to the input
dtype). The transposed fp32 weights are cached per node for read-only (constant) inputs.
Bad shapes raise ValueError. Source: ORT contrib_ops/cpu/moe/moe_cpu.cc, moe_utils.cc and the
contrib op schema (onnxruntime 1.32).
"""

import numpy as np

from core.opdefs import moe_unsupported
from core.ops import run_memos
from providers.cpu_reference.ops._moe import Activation, Experts, expert_bias, mix, route, token_rows
from providers.cpu_reference.ops._out import write

OP_TYPE = "MoE"
DOMAIN = "com.microsoft"


def supports(node) -> bool:
    return not moe_unsupported(node)


def support_reason(node) -> str | None:
    return "; ".join(moe_unsupported(node)) or None


def _transposed(w, name: str, ndim_shape: tuple[int | None, ...]) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim != 3 or any(want is not None and got != want for got, want in zip(w.shape, ndim_shape)):
        raise ValueError(f"MoE: {name} has shape {w.shape}, expected {ndim_shape} (None: any)")
    return np.ascontiguousarray(np.swapaxes(w.astype(np.float32), 1, 2))


def experts_of(ctx, fc1, b1, fc2, b2, fc3, b3, hidden: int) -> Experts:
    """The fp32 experts of a MoE node; cached while the same read-only arrays come back.

    Raises:
        ValueError: weight or bias shapes that do not fit each other or ``hidden``.
    """
    parts = (fc1, b1, fc2, b2, fc3, b3)
    constant = all(x is None or (isinstance(x, np.ndarray) and not x.flags.writeable) for x in parts)
    hit = run_memos(ctx).get("experts")
    if constant and hit is not None and all(x is y for x, y in zip(hit[0], parts)):
        return hit[1]
    w1 = _transposed(fc1, "fc1_experts_weights", (None, None, hidden))
    e, f_i = w1.shape[0], w1.shape[2]
    w2 = _transposed(fc2, "fc2_experts_weights", (e, hidden, None))
    inter = w2.shape[1]
    w3 = None if fc3 is None else _transposed(fc3, "fc3_experts_weights", (e, inter, hidden))
    if f_i not in (inter, 2 * inter):
        raise ValueError(f"MoE: fc1 has {f_i} outputs for an inter size of {inter}")
    experts = Experts(w1, w2, w3, expert_bias(b1, "fc1_experts_bias", (e, f_i)),
                      expert_bias(b2, "fc2_experts_bias", (e, hidden)),
                      expert_bias(b3, "fc3_experts_bias", (e, inter)))
    if constant:
        run_memos(ctx)["experts"] = (parts, experts)
    return experts


def run(ctx, x, router_probs, fc1, b1=None, fc2=None, b2=None, fc3=None, b3=None):
    attrs = ctx.node.attrs
    x = np.asarray(x)
    experts = experts_of(ctx, fc1, b1, fc2, b2, fc3, b3, x.shape[-1])
    act = Activation.of(attrs)
    if act.kind == "swiglu" and act.fusion and experts.fc1.shape[2] != 2 * experts.fc2.shape[1]:
        raise ValueError("MoE: a fused SwiGLU needs 2 * inter_size fc1 outputs")
    rows, router = token_rows(x, router_probs, experts.fc1.shape[0])
    routing = route(router, int(attrs.get("k", 1)), bool(attrs.get("normalize_routing_weights", 0)))
    pager = getattr(ctx.provider, "expert_residency", None)
    return (write(ctx, 0, mix(rows, routing, experts, act, pager, ctx.node.name).reshape(x.shape), x.dtype),)

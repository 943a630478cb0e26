"""lockstep.RMSNormMatMul (core.fusion): a projection (MatMul, MatMulNBits, SiluGatedMatMul or
SiluGatedMatMulNBits) of an RMSNorm's output (SkipSimplifiedLayerNormalization, or
SimplifiedLayerNormalization over the last axis), with the norm's other outputs.

Computed as exactly its two parts (core.fusion.run_parts) with this provider's own kernels, so
a fused graph is bitwise the unfused one.
"""

from core import fusion
from providers.cpu_reference.ops import (
    matmul,
    matmul_nbits,
    silu_gated_matmul,
    silu_gated_matmul_nbits,
    simplified_layer_normalization,
    skip_simplified_layer_normalization,
)

OP_TYPE = "RMSNormMatMul"
DOMAIN = "lockstep"
MODULES = {(m.DOMAIN if hasattr(m, "DOMAIN") else "", m.OP_TYPE): m
           for m in (matmul, matmul_nbits, silu_gated_matmul, silu_gated_matmul_nbits,
                     simplified_layer_normalization, skip_simplified_layer_normalization)}


def supports(node) -> bool:
    """Both parts are supported by their own modules."""
    return all(_supports(part) for part in (fusion.norm_part(node), fusion.consumer_part(node)))


def _supports(part) -> bool:
    module = MODULES.get((part.domain, part.op_type))
    check = getattr(module, "supports", None)
    return module is not None and (check is None or bool(check(part)))


def prepare(ctx, x, skip, gamma, bias, *weights):
    """The projection's own plan-time hook, if it has one (core.fusion.prepare_parts)."""
    return fusion.prepare_parts(ctx, MODULES, weights)


def run(ctx, x, skip, gamma, bias, *weights):
    return fusion.run_parts(ctx, MODULES, x, skip, gamma, bias, *weights)

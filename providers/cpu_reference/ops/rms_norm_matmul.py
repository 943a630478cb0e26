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
MODULES = fusion.part_modules(matmul, matmul_nbits, silu_gated_matmul, silu_gated_matmul_nbits,
                              simplified_layer_normalization, skip_simplified_layer_normalization)


def supports(node) -> bool:
    """Both parts are supported by their own modules."""
    return fusion.parts_supported(node, MODULES)


def prepare(ctx, x, skip, gamma, bias, *weights):
    """The projection's own plan-time hook, if it has one (core.fusion.prepare_parts)."""
    return fusion.prepare_parts(ctx, MODULES, weights)


def run(ctx, x, skip, gamma, bias, *weights):
    return fusion.run_parts(ctx, MODULES, x, skip, gamma, bias, *weights)

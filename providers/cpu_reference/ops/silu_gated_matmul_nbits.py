"""lockstep.SiluGatedMatMulNBits (core.fusion): Y = SiluMul(MatMulNBits(X, gate),
MatMulNBits(X, up)), with the MatMulNBits attributes (docs/ops.md 2) shared by both projections.

Inputs: X, B_gate, scales_gate, zero_points_gate (or absent), B_up, scales_up, zero_points_up.
Exactly the unfused sequence, so a fused graph is bitwise the unfused one.
"""

from providers.cpu_reference.ops import matmul_nbits, silu_mul
from providers.cpu_reference.ops._gated import gate_view, projections

OP_TYPE = "SiluGatedMatMulNBits"
DOMAIN = "lockstep"


def supports(node) -> bool:
    """The configurations MatMulNBits accepts (both projections share the attributes)."""
    return matmul_nbits.supports(gate_view(node))


def run(ctx, x, b_gate, scales_gate, zp_gate, b_up, scales_up, zp_up):
    gate_ctx, up_ctx = projections(ctx)
    (gate,) = matmul_nbits.run(gate_ctx, x, b_gate, scales_gate, zp_gate)
    (up,) = matmul_nbits.run(up_ctx, x, b_up, scales_up, zp_up)
    return silu_mul.run(ctx, gate, up)

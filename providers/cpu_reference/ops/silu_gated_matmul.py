"""lockstep.SiluGatedMatMul (core.fusion): Y = SiluMul(X @ W_gate, X @ W_up).

Exactly the unfused MatMul, MatMul, SiluMul sequence (each product rounded to the input dtype,
then SiluMul's own roundings), so a fused graph is bitwise the unfused one.
"""

from providers.cpu_reference.ops import matmul, silu_mul
from providers.cpu_reference.ops._gated import projections

OP_TYPE = "SiluGatedMatMul"
DOMAIN = "lockstep"


def run(ctx, x, w_gate, w_up):
    gate_ctx, up_ctx = projections(ctx)
    (gate,) = matmul.run(gate_ctx, x, w_gate)
    (up,) = matmul.run(up_ctx, x, w_up)
    return silu_mul.run(ctx, gate, up)

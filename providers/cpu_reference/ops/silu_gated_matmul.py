"""lockstep.SiluGatedMatMul (core.fusion): Y = SiluMul(X @ W_gate, X @ W_up).

Exactly the unfused MatMul, MatMul, SiluMul sequence (each product rounded to the input dtype,
then SiluMul's own roundings), so a fused graph is bitwise the unfused one.
"""

import numpy as np

from providers.cpu_reference.ops import matmul, silu_mul

OP_TYPE = "SiluGatedMatMul"
DOMAIN = "lockstep"


def run(ctx, x, w_gate, w_up):
    dtype = np.asarray(x).dtype
    gate = matmul.product(ctx, x, w_gate, "gate").astype(dtype)
    up = matmul.product(ctx, x, w_up, "up").astype(dtype)
    return silu_mul.run(ctx, gate, up)

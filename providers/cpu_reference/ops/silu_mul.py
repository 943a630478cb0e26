"""lockstep.SiluMul (core.fusion): Y = (X * Sigmoid(X)) * UP, the builder's SiLU-gated MLP.

Exactly the unfused Sigmoid, Mul, Mul sequence, rounded to the input dtype after each op
(fp16 computed in fp32), so a fused graph is bitwise the unfused one.
"""

from providers.cpu_reference.ops import mul, sigmoid

OP_TYPE = "SiluMul"
DOMAIN = "lockstep"


def run(ctx, x, up):
    (s,) = sigmoid.run(ctx, x)
    (g,) = mul.run(ctx, x, s)
    return mul.run(ctx, g, up)

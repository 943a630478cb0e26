"""lockstep.SiluMul (core.fusion): Y = (X * Sigmoid(X)) * UP, the builder's SiLU-gated MLP.

Exactly the unfused Sigmoid, Mul, Mul sequence, rounded to the input dtype after each op
(fp16 computed in fp32), so a fused graph is bitwise the unfused one.
"""

import numpy as np

from providers.cpu_reference.ops._out import write_elementwise
from providers.cpu_reference.ops._util import elementwise
from providers.cpu_reference.ops.sigmoid import sigmoid

OP_TYPE = "SiluMul"
DOMAIN = "lockstep"


def run(ctx, x, up):
    g = elementwise(np.multiply, x, elementwise(sigmoid, x))
    return (write_elementwise(ctx, np.multiply, g, up),)

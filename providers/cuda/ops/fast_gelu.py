"""FastGelu (com.microsoft): GELU_tanh(x + bias), bias optional, fp32 math rounded to fp16/fp32.

kernels/activation.cu; no reduction. Source: ORT contrib op FastGelu (docs/ops.md 5).
"""

from providers.cuda.ops import device_array
from providers.cuda.ops._activation import GELU_TANH, launch, supports_float

OP_TYPE = "FastGelu"
DOMAIN = "com.microsoft"


def supports(node) -> bool:
    return supports_float(node)


def run(ctx, x, bias=None):
    if bias is not None:
        bias = device_array(ctx, bias, "bias", x.dtype)
    return launch(ctx, x, GELU_TANH, bias)

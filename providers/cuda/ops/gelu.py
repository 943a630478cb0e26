"""Gelu (ONNX, opset 20): approximate "none" (erf) or "tanh", fp32 math rounded to fp16/fp32.

kernels/activation.cu; no reduction. Source: ONNX Gelu-20 (docs/ops.md 5).
"""

from providers.cuda.ops._activation import GELU, GELU_TANH, launch, supports_float

OP_TYPE = "Gelu"
DOMAIN = ""


def supports(node) -> bool:
    return str(node.attrs.get("approximate", "none")) in ("none", "tanh") and supports_float(node)


def run(ctx, x):
    return launch(ctx, x, GELU_TANH if str(ctx.node.attrs.get("approximate", "none")) == "tanh" else GELU)

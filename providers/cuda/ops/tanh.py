"""Tanh (ONNX): tanhf in fp32, rounded to fp16/fp32 (Gemma 2's final logit soft-capping).

kernels/activation.cu; no reduction. Source: ONNX Tanh-13.
"""

from providers.cuda.ops._activation import TANH, launch, supports_float

OP_TYPE = "Tanh"
DOMAIN = ""


def supports(node) -> bool:
    return supports_float(node)


def run(ctx, x):
    return launch(ctx, x, TANH)

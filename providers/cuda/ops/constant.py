"""Constant (ONNX): a host value (core.opdefs). Declared here so the provider supports it; the
core folds Constant nodes at plan time on the host kernel (core.executor). ONNX Constant-21."""

from core.opdefs import constant_supports, constant_value

OP_TYPE = "Constant"
DOMAIN = ""
supports = constant_supports


def run(ctx, *_):
    return (constant_value(ctx.node),)

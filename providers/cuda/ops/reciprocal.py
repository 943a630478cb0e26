"""Reciprocal (ONNX, default domain): y = 1 / x (correctly rounded; 1/0 = inf), fp16/fp32, computed in fp32
and rounded once to the input dtype; kernels/router.cu ``unary`` (no reduction:
batch-invariant). Source: ONNX Reciprocal-13."""

from providers.cuda.ops import _router

OP_TYPE = "Reciprocal"
DOMAIN = ""


def support_reason(node) -> str | None:
    return _router.floats_only(node)



def run(ctx, x):
    return _router.unary(ctx, x, _router.RECIPROCAL)

"""Log (ONNX, default domain): y = ln(x) (logf; log 0 = -inf, negative inputs NaN), fp16/fp32, computed in fp32
and rounded once to the input dtype; kernels/router.cu ``unary`` (no reduction:
batch-invariant). Source: ONNX Log-13."""

from providers.cuda.ops import _router

OP_TYPE = "Log"
DOMAIN = ""


def support_reason(node) -> str | None:
    return _router.floats_only(node)



def run(ctx, x):
    return _router.unary(ctx, x, _router.LOG)

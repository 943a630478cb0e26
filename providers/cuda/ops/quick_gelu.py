"""QuickGelu (com.microsoft): x * sigmoid(alpha x), alpha default 1.702; fp32 math, rounded.

kernels/activation.cu; no reduction. Source: ORT contrib op QuickGelu (docs/ops.md 5).
"""

from providers.cuda.ops._activation import QUICK_GELU, launch, supports_float

OP_TYPE = "QuickGelu"
DOMAIN = "com.microsoft"


def supports(node) -> bool:
    return supports_float(node)


def run(ctx, x):
    return launch(ctx, x, QUICK_GELU, alpha=float(ctx.node.attrs.get("alpha", 1.702)))

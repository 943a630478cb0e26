"""Gelu (ONNX, default domain, opset 20): Y = GELU(X), ``approximate`` "none" (erf) or "tanh".

fp32 and fp16 (computed in fp32). The builder writes ``gelu`` as approximate "none" and
``gelu_pytorch_tanh`` / ``gelu_new`` / ``gelu_fast`` (Gemma's MLP activation) as "tanh"
(docs/ops.md 5). Source: ONNX Gelu-20.
"""

import numpy as np

from providers.cpu_reference.ops._gelu import gelu_exact, gelu_tanh
from providers.cpu_reference.ops._out import write

OP_TYPE = "Gelu"
DOMAIN = ""


def supports(node) -> bool:
    dtype = node.input_dtypes[0] if node.input_dtypes else None
    return (str(node.attrs.get("approximate", "none")) in ("none", "tanh")
            and (dtype is None or dtype in (np.float32, np.float16)))


def support_reason(node) -> str | None:
    approximate = str(node.attrs.get("approximate", "none"))
    if approximate not in ("none", "tanh"):
        return f"Gelu approximate={approximate!r} (only 'none' and 'tanh' exist)"
    return None


def run(ctx, x):
    x = np.asarray(x)
    fn = gelu_tanh if str(ctx.node.attrs.get("approximate", "none")) == "tanh" else gelu_exact
    return (write(ctx, 0, fn(x.astype(np.float32)), x.dtype),)

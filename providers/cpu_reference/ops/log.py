"""Log (ONNX, default domain): Y = ln(X), float dtypes (fp16 computed in fp32; log 0 = -inf,
negative inputs NaN, as ORT). ONNX Log-13."""

import numpy as np

from providers.cpu_reference.ops._out import write_elementwise

OP_TYPE = "Log"
DOMAIN = ""


def run(ctx, x):
    with np.errstate(divide="ignore", invalid="ignore"):
        return (write_elementwise(ctx, np.log, x),)

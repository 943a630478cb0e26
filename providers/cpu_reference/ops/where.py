"""Where (ONNX, default domain): Y = condition ? X : Y with broadcasting (a pure selection).

Source: ONNX Where-16.
"""

import numpy as np

from providers.cpu_reference.ops._out import write

OP_TYPE = "Where"
DOMAIN = ""


def run(ctx, condition, x, y):
    return (write(ctx, 0, np.where(np.asarray(condition, dtype=bool), x, y)),)

"""Where (ONNX, default domain): Y = condition ? X : Y with broadcasting (a pure selection).

Source: ONNX Where-16.
"""

import numpy as np

OP_TYPE = "Where"
DOMAIN = ""


def run(ctx, condition, x, y):
    return (np.where(np.asarray(condition, dtype=bool), x, y),)

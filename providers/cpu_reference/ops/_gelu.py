"""GELU formulas shared by Gelu, FastGelu and QuickGelu (no OP_TYPE: not an op).

Every formula takes and returns fp32 (fp16 inputs are computed in fp32 and rounded at the op
output, docs/ops.md 5):

- exact: 0.5 x (1 + erf(x / sqrt 2)), erf from ``math.erf`` (correctly rounded in fp64);
- tanh: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)));
- quick: x sigmoid(alpha x).
"""

from __future__ import annotations

import math

import numpy as np

SQRT_2_OVER_PI = np.float32(math.sqrt(2.0 / math.pi))
TANH_CUBIC = np.float32(0.044715)
_ERF = np.frompyfunc(math.erf, 1, 1)


def gelu_exact(x: np.ndarray) -> np.ndarray:
    """0.5 x (1 + erf(x / sqrt 2)) of an fp32 array (erf in fp64, rounded to fp32)."""
    erf = np.asarray(_ERF(x.astype(np.float64) / math.sqrt(2.0))).astype(np.float64).astype(np.float32)
    return (np.float32(0.5) * x * (np.float32(1.0) + erf)).astype(np.float32)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) of an fp32 array, in fp32."""
    inner = SQRT_2_OVER_PI * (x + TANH_CUBIC * x * x * x)
    return (np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))).astype(np.float32)


def gelu_quick(x: np.ndarray, alpha: float) -> np.ndarray:
    """x sigmoid(alpha x) of an fp32 array, in fp32."""
    with np.errstate(over="ignore"):
        return (x / (np.float32(1.0) + np.exp(-np.float32(alpha) * x))).astype(np.float32)

"""MatMul (ONNX, default domain): numpy-style matrix product, every output row reduced alone.

A [..., M, K] @ B [..., K, N] (1-D operands promoted and the added dim removed, as numpy).
Each row of A is multiplied by its matrix as a separate vector-matrix product, so a row's
result does not depend on M or the batch (ops.rowwise_matmul). fp16 computed in fp32 and
rounded at the output. Source: ONNX MatMul-13.
"""

import numpy as np

from providers.cpu_reference.ops import rowwise_matmul
from providers.cpu_reference.ops._out import buffer, write
from providers.cpu_reference.ops._util import as_compute

OP_TYPE = "MatMul"
DOMAIN = ""


def product(ctx, a, b, key: str = "") -> np.ndarray:
    """A @ B in the compute dtype (fp32 for fp16 inputs), not yet rounded; a read-only B is
    converted once and cached under ``key`` (several products on one context use several keys)."""
    a, b = as_compute(ctx, np.asarray(a), f"{key}a"), as_compute(ctx, np.asarray(b), f"{key}b")
    if b.ndim == 1:
        return rowwise_matmul(a, b[:, None])[..., 0]
    if b.ndim == 2:
        return rowwise_matmul(a, b)
    if a.ndim == 1:
        return np.matmul(a[None, None, :], b)[..., 0, :]
    return np.matmul(a[..., :, None, :], b[..., None, :, :])[..., 0, :]


def run(ctx, a, b):
    a, b = np.asarray(a), np.asarray(b)
    if b.ndim == 2 and a.dtype == b.dtype == np.float32:  # the product lands in the buffer directly
        return (rowwise_matmul(a, b, out=buffer(ctx, 0, (*a.shape[:-1], b.shape[1]), a.dtype)),)
    return (write(ctx, 0, product(ctx, a, b), a.dtype),)

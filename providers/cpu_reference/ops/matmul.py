"""MatMul (ONNX, default domain): numpy-style matrix product, every output row reduced alone.

A [..., M, K] @ B [..., K, N] (1-D operands promoted and the added dim removed, as numpy).
Each row of A is multiplied by its matrix as a separate vector-matrix product, so a row's
result does not depend on M or the batch (ops.rowwise_matmul). fp16 computed in fp32 and
rounded at the output. Source: ONNX MatMul-13.
"""

import numpy as np

from providers.cpu_reference.ops import rowwise_matmul
from providers.cpu_reference.ops._util import as_compute

OP_TYPE = "MatMul"
DOMAIN = ""


def run(ctx, a, b):
    a, b = np.asarray(a), np.asarray(b)
    dtype = a.dtype
    a, b = as_compute(ctx, a, "a"), as_compute(ctx, b, "b")
    if b.ndim == 1:
        return (rowwise_matmul(a, b[:, None])[..., 0].astype(dtype),)
    if b.ndim == 2:
        return (rowwise_matmul(a, b).astype(dtype),)
    if a.ndim == 1:
        return (np.matmul(a[None, None, :], b)[..., 0, :].astype(dtype),)
    return (np.matmul(a[..., :, None, :], b[..., None, :, :])[..., 0, :].astype(dtype),)

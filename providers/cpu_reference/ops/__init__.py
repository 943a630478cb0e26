"""One module per ONNX op, collected by :class:`core.ops.OpTable` (introspection, no hand list).

Each module defines:
    OP_TYPE: the ONNX op type; DOMAIN: "" or "com.microsoft" (default "");
    run(ctx, *inputs) -> tuple of outputs (one per declared node output), each written into
        the node's persistent buffer ``ctx.output(slot, shape, dtype)`` and returned (ops._out);
    optionally supports(node) -> bool for attribute/dtype checks (default: True), and
        support_reason(node) -> str | None saying why not (core.ops.OpTable.support_reason).

Kernels compute every batch row independently of the others with a fixed reduction order per
row, so a row's result never depends on what else is in the batch. Matrix products therefore
go through :func:`rowwise_matmul` (one vector-matrix product per row; a plain 2-D GEMM lets
BLAS pick a blocking by M and is not row-invariant).
"""

from __future__ import annotations

import numpy as np


def rowwise_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x @ w`` for x ``[..., K]`` and a 2-D ``w`` ``[K, N]`` with every row reduced alone.

    numpy's stacked matmul over ``[M, 1, K]`` runs one identical vector-matrix product per row,
    so row i's result is the same bits whatever M is (checked in tests/unit). ``out``: a
    C-contiguous ``[..., N]`` array of the product's dtype to write into (and return).
    """
    flat = x.reshape(-1, 1, x.shape[-1])
    if out is not None:
        np.matmul(flat, w, out=out.reshape(-1, 1, w.shape[-1]))
        return out
    return np.matmul(flat, w)[:, 0, :].reshape(*x.shape[:-1], w.shape[-1])

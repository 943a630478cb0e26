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

from core.runtime.rowblocks import ROW_ALIGN


def rowwise_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x @ w`` for x ``[..., K]`` and a 2-D ``w`` ``[K, N]`` with every row reduced alone.

    numpy's stacked matmul over ``[M, 1, K]`` runs one identical vector-matrix product per row,
    so row i's result is the same bits whatever M is (checked in tests/unit). The columns run
    in fixed chunks of :data:`core.runtime.rowblocks.ROW_ALIGN` (BLAS blocks a product by N,
    and its tail columns are reduced differently), so an element's bits do not depend on N
    either: a row block of the weight (a streamed page) gives the whole product's bits.
    ``out``: a C-contiguous ``[..., N]`` array of the product's dtype to write into (and return).
    """
    flat = x.reshape(-1, 1, x.shape[-1])
    n = w.shape[-1]
    if out is None:
        out = np.empty((*x.shape[:-1], n), np.result_type(x, w))
    dst = out.reshape(-1, 1, n)
    for a in np.arange(0, n, ROW_ALIGN).tolist():  # not range: the Range op module shadows it here
        np.matmul(flat, w[:, a:a + ROW_ALIGN], out=dst[..., a:a + ROW_ALIGN])
    return out

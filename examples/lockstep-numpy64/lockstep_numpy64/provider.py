"""The numpy64 provider: host NumPy tensors, float64 accumulation in matmuls and norms.

What it shows (docs/providers.md walks through it):

- ``capabilities()``: dtypes, KV layouts, and "no capture" (``graph_capture=False``; the
  provider then has no ``begin_capture``/``end_capture``/``replay`` and the core never asks);
- ``supports()`` / ``kernel()``: its own kernels for MatMul, MatMulNBits,
  SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization, and the cpu_reference
  kernels for every other op (their public ``run`` functions); it declines the fused gated
  projections (``lockstep.SiluGatedMatMul``, ``lockstep.SiluGatedMatMulNBits``: cpu_reference
  runs them with fp32 products, not this provider's float64 ones), so the core keeps those
  chains unfused for it, and says why in ``support_reason()``;
- kernels that write into persistent buffers from ``ctx.output`` (what graph capture needs);
- ``device_argmax`` with the shared policy (lowest index on ties, a non-finite row flagged as
  ``[-1, 1]``);
- everything else (decode_advance, kv_commit accounting, write/fill/copy_bytes, the upload
  counters) from the base class :class:`lockstep.provider.ProviderBase`.

Only the public protocol (``lockstep.protocol``, ``lockstep.provider``), the hook marker
(``lockstep.hookimpl``) and the cpu_reference op modules (``lockstep.providers.cpu_reference``)
are used, all through the ``lockstep`` import name, which a folder of the user's called
``core`` or ``providers`` cannot shadow. Every row is reduced alone (one vector-matrix product per
row), so a row's result does not depend on the batch: the kit's batch-invariance gate holds.
"""

from __future__ import annotations

import numpy as np

from lockstep.ops import OpTable
from lockstep.protocol import Capabilities, KernelContext, NodeInfo
from lockstep.provider import ProviderBase
from lockstep.providers.cpu_reference import ops as reference_ops
from lockstep.providers.cpu_reference.ops.matmul_nbits import dequantize


def _rows_matmul(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 ``a @ w`` for a [..., K] and w [K, N] or [..., K, N], one product per row."""
    a64 = np.asarray(a, np.float64)[..., None, :]          # [..., M, 1, K]
    w64 = np.asarray(w, np.float64)
    w64 = w64 if w64.ndim == 2 else w64[..., None, :, :]   # broadcast over the rows
    return np.matmul(a64, w64)[..., 0, :]


def _write(ctx: KernelContext, slot: int, value: np.ndarray, dtype) -> np.ndarray:
    """Round ``value`` into the node's persistent output buffer ``slot`` and return it."""
    out = ctx.output(slot, value.shape, dtype)
    out[...] = value
    return out


def matmul(ctx: KernelContext, a, b):
    """MatMul (ONNX): both operands at least 2-D; float64 accumulation, rounded to A's dtype."""
    if np.ndim(a) < 2 or np.ndim(b) < 2:
        raise ValueError(f"numpy64 MatMul needs operands of rank >= 2, got {np.ndim(a)} and {np.ndim(b)}")
    return (_write(ctx, 0, _rows_matmul(a, b), np.asarray(a).dtype),)


def matmul_nbits(ctx: KernelContext, a, b, scales, zero_points=None, g_idx=None, bias=None):
    """MatMulNBits (com.microsoft): dequantized once per node (cached), float64 product."""
    if g_idx is not None:
        raise ValueError("numpy64 MatMulNBits: g_idx is not supported")
    attrs = ctx.node.attrs
    w = ctx.cache.get("w")
    if w is None:
        w = ctx.cache["w"] = dequantize(b, scales, zero_points, int(attrs["K"]), int(attrs["N"]),
                                        int(attrs.get("bits", 4)), int(attrs["block_size"]))
    y = _rows_matmul(a, w)
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    return (_write(ctx, 0, y, np.asarray(a).dtype),)


def _rms(v: np.ndarray, eps: float) -> np.ndarray:
    return 1.0 / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)


def simplified_layer_norm(ctx: KernelContext, x, scale):
    """SimplifiedLayerNormalization over the last axis (the builder's axis=-1), in float64."""
    if int(ctx.node.attrs.get("axis", -1)) not in (-1, np.ndim(x) - 1):
        raise ValueError("numpy64 SimplifiedLayerNormalization: only the last axis")
    v = np.asarray(x, np.float64)
    inv = _rms(v, float(ctx.node.attrs.get("epsilon", 1e-5)))
    y = _write(ctx, 0, v * inv * np.asarray(scale, np.float64), np.asarray(scale).dtype)
    extra = _write(ctx, 1, inv, np.float32) if len(ctx.node.outputs) > 1 and ctx.node.outputs[1] else None
    return (y, extra)


def skip_simplified_layer_norm(ctx: KernelContext, x, skip, gamma, bias=None):
    """SkipSimplifiedLayerNormalization: v = x + skip (+ bias); outputs [y, mean, inv_std, v]."""
    x = np.asarray(x)
    v = x.astype(np.float64) + np.asarray(skip, np.float64)
    if bias is not None:
        v = v + np.asarray(bias, np.float64)
    inv = _rms(v, float(ctx.node.attrs.get("epsilon", 1e-12)))
    values = (v * inv * np.asarray(gamma, np.float64), np.zeros_like(inv), inv, v)
    dtypes = (x.dtype, np.float32, np.float32, x.dtype)
    names = ctx.node.outputs
    return tuple(_write(ctx, i, val, dt) if i < len(names) and names[i] else None
                 for i, (val, dt) in enumerate(zip(values, dtypes)))


#: (domain, op_type) -> kernel, for the ops this provider implements itself.
KERNELS = {
    ("", "MatMul"): matmul,
    ("com.microsoft", "MatMulNBits"): matmul_nbits,
    ("", "SimplifiedLayerNormalization"): simplified_layer_norm,
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): skip_simplified_layer_norm,
}


#: Fused ops (core.fusion) this provider declines, with the reason: cpu_reference's kernels
#: for them compute its own fp32 products, so a fused graph would not be bitwise this
#: provider's unfused MatMul / MatMulNBits chain (the fusion contract). Declined, the core
#: leaves the chain unfused and every projection runs on the float64 kernels above.
DECLINED = {
    ("lockstep", "SiluGatedMatMul"): "numpy64 declines lockstep.SiluGatedMatMul: cpu_reference's kernel "
                                     "computes fp32 products, not numpy64's float64 MatMul",
    ("lockstep", "SiluGatedMatMulNBits"): "numpy64 declines lockstep.SiluGatedMatMulNBits: cpu_reference's "
                                          "kernel computes fp32 products, not numpy64's float64 MatMulNBits",
}


class Numpy64Provider(ProviderBase):
    """NumPy tensors on the host, float64 accumulation; no graph capture, no VMM.

    It inherits :class:`core.provider.ProviderBase`: the validated public methods, the
    counters, io_binding, decode_advance, kv_commit accounting, write/fill/copy_bytes; it
    writes only the memory primitives (``_allocate``, ``_upload``, ``_download``) and kernels.
    """

    name = "numpy64"
    #: Conformance exclusions the kit applies to this provider: fnmatch pattern of a kit id
    #: ("op/<case>/<dtype>", "argmax/...", "gate/<name>") -> reason. None are needed.
    parity_exclusions: dict[str, str] = {}

    def __init__(self):
        super().__init__()
        self._reference = OpTable(reference_ops)

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float32", "float16"), graph_capture=False,
                            kv_layouts=("head_major", "seq_major"))

    def supports(self, node: NodeInfo) -> bool:
        if (node.domain, node.op_type) in DECLINED:
            return False
        if (node.domain, node.op_type) in KERNELS:
            return node.op_type != "MatMulNBits" or self._reference.supports(node)
        return self._reference.supports(node)

    def support_reason(self, node: NodeInfo) -> str | None:
        """Why :meth:`supports` rejects ``node`` (None when it accepts it): a declined fused
        op's reason, else what the cpu_reference op table says (``core.ops.OpTable``)."""
        declined = DECLINED.get((node.domain, node.op_type))
        if declined is not None:
            return declined
        if self.supports(node):
            return None
        return self._reference.support_reason(node)

    def kernel(self, node: NodeInfo):
        own = KERNELS.get((node.domain, node.op_type))
        return own if own is not None else self._reference.kernel(node)

    def _allocate(self, shape, dtype, zero) -> np.ndarray:
        return np.zeros(shape, dtype) if zero else np.empty(shape, dtype)

    def _upload(self, array: np.ndarray) -> np.ndarray:
        return np.array(array, copy=True)

    def _download(self, tensor: np.ndarray) -> np.ndarray:
        return np.array(tensor, copy=True)

    def device_argmax(self, logits: np.ndarray, positions: np.ndarray, result: np.ndarray) -> None:
        rows = logits[np.arange(logits.shape[0]), np.asarray(positions, np.int64)].astype(np.float64)
        bad = ~np.isfinite(rows).all(axis=-1)
        result[:, 0] = np.where(bad, -1, np.argmax(np.where(bad[:, None], 0.0, rows), axis=-1))
        result[:, 1] = bad

"""MatMulNBits (com.microsoft): Y = A @ dequant(B)^T (+ bias), docs/ops.md 2.

Inputs: A [..., K] (fp32/fp16); B uint8 [N, n_blocks, blob] (n_blocks = ceil(K/block_size),
blob = block_size*bits/8); scales [N, n_blocks] or flat [N*n_blocks] (fp32/fp16);
zero_points optional: uint8 packed [N, ceil(n_blocks*bits/8)] or float [N, n_blocks];
g_idx (input 4) is not supported; bias [N] optional (input 5).
Attributes: K, N, bits (2/4/8, default 4), block_size (power of 2, >= 16), accuracy_level
(ignored: this kernel is always exact fp32; ORT's level 4 is an int8 approximation),
weight_prepacked (must be 0).
Dequantization, for k in block b = k div block_size: W[n, k] = (q - zp) * scales[n, b], with
the LSB-first codes of ops._quant, zp = 2^(bits-1) when absent, codes k >= K ignored.
The dequantized fp32 weight [K, N] is cached per node for read-only (constant) B/scales/zp.
Y is fp32-accumulated row by row (ops.rowwise_matmul) and rounded to A's dtype, written into
the node's output buffer ``ctx.output(0, ...)`` (ops._out).
An unsupported configuration raises ValueError (never zeros). Source: ORT
contrib_ops/cpu/quantization/matmul_nbits.cc, matmul_nbits_impl.cc.
"""

import numpy as np

from core.opdefs import matmul_nbits_supports
from core.ops import run_memos
from providers.cpu_reference.ops import rowwise_matmul
from providers.cpu_reference.ops._out import buffer, write
from providers.cpu_reference.ops._quant import unpack

OP_TYPE = "MatMulNBits"
DOMAIN = "com.microsoft"
supports = matmul_nbits_supports  # the configurations above (core.opdefs)


def dequantize(b, scales, zero_points, k: int, n: int, bits: int, block_size: int) -> np.ndarray:
    """The fp32 weight W^T [K, N] of a MatMulNBits node; raises ValueError on bad shapes."""
    if bits not in (2, 4, 8) or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"MatMulNBits: unsupported bits={bits} block_size={block_size}")
    n_blocks = -(-k // block_size)
    blob = block_size * bits // 8
    b = np.asarray(b)
    if b.size == 0 or b.size != n * n_blocks * blob:
        raise ValueError(f"MatMulNBits: B has shape {b.shape}, expected {(n, n_blocks, blob)}")
    codes = unpack(b.reshape(n, n_blocks, blob), bits, block_size).astype(np.float32)
    scales = np.asarray(scales)
    if scales.size != n * n_blocks or scales.dtype.kind != "f":
        raise ValueError(f"MatMulNBits: scales {scales.dtype}{scales.shape}, expected {(n, n_blocks)}")
    scales = scales.astype(np.float32).reshape(n, n_blocks)
    if zero_points is None:
        zp = np.full((n, n_blocks), float(1 << (bits - 1)), np.float32)
    else:
        zero_points = np.asarray(zero_points)
        if zero_points.dtype == np.uint8:
            zp = unpack(zero_points.reshape(n, -1), bits, n_blocks).astype(np.float32)
        elif zero_points.dtype.kind == "f" and zero_points.size == n * n_blocks:
            zp = zero_points.astype(np.float32).reshape(n, n_blocks)
        else:
            raise ValueError(f"MatMulNBits: zero_points {zero_points.dtype}{zero_points.shape}")
    w = (codes - zp[:, :, None]) * scales[:, :, None]  # [N, n_blocks, block_size]
    return np.ascontiguousarray(w.reshape(n, n_blocks * block_size)[:, :k].T)


def _weight(ctx, b, scales, zero_points, k: int, n: int) -> np.ndarray:
    """The dequantized weight; cached per node while the same read-only arrays come back (plan
    constants are frozen read-only; a writable input, e.g. a streaming slot whose contents
    change in place, is dequantized on every call)."""
    attrs = ctx.node.attrs
    parts = (b, scales, zero_points)
    constant = all(x is None or (isinstance(x, np.ndarray) and not x.flags.writeable) for x in parts)
    hit = run_memos(ctx).get("weight")
    if constant and hit is not None and all(x is y for x, y in zip(hit[0], parts)):
        return hit[1]
    w = dequantize(b, scales, zero_points, k, n, int(attrs.get("bits", 4)), int(attrs["block_size"]))
    if constant:
        run_memos(ctx)["weight"] = (parts, w)
    return w


def run(ctx, a, b, scales, zero_points=None, g_idx=None, bias=None):
    attrs = ctx.node.attrs
    if g_idx is not None:
        raise ValueError("MatMulNBits: g_idx is not supported")
    if attrs.get("weight_prepacked", 0):
        raise ValueError("MatMulNBits: weight_prepacked layouts are not supported")
    k, n = int(attrs["K"]), int(attrs["N"])
    a = np.asarray(a)
    if a.shape[-1] != k:
        raise ValueError(f"MatMulNBits: A last dim {a.shape[-1]} != K {k}")
    w = _weight(ctx, b, scales, zero_points, k, n)
    if a.dtype == np.float32:  # the fp32 product (and bias) land in the output buffer directly
        # contiguous as a.astype(np.float32) was: numpy's matmul loop depends on the strides
        y = rowwise_matmul(np.ascontiguousarray(a), w, out=buffer(ctx, 0, (*a.shape[:-1], n), a.dtype))
        if bias is not None:
            np.add(y, np.asarray(bias, dtype=np.float32), out=y)
        return (y,)
    y = rowwise_matmul(a.astype(np.float32), w)
    if bias is not None:
        y += np.asarray(bias, dtype=np.float32)
    return (write(ctx, 0, y, a.dtype),)

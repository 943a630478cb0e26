"""lockstep.RMSNormMatMul (core.fusion): a projection (MatMul, MatMulNBits, SiluGatedMatMul or
SiluGatedMatMulNBits) of an RMSNorm's output (SkipSimplifiedLayerNormalization, or
SimplifiedLayerNormalization over the last axis), with the norm's other outputs.

One launch where the projection runs on a tensor-core kernel (a dense fp16 MatMul or
SiluGatedMatMul with prepared weights, or, opt-in (:func:`int4_enabled`), an int4 MatMulNBits or
SiluGatedMatMulNBits with fp16 scales) and the call has one activation row (a batch-1 decode
step): the kernel's RMSNorm prologue (kernels/linear_mma.cu ``norm_rows``) computes the
normalised rows in shared memory with exactly kernels/rms_norm.cu's arithmetic and the blocks of
column 0 store the residual sum, so the result is bitwise the norm kernel followed by the
projection kernel. Everything else (more rows, fp32, a norm bias, a wanted mean or inv_std_var
output) runs the two parts in turn (core.fusion.run_parts): the same bits either way, so a row's
result never depends on the batch size. Measured on the H200 (docs/benchmarks/kernels.md
sections 2, 8 and 13), the prologue beat the separate norm launch only for one row of dense fp16
activations, and no longer does since ``rms_norm_h8``: the pass is opt-in (:func:`enabled`).
"""

import numpy as np

from core import fusion
from providers.cuda import env
from providers.cuda.ops import (
    NULL,
    _mma,
    matmul,
    matmul_nbits,
    silu_gated_matmul,
    silu_gated_matmul_nbits,
    simplified_layer_normalization,
    skip_simplified_layer_normalization,
)

OP_TYPE = "RMSNormMatMul"
DOMAIN = "lockstep"
MODULES = fusion.part_modules(matmul, matmul_nbits, silu_gated_matmul, silu_gated_matmul_nbits,
                              simplified_layer_normalization, skip_simplified_layer_normalization)
#: Projections the one-launch path serves: dense fp16 and int4.
DENSE = ("MatMul", "SiluGatedMatMul")
INT4 = ("MatMulNBits", "SiluGatedMatMulNBits")
#: Node calls that took the one-launch path (read by the GPU tests: the fused path ran).
counts = {"fused_launches": 0, "two_part_runs": 0}


def enabled() -> bool:
    """Whether the pass runs on cuda (LOCKSTEP_CUDA_NORM_FUSION, default off; off, every norm and
    projection stay apart). Measured on the H200 since the norm kernel loads in one round trip
    (docs/benchmarks/kernels.md section 13), the norm launch and the pipelined projection apart beat
    the one-launch path at batch 1: SmolLM2-135M fp16 1,176 -> 1,298 tok/s, Llama-3.2-1B fp16 894
    -> 1,001."""
    return env.switch("LOCKSTEP_CUDA_NORM_FUSION")


def int4_enabled() -> bool:
    """Whether int4 projections join the pass (LOCKSTEP_CUDA_NORM_FUSION_INT4, default off):
    measured on the H200 (docs/benchmarks/kernels.md section 8) the int4 kernel with the
    prologue was slower at batch 1 than the norm launch and the projection apart."""
    return env.switch("LOCKSTEP_CUDA_NORM_FUSION_INT4")


def supports(node) -> bool:
    """A dense projection (:data:`DENSE`), or an int4 one (:data:`INT4`) where
    :func:`int4_enabled`, of fp16 activations whose two parts are supported by their own
    modules, unless the fusion is turned off (:func:`enabled`)."""
    consumer = node.attrs.get("consumer")
    if not enabled() or not (consumer in DENSE or (consumer in INT4 and int4_enabled())):
        return False
    known = [d for d in (node.input_dtypes or ())[:3] if d is not None]
    if not known or any(d != np.float16 for d in known):
        return False  # fp32 never takes the one-launch path
    return fusion.parts_supported(node, MODULES)


def prepare(ctx, x, skip, gamma, bias, *weights):
    """The projection's own plan-time hook (core.fusion.prepare_parts): packed or interleaved
    weights, recorded in the shared ctx.cache under the projection module's key."""
    return fusion.prepare_parts(ctx, MODULES, weights)


def run(ctx, x, skip, gamma, bias, *weights):
    done = _fused(ctx, x, skip, gamma, bias, weights)
    if done is not None:
        counts["fused_launches"] += 1
        return done
    counts["two_part_runs"] += 1
    return fusion.run_parts(ctx, MODULES, x, skip, gamma, bias, *weights)


def _fused(ctx, x, skip, gamma, bias, weights):
    """The one-launch path (module docstring) for this call, or None where it does not apply:
    the projection not on a tensor-core kernel, more than one row, a norm bias, a wanted mean or
    inv_std_var, or operands of another dtype or layout."""
    names = list(ctx.node.outputs) + [""] * 4
    k = x.shape[-1]
    m = x.size // k if k else 0
    if (bias is not None or names[1] or names[2] or gamma.dtype != np.float16 or gamma.size != k
            or not _mma.norm_applies(x, k, m)):
        return None
    if skip is not None and (skip.shape != x.shape or skip.dtype != np.float16 or not skip.flags.c_contiguous):
        return None
    consumer = ctx.node.attrs["consumer"]
    found = _dense_launch(ctx, k, weights) if consumer in DENSE else _int4_launch(ctx, x, weights)
    if found is None:
        return None
    n, launch = found
    total = ctx.output(3, x.shape, x.dtype) if names[3] else None
    norm = _mma.Norm(skip, gamma, total, float(ctx.node.attrs[fusion.NORM_EPSILON]))
    y = ctx.output(0, (*x.shape[:-1], n), x.dtype)
    launch(x, y, m, norm)
    return (y, None, None, total)[:len(ctx.node.outputs)]


def _dense_launch(ctx, k: int, weights):
    """(N, launch(x, y, m, norm)) of a dense projection whose weight prepare() packed, else None."""
    prepared = ctx.cache.get(_mma.PREPARED)  # (K, N) of the packed dense weight
    if prepared is None or prepared[0] != k:
        return None
    n, glu = prepared[1], ctx.node.attrs["consumer"] == "SiluGatedMatMul"
    return n, lambda x, y, m, norm: _mma.dense(x, weights[0], None, y, m, n, k, NULL, glu=glu, norm=norm)


def _int4_launch(ctx, x, weights):
    """(N, launch(x, y, m, norm)) of an int4 projection on the tensor-core kernel with fp16
    scales and prepared (packed) weights (MatMulNBits without g_idx or bias; SiluGatedMatMulNBits
    with its gate/up pair interleaved), else None (the two parts then run, and raise on bad
    inputs)."""
    attrs, k = ctx.node.attrs, x.shape[-1]
    if attrs["consumer"] == "SiluGatedMatMulNBits":
        prepared = ctx.cache.get(silu_gated_matmul_nbits.PREPARED)
        if prepared is None or prepared[0] != k or weights[1].dtype != np.float16:
            return None
        n, bs = prepared[1:]
        w = _mma.Int4Weights(weights[0], weights[1], weights[2], _mma.glu_width(n), k, bs)
        return n, lambda x, y, m, norm: _mma.nbits4(x, w, None, y, m, NULL, glu_out=n, norm=norm)
    b, s, z, g_idx, proj_bias = (list(weights) + [None] * 5)[:5]
    prepared = ctx.cache.get(_mma.INT4_PREPARED)
    if prepared is None or prepared[0] != k or g_idx is not None or proj_bias is not None or s.dtype != np.float16:
        return None
    n, bs = prepared[1:]
    w = _mma.Int4Weights(b, s, z, n, k, bs)
    return n, lambda x, y, m, norm: _mma.nbits4(x, w, None, y, m, NULL, norm=norm)

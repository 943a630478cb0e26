"""lockstep.MatMulRMSNorm (core.fusion): a projection (MatMul or MatMulNBits) whose output feeds
only a SkipSimplifiedLayerNormalization, with the norm's outputs: the o_proj with the
post-attention norm, and the down projection with the next layer's input norm (or the final norm).

One launch where the projection runs on a tensor-core row kernel (a dense fp16 MatMul with a
prepared weight, or an int4 MatMulNBits with fp16 scales) for 1 to ``_mma.POST_ROWS`` rows (decode
steps up to batch 16): every block stores its output tile, and the last block of each token block
to finish normalises those rows (kernels/linear_mma.cu ``post_norm``) with exactly the arithmetic
of kernels/rms_norm.cu. Everything else (more rows, fp32, a wanted mean or inv_std_var, operands of
another layout) runs the two parts in turn (core.fusion.run_post_parts): the same bits either way,
so a row's result never depends on the batch size. What it saves is one dependent launch per norm,
two per layer (docs/benchmarks/kernels.md section 15). On by default; LOCKSTEP_CUDA_NORM_EPILOGUE=0
turns the pass off.
"""

import contextlib

import numpy as np

from core import fusion
from providers.cuda import env
from providers.cuda.ops import _mma, matmul, matmul_nbits, skip_simplified_layer_normalization

OP_TYPE = "MatMulRMSNorm"
DOMAIN = "lockstep"
MODULES = fusion.part_modules(matmul, matmul_nbits, skip_simplified_layer_normalization)
#: ctx.cache key of the node's post-norm tickets (int32 device zeros, _mma.POST_TICKETS).
TICKETS = "post_norm_tickets"
#: Node calls that took the one-launch path, and that ran the two parts (read by the GPU tests).
counts = {"fused_launches": 0, "two_part_runs": 0}


def enabled() -> bool:
    """Whether the pass runs on cuda (LOCKSTEP_CUDA_NORM_EPILOGUE, default on)."""
    return env.switch("LOCKSTEP_CUDA_NORM_EPILOGUE")


def supports(node) -> bool:
    """A MatMul or MatMulNBits producer of fp16 activations whose two parts are supported by their
    own modules, unless the pass is turned off (:func:`enabled`)."""
    if not enabled() or node.attrs.get("producer") not in ("MatMul", "MatMulNBits"):
        return False
    known = [d for d in (node.input_dtypes or ())[:2] if d is not None]
    if not known or any(d != np.float16 for d in known):
        return False  # fp32 never takes the one-launch path
    return fusion.post_parts_supported(node, MODULES)


def _tickets(ctx):
    """The node's ticket array, allocated (zeroed) on first use; None while the context is frozen
    (a capture allocates nothing) and it does not exist yet."""
    tickets = ctx.cache.get(TICKETS)
    if tickets is None and not ctx.frozen:
        import cupy

        tickets = ctx.cache[TICKETS] = cupy.zeros(_mma.POST_TICKETS, np.int32)
    return tickets


def prepare(ctx, residual, gamma, bias, x, *weights):
    """The projection's own plan-time hook (core.fusion.prepare_parts: the packed dense weight),
    and the node's tickets."""
    # no CuPy or no device here (host-side planning): the tickets are made on first use instead
    with contextlib.suppress(Exception):
        _tickets(ctx)
    return fusion.prepare_parts(ctx, MODULES, weights)


def run(ctx, residual, gamma, bias, x, *weights):
    done = _fused(ctx, residual, gamma, bias, x, weights)
    if done is not None:
        counts["fused_launches"] += 1
        return done
    counts["two_part_runs"] += 1
    return fusion.run_post_parts(ctx, MODULES, residual, gamma, bias, x, *weights)


def _aligned(*arrays) -> bool:
    return all(a is None or (a.flags.c_contiguous and a.data.ptr % 16 == 0) for a in arrays)


def _fused(ctx, residual, gamma, bias, x, weights):
    """The one-launch path (module docstring) for this call, or None where it does not apply."""
    names = list(ctx.node.outputs) + [""] * 4
    if bias is not None or names[1] or names[2] or x.dtype != np.float16 or x.ndim < 1 or not x.flags.c_contiguous:
        return None
    k = x.shape[-1]
    m = x.size // k if k else 0
    found = _dense_launch(ctx, k, weights) if ctx.node.attrs["producer"] == "MatMul" else _int4_launch(ctx, x, weights)
    if found is None:
        return None
    n, launch = found
    shape = (*x.shape[:-1], n)
    if (not _mma.post_applies(m, n) or residual.shape != shape or residual.dtype != np.float16
            or gamma.dtype != np.float16 or gamma.shape != (n,) or not _aligned(residual, gamma)):
        return None
    tickets = _tickets(ctx)
    if tickets is None:
        return None
    y = ctx.output(fusion.PROJECTED, shape, x.dtype)
    out = ctx.output(0, shape, x.dtype)
    total = ctx.output(3, shape, x.dtype) if names[3] else None
    if not _aligned(y, out, total):
        return None
    launch(x, y, m, _mma.Post(residual, gamma, out, total, float(ctx.node.attrs[fusion.NORM_EPSILON]), tickets))
    return (out, None, None, total)[:len(ctx.node.outputs)]


def _dense_launch(ctx, k: int, weights):
    """(N, launch(x, y, m, post)) of a dense projection whose weight prepare() packed, else None."""
    prepared = ctx.cache.get(_mma.PREPARED)  # (K, N) of the packed dense weight
    if prepared is None or prepared[0] != k or len(weights) != 1:
        return None
    n = prepared[1]
    return n, lambda x, y, m, post: _mma.dense(x, weights[0], None, y, m, n, k, matmul.NULL, post=post)


def _int4_launch(ctx, x, weights):
    """(N, launch(x, y, m, post)) of an int4 MatMulNBits on the tensor-core row kernel with fp16
    scales and no g_idx or bias, else None (the two parts then run, and raise on bad inputs)."""
    b, s, z, g_idx, proj_bias = (list(weights) + [None] * 5)[:5]
    if g_idx is not None or proj_bias is not None or s is None or s.dtype != np.float16:
        return None
    producer = fusion.producer_part(ctx.node)
    try:
        k, n, bits, bs, nb = matmul_nbits.geometry(producer.attrs, x, b, s)
        zp, zp_mode, zp_stride = matmul_nbits.zero_point_mode(z, x.dtype, n, nb)
    except ValueError:
        return None
    if not matmul_nbits.uses_mma(x, bits, k, bs, zp_mode):
        return None
    return n, lambda x, y, m, post: _mma.nbits4(x, b, s, zp, zp_mode, zp_stride, None, y, m, n, k, bs, "__half",
                                                matmul_nbits.NULL, post=post)

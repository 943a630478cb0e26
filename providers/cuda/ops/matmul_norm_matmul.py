"""lockstep.MatMulNormMatMul (core.fusion): a MatMul, the SkipSimplifiedLayerNormalization of its
output, and the projection (MatMul or SiluGatedMatMul) of the normalised rows, with the norm's
residual sum as output 1.

The residual hand-off, for 1 to 16 rows (decode steps up to batch 16) of fp16 activations on
prepared dense weights with a normalised width of at most 1,024, where both launches run in one
wave (``_mma.residual_fits``): two launches instead of three
(kernels/linear_mma.cu RES_OUT, RES_IN). The first projection's epilogue stores its output, the
residual sum and each row's 16-feature group sums of squares; the second projection's lanes
normalise their own activations from those sums as they load them. The norm's reduction order
is the one every norm kernel follows (kernels/rms_order.cuh), so the result is bitwise the
three kernels in turn, which is what every other call runs (more rows, fp32, wider rows, weights
not prepared): a row's bits never depend on the batch size.

Default on (``LOCKSTEP_CUDA_RESIDUAL_HANDOFF``; docs/benchmarks/kernels.md section 21 has what it
bought on the H200).
"""

import numpy as np

from core import fusion
from providers.cuda import env
from providers.cuda.ops import NULL, _mma, matmul, silu_gated_matmul, skip_simplified_layer_normalization

OP_TYPE = "MatMulNormMatMul"
DOMAIN = "lockstep"
MODULES = fusion.part_modules(matmul, silu_gated_matmul, skip_simplified_layer_normalization)
#: Node calls that took the two-launch hand-off, and calls that ran the three parts (read by the
#: GPU tests: the hand-off ran).
counts = {"handoffs": 0, "three_part_runs": 0}


def enabled() -> bool:
    """Whether the pass runs on cuda (``LOCKSTEP_CUDA_RESIDUAL_HANDOFF``, default on)."""
    return env.switch("LOCKSTEP_CUDA_RESIDUAL_HANDOFF")


def supports(node) -> bool:
    """fp16 operands (where known) whose three parts (core.fusion.handoff_parts) are supported
    by their own modules, unless the pass is turned off (:func:`enabled`)."""
    if not enabled():
        return False
    known = [d for d in (node.input_dtypes or ())[:4] if d is not None]
    if not known or any(d != np.float16 for d in known):
        return False
    for part in fusion.handoff_parts(node):
        module = MODULES.get((part.domain, part.op_type))
        check = getattr(module, "supports", None)
        if module is None or (check is not None and not check(part)):
            return False
    return True


def prepare(ctx, x, w, skip, gamma, *w2):
    """Plan-time hook (core.ops): each projection's own (packed weights;
    core.fusion.prepare_handoff_parts)."""
    return fusion.prepare_handoff_parts(ctx, MODULES, w, w2)


def run(ctx, x, w, skip, gamma, *w2):
    done = _handoff(ctx, x, w, skip, gamma, w2)
    if done is not None:
        counts["handoffs"] += 1
        return done
    counts["three_part_runs"] += 1
    return fusion.run_handoff_parts(ctx, MODULES, x, w, skip, gamma, *w2)


def _aligned(*arrays) -> bool:
    return all(a.dtype == np.float16 and a.flags.c_contiguous and a.data.ptr % 16 == 0 for a in arrays)


def _handoff(ctx, x, w, skip, gamma, w2):
    """The two launches (module docstring), or None where they do not apply."""
    first, _, second = fusion.handoff_contexts(ctx)
    p1, p2 = first.cache.get(_mma.PREPARED), second.cache.get(_mma.PREPARED)
    if p1 is None or p2 is None or x.ndim < 1:
        return None
    (k1, d), (k2, n2) = p1, p2
    m = x.size // k1 if k1 else 0
    if (k2 != d or d % 8 or d > _mma.RESIDUAL_MAX_D or not 0 < m <= _mma.RESIDUAL_ROWS or x.shape[-1] != k1
            or skip.shape != (*x.shape[:-1], d) or gamma.size != d or not _aligned(x, skip, gamma)):
        return None
    glu = ctx.node.attrs["second"] == "SiluGatedMatMul"
    if not (_mma.residual_fits(m, d, k1, False, _mma.RES_OUT) and _mma.residual_fits(m, n2, k2, glu, _mma.RES_IN)):
        return None
    eps = float(ctx.node.attrs[fusion.NORM_EPSILON])
    y1 = ctx.output("first", (*x.shape[:-1], d), x.dtype)
    total = ctx.output(1 if len(ctx.node.outputs) > 1 and ctx.node.outputs[1] else "sum", skip.shape, x.dtype)
    sq = ctx.output("squares", (m, _mma.res_stride(d)), np.float32)
    _mma.dense(x, w, None, y1, m, d, k1, NULL, res=_mma.Residual(_mma.RES_OUT, skip, None, total, sq, eps))
    y2 = ctx.output(0, (*x.shape[:-1], n2), x.dtype)
    _mma.dense(y1, w2[0], None, y2, m, n2, k2, NULL, glu=glu,
               res=_mma.Residual(_mma.RES_IN, skip, gamma, None, sq, eps))
    return (y2, total if len(ctx.node.outputs) > 1 and ctx.node.outputs[1] else None)[:len(ctx.node.outputs)]

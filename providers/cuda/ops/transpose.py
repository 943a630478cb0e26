"""Transpose (ONNX): contiguous copy with permuted axes (cupy.copyto into the output buffer).

The builder's Transpose of the tied embedding becomes part of lockstep.GatherColumns
(core.fusion), which reads the lm_head weight itself; a Transpose of constants alone is folded
once at planning time (core.executor); a per-step Transpose is a plain copy (of a host input:
on the host, core.executor). ONNX Transpose-21.
"""

OP_TYPE = "Transpose"
DOMAIN = ""
REPLAY = False  # device work through CuPy expressions (providers/cuda/replay.py)


def run(ctx, x):
    import cupy

    perm = ctx.node.attrs.get("perm")
    perm = list(range(x.ndim))[::-1] if perm is None else [int(p) for p in perm]
    y = ctx.output(0, [x.shape[p] for p in perm], x.dtype)
    cupy.copyto(y, x.transpose(perm))
    return (y,)



"""Transpose (ONNX): contiguous copy with permuted axes (cupy.copyto into the output buffer).

When the input is a weight (an array made by provider.upload, never rewritten), the result is
computed once and later calls launch nothing (the builder transposes the tied embedding for
lm_head on every step otherwise). ONNX Transpose-21.
"""


from providers.cuda.ops import host_or_none

OP_TYPE = "Transpose"
DOMAIN = ""


def run(ctx, x):
    import cupy

    host = host_or_none(ctx, "transpose", (x,))
    if host is not None:
        return host
    perm = ctx.node.attrs.get("perm")
    perm = list(range(x.ndim))[::-1] if perm is None else [int(p) for p in perm]
    y = ctx.output(0, [x.shape[p] for p in perm], x.dtype)
    constant = ctx.provider.is_constant(x) if hasattr(ctx.provider, "is_constant") else False
    if constant and ctx.cache.get("source") is x:
        return (y,)
    cupy.copyto(y, x.transpose(perm))
    ctx.cache["source"] = x if constant else None
    return (y,)



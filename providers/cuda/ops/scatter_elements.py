"""ScatterElements (ONNX, default domain): a copy of ``data`` with out[..., index[..., j, ...],
...] = updates[..., j, ...] along ``axis`` (default 0); ``reduction`` "none" only (the default);
indices int32/int64 (negative counting from the end) of data's shape on every other axis;
elements of 2, 4 or 8 bytes. With duplicate indices the last update in C order wins, as on
cpu_reference: one thread writes a whole line in index order (kernels/router.cu
``scatter_elements``; a copy, batch-invariant). An index out of range cannot raise on the
device: its line gets all bits set (NaN for floats).

A host ``data`` whose elements are all equal (ConstantOfShape's sentinel logits, computed on
the host from a shape) is not uploaded: the kernel writes that value itself, so the step
holds no buffer that depends on the shape. Other host operands are uploaded once
(device_array). Source: ONNX ScatterElements-18."""

import numpy as np

from providers.cuda.module import function
from providers.cuda.ops import NULL, _router, grid_threads, is_host

OP_TYPE = "ScatterElements"
DOMAIN = ""


def support_reason(node) -> str | None:
    reasons = [r for r in (_router.copyable(node),) if r]
    if str(node.attrs.get("reduction", "none")) != "none":
        reasons.append(f"reduction={node.attrs['reduction']!r} (none only)")
    return "; ".join(reasons) or None



def run(ctx, data, indices, updates):
    fill = _router.host_fill(data) if is_host(data) else None
    shape, dtype = (np.shape(data), np.asarray(data).dtype) if is_host(data) else (data.shape, data.dtype)
    src = NULL if fill is not None else _router.device(ctx, data, "data", "data")
    idx = _router.device(ctx, indices, "indices", "the indices")
    upd = _router.device(ctx, np.asarray(updates, dtype) if is_host(updates) else updates, "updates", "updates")
    if upd.dtype != dtype or upd.shape != idx.shape:
        raise ValueError(f"ScatterElements (cuda): updates {upd.dtype}{upd.shape} must be {dtype} of the "
                         f"indices' shape {idx.shape}")
    axis = _router.axis_of(ctx, len(shape), 0)
    _router.check_lines(ctx, shape, idx.shape, axis)
    outer, n, inner = _router.split(shape, axis)
    elem = _router.element_type(ctx, dtype)
    out = ctx.output(0, shape, dtype)
    if out.size:
        bits = fill if fill is not None else np.zeros((), out.dtype).view(f"u{out.dtype.itemsize}")[()]
        function("router", f"scatter_elements<{elem}, {_router.index_type(ctx, idx)}>", _router.EXPRS)(
            grid_threads(outer * inner, 128, 1 << 20), (128,),
            (src, bits, idx, upd, out, np.int64(outer), np.int64(n), np.int64(idx.shape[axis]), np.int64(inner)))
    return (out,)

"""Reshape (ONNX): a view of the device input (no copy, no launch); the shape input must be a
host value (host data runs on the host, core.executor). 0 copies the input dim unless
allowzero=1; one -1 is inferred. ONNX Reshape-21."""

from core.opdefs import int_list, is_host
from providers.cuda import replay

OP_TYPE = "Reshape"
DOMAIN = ""


def run(ctx, data, shape):
    if not is_host(shape):
        raise ValueError("Reshape (cuda): the shape input must be a host value")
    dims = int_list(shape)
    if not ctx.node.attrs.get("allowzero", 0):
        dims = [data.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    out = data.reshape(dims)
    if out.data.ptr != data.data.ptr:  # a copy (non-contiguous input): a CuPy launch
        replay.not_replayable()
    return (out,)

"""Reshape (ONNX): a view of the device input (no copy, no launch); the shape input must be a
host value. 0 copies the input dim unless allowzero=1; one -1 is inferred. ONNX Reshape-21."""

from providers.cpu_reference.ops._util import int_list
from providers.cuda import replay
from providers.cuda.ops import host_or_none, is_host

OP_TYPE = "Reshape"
DOMAIN = ""


def run(ctx, data, shape):
    host = host_or_none(ctx, "reshape", (data, shape))
    if host is not None:
        return host
    if not is_host(shape):
        raise ValueError("Reshape (cuda): the shape input must be a host value")
    dims = int_list(shape)
    if not ctx.node.attrs.get("allowzero", 0):
        dims = [data.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    out = data.reshape(dims)
    if out.data.ptr != data.data.ptr:  # a copy (non-contiguous input): a CuPy launch
        replay.not_replayable()
    return (out,)

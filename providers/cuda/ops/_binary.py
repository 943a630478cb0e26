"""Binary ops on the device: same-shape float operands through kernels/elementwise.cu (one
launch, little Python); broadcasting or integer cases through CuPy ufuncs with ``out=``.

A host operand of one element is passed as a scalar of its own dtype; a larger host operand is
uploaded once (device_array). Two host operands are the core's business (core.executor runs
such nodes on the host). fp16 is computed as CuPy does (converted to fp32 and rounded
once), which equals the reference provider's fp32-then-round for +, -, *
"""

import numpy as np

from providers.cuda import replay
from providers.cuda.module import ctype, function
from providers.cuda.ops import device_array, grid_threads, is_host

EXPRS = ("binary<__half>", "binary<float>", "sigmoid<__half>", "sigmoid<float>", "silu_mul<__half>",
         "silu_mul<float>")
OPS = {"mul": 0, "add": 1, "sub": 2, "div": 3}


def run(ctx, ufunc, module_name: str, a, b):
    if (not is_host(a) and not is_host(b) and a.shape == b.shape and a.dtype == b.dtype
            and a.dtype in (np.float16, np.float32) and a.flags.c_contiguous and b.flags.c_contiguous):
        out = ctx.output(0, a.shape, a.dtype)
        kern = function("elementwise", f"binary<{ctype(a.dtype)}>", EXPRS)
        kern(grid_threads(a.size, 256, 4096), (256,), (a, b, out, np.int64(a.size), np.int32(OPS[module_name])))
        return (out,)
    shape = np.broadcast_shapes(a.shape, b.shape)
    dtype = np.result_type(np.asarray(a).dtype if is_host(a) else a.dtype,
                           np.asarray(b).dtype if is_host(b) else b.dtype)
    args = [_operand(ctx, x, f"host{i}") for i, x in enumerate((a, b))]
    out = ctx.output(0, shape, dtype)
    replay.not_replayable()  # a CuPy ufunc launch, not a recorded Kernel launch
    ufunc(*args, out=out)
    return (out,)


def _operand(ctx, x, key):
    if not is_host(x):
        return x
    host = np.asarray(x)
    if host.size == 1:
        return host.reshape(())[()]
    return device_array(ctx, host, key)

"""Launcher of kernels/sample.cu: device_sample, one 512-thread block per row (the header of the
.cu file and core/generation/sampling.py say what it computes). Allocates nothing: every buffer
is the caller's, so it is captured with the decode step."""

import numpy as np

from providers.cuda.module import ctype, function

THREADS = 512
_EXPRS = ("sample_rows<__half>", "sample_rows<float>")


def device_sample(logits, positions, counter, fed, sampling, result) -> None:
    """Choose each row's token into ``result`` int32 [B, 2] (protocol ``device_sample``).

    Raises:
        ValueError: positions / counter are not int32 device arrays [B], or a sampling buffer has
            the wrong dtype or shape.
    """
    import cupy

    bsz, s_len, v = logits.shape
    for name, arr, dtype, shape in (("positions", positions, np.int32, (bsz,)), ("counter", counter, np.int32, (bsz,)),
                                    ("params", sampling.params, np.float32, (bsz, 4)),
                                    ("options", sampling.options, np.int32, (bsz, 4)),
                                    ("history", sampling.history, np.uint8, (bsz, v))):
        if not isinstance(arr, cupy.ndarray) or arr.dtype != dtype or tuple(arr.shape) != shape:
            raise ValueError(f"device_sample: {name} must be a {np.dtype(dtype).name} device array {list(shape)}")
    fed_arg = np.uint64(0) if fed is None else fed
    kern = function("sample", f"sample_rows<{ctype(logits.dtype)}>", _EXPRS)
    kern((bsz,), (THREADS,), (logits, positions, np.int32(s_len), np.int32(v), sampling.params, sampling.options,
                             counter, fed_arg, sampling.history, result))

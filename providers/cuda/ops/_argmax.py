"""Launchers of kernels/argmax.cu: device_argmax (two passes, fixed 4096-element chunks) and
decode_advance (one thread per row). Scratch for the partials is kept by the provider per
(B, chunks) and allocated on the first call (warm up before capture)."""

import numpy as np

from providers.cuda.module import ctype, function

CHUNK = 4096
_EXPRS = ("argmax_partial<__half>", "argmax_partial<float>", "argmax_final", "decode_advance")


def device_argmax(provider, logits, positions, result) -> None:
    import cupy

    bsz, s_len, v = logits.shape
    nch = -(-v // CHUNK)
    key = (bsz, nch)
    scratch = provider._argmax_scratch.get(key)
    if scratch is None:
        scratch = (cupy.empty((bsz, nch), np.float32), cupy.empty((bsz, nch), np.int32),
                   cupy.empty((bsz, nch), np.int32))
        provider._argmax_scratch[key] = scratch
    if not isinstance(positions, cupy.ndarray) or positions.dtype != np.int32:
        raise ValueError("device_argmax: positions must be an int32 device array [B]")
    part = function("argmax", f"argmax_partial<{ctype(logits.dtype)}>", _EXPRS)
    part((bsz, nch), (256,), (logits, positions, np.int32(s_len), np.int32(v), *scratch))
    final = function("argmax", "argmax_final", _EXPRS)
    final((bsz,), (256,), (*scratch, np.int32(nch), result))


def decode_advance(result, input_ids, attention_mask, lengths) -> None:
    bsz, cap = attention_mask.shape
    kern = function("argmax", "decode_advance", _EXPRS)
    kern((-(-bsz // 128),), (128,), (result, input_ids, attention_mask, lengths, np.int32(bsz), np.int32(cap)))

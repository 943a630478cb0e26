"""Unpacking of block-quantized codes shared by MatMulNBits and GatherBlockQuantized (docs/ops.md 2, 5).

Codes are packed least-significant bits first: with e = t*bits, element t of a packed row is
(byte[e div 8] >> (e mod 8)) & (2^bits - 1); for 4 bits element 2i is the low nibble of byte i.
"""

from __future__ import annotations

import numpy as np


def unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first ``count`` unsigned codes of every row of uint8 ``packed`` [..., nbytes], as uint8.

    Raises:
        ValueError: bits not in (2, 4, 8), or the rows hold fewer than ``count`` codes.
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"unsupported bits={bits} (2, 4 or 8)")
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    per_byte = 8 // bits
    if packed.shape[-1] * per_byte < count:
        raise ValueError(f"{packed.shape[-1]} bytes hold fewer than {count} {bits}-bit codes")
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    codes = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :count]

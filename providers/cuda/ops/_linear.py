"""Launch configuration of kernels/linear.cu (shared by MatMul and MatMulNBits).

Rows per block (RT), chunk slots (CS) and column threads (CT) are free choices: the
reduction order of each output is fixed by K and the chunk size alone (see linear.cu), so
these choices may follow M without breaking batch invariance.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=4096)
def config(m: int, n: int, n_chunks: int) -> tuple[int, tuple, tuple, int]:
    """(RT, grid, block, shared bytes) for an [m, K] x [K, n] product of ``n_chunks`` chunks."""
    groups = -(-n // 8)
    units = groups * n_chunks  # thread units per row block
    rt = 8  # fewer rows per block until ~32k thread units are in flight (latency hiding)
    while rt > 1 and (rt // 2 >= m or units * -(-m // rt) < 32768):
        rt //= 2
    cs = n_chunks if n_chunks <= 32 else -(-n_chunks // -(-n_chunks // 32))
    budget = 256 if rt <= 4 else 128
    row_blocks = -(-m // rt)
    ct = max(1, min(budget // cs, groups))
    while ct > 1 and -(-groups // ct) * row_blocks < 264:
        ct //= 2
    grid = (-(-groups // ct), row_blocks)
    shared = (cs + 1) * rt * 8 * ct * 4
    return rt, grid, (ct, cs), shared


def i32(v) -> np.int32:
    return np.int32(v)

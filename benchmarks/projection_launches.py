"""Microseconds per launch of the kernel the launcher itself picks (``_mma.dense``: row kernel,
token tiles, PIPE schedule and block size, or the tiles) at the dense fp16 projections of
Llama-3.2-1B, Qwen2.5-0.5B and SmolLM2-135M (``token_tiles.SHAPES``), with the kernel, grid and block it launched. Each
time is a replay of a captured graph of 20 launches of one weight, so it holds no host cost. Run it on two
trees with different kernel constants to compare them launch by launch.

    python benchmarks/projection_launches.py [--rows 16,32]
"""

from __future__ import annotations

import argparse
import functools

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32", type=lambda t: [int(x) for x in t.split(",")])
    args = ap.parse_args()
    import cupy as cp
    from gemm_launch import graph_us
    from token_tiles import SHAPES  # (K, N, GLU) of the row kernels' projections

    from providers.cuda.ops import NULL, _mma, _mma_layout
    from providers.cuda.provider import CudaProvider

    stream = CudaProvider().stream
    launched: list[tuple] = []
    launch = _mma._launch

    def recording(expr, grid, block, kernel_args, shared):
        launched.append((expr, grid, block))
        launch(expr, grid, block, kernel_args, shared)

    _mma._launch = recording
    rng = np.random.default_rng(0)
    print(f"{'projection':17s} {'rows':>4s} {'us':>7s}  kernel, grid, block")
    for name, (k, n, glu) in SHAPES.items():
        w = cp.asarray((rng.standard_normal((k, n)) * k ** -0.5).astype(np.float16))
        up = cp.asarray((rng.standard_normal((k, n)) * k ** -0.5).astype(np.float16)) if glu else None
        wp = _mma_layout.pack(cp, w, up)
        for m in args.rows:
            a = cp.asarray(rng.standard_normal((m, k)).astype(np.float16))
            y = cp.empty((m, n), np.float16)
            launched.clear()
            us = graph_us(stream, functools.partial(_mma.dense, a, wp, None, y, m, n, k, NULL, glu=glu))
            expr, grid, block = launched[0]
            print(f"{name:17s} {m:4d} {us:7.2f}  {expr} {grid} {block}", flush=True)


if __name__ == "__main__":
    main()

"""Microseconds per launch of the dense tensor-core GEMMs: the row kernel (``mma_dense``) against
the tiled one (``mma_wide``, forced wherever it applies) and, for 17 to 32 rows, its one-token-warp
form (``mma_wide<F, GLU, 1>``, forced too), at the projections of Llama-3.2-1B, Qwen2.5-0.5B and
SmolLM2-135M, for 8 to 256 rows. Each time is a replay of a captured graph of 20 launches, so it
holds no host cost. The table behind ``_mma_schedule.wide_worth`` and ``_mma_schedule.wide32_config``;
outputs are also checked bitwise equal.

    python benchmarks/gemm_launch.py [--rows 8,16,32,64,128,256]
"""

from __future__ import annotations

import argparse
import functools

import numpy as np

SHAPES = {"Llama qkv": (2048, 3072, False), "Llama o": (2048, 2048, False), "Llama gate/up": (2048, 8192, True),
          "Llama down": (8192, 2048, False), "Llama lm_head": (2048, 128256, False),
          "Qwen0.5B qkv": (896, 1152, False), "Qwen0.5B gate/up": (896, 4864, True),
          "Qwen0.5B lm_head": (896, 151936, False),
          "SmolLM2 qkv": (576, 960, False), "SmolLM2 o": (576, 576, False), "SmolLM2 gate/up": (576, 1536, True),
          "SmolLM2 down": (1536, 576, False), "SmolLM2 lm_head": (576, 49152, False)}


def graph_us(stream, fn, reps: int = 20) -> float:
    """Microseconds per call of ``fn``: a graph of ``reps`` calls captured on ``stream``, replayed 5 times."""
    import cupy as cp

    fn()
    stream.synchronize()
    stream.begin_capture()
    for _ in range(reps):
        fn()
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(5):
        graph.launch(stream)
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / (5 * reps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,16,32,64,128,256", type=lambda t: [int(x) for x in t.split(",")])
    args = ap.parse_args()
    import cupy as cp

    from providers.cuda.ops import NULL, _mma, _mma_layout, _mma_schedule
    from providers.cuda.provider import CudaProvider
    from providers.cuda.tuning import Tuning

    stream = CudaProvider().stream
    _mma_schedule.WIDE_ROWS = 1
    _mma_schedule.wide_worth = lambda m, blocks: True  # time the tiles wherever they apply
    _mma_schedule.WIDE32_MIN_K = 0
    rng = np.random.default_rng(0)
    print(f"{'projection':16s} " + "  ".join(f"{m:>4d} rows: row/tiled[/tw1] us" for m in args.rows))
    for name, (k, n, glu) in SHAPES.items():
        w = cp.asarray((rng.standard_normal((k, n)) * k ** -0.5).astype(np.float16))
        up = cp.asarray((rng.standard_normal((k, n)) * k ** -0.5).astype(np.float16)) if glu else None
        wp = _mma_layout.pack(cp, w, up)
        cells = []
        for m in args.rows:
            a = cp.asarray(rng.standard_normal((m, k)).astype(np.float16))
            y = cp.empty((m, n), np.float16)
            times, outs = [], []
            # row kernel; tiled (64-token blocks); one token warp (17 to 32 rows only)
            modes = (("off", 1e9), ("dense", 1e9)) + ((("dense", 0.0),) if 16 < m <= 32 else ())
            for mode, fill in modes:
                _mma_schedule.WIDE32_FILL = fill
                times.append(graph_us(stream, functools.partial(_mma.dense, a, wp, None, y, m, n, k, NULL, glu=glu,
                                                                tuning=Tuning(gemm_wide=mode))))
                outs.append(y.get().view(np.uint16).copy())
            same = "" if all(np.array_equal(outs[0], o) for o in outs) else " (bits differ!)"
            cells.append(" / ".join(f"{t:6.1f}" for t in times) + same)
        print(f"{name:16s} " + "  ".join(f"{c:>26s}" for c in cells), flush=True)
    _mma_schedule.WIDE32_FILL = 1.5


if __name__ == "__main__":
    main()

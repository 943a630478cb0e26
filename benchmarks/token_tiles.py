"""Microseconds per launch of the row kernels (``mma_dense``, ``mma_nbits4``) by token tiles per
block (NJ = 1, 2 or 4: 8, 16 or 32 rows per block) at the projections of SmolLM2-135M,
Qwen2.5-0.5B and Llama-3.2-1B, dense fp16 and int4 (block 32, fp16 scales). Each time is a replay
of a captured graph of 20 launches, so it holds no host cost; the outputs of the three NJ are
checked bitwise equal (token columns are independent inside an mma). The table behind
``_mma_schedule.row_nj`` and the PIPE rule for two tiles, ``_mma_schedule.pipelined``.

    python benchmarks/token_tiles.py [--rows 16,32]
"""

from __future__ import annotations

import argparse
import functools

import attrs
import numpy as np

# (K, N, GLU) per projection; GLU: N is the gate (= up) width
SHAPES = {"SmolLM2 qkv": (576, 960, False), "SmolLM2 o": (576, 576, False), "SmolLM2 gate/up": (576, 1536, True),
          "SmolLM2 down": (1536, 576, False),
          "Qwen0.5B qkv": (896, 1152, False), "Qwen0.5B o": (896, 896, False),
          "Qwen0.5B gate/up": (896, 4864, True), "Qwen0.5B down": (4864, 896, False),
          "Llama qkv": (2048, 3072, False), "Llama o": (2048, 2048, False), "Llama gate/up": (2048, 8192, True),
          "Llama down": (8192, 2048, False)}
TILES = (1, 2, 4)
#: (LOCKSTEP_CUDA_GEMM_TOKEN_TILES, LOCKSTEP_CUDA_GEMM_PIPELINE) per column: dense NJ = 2 also
#: with the PIPE schedule; the last column is the launcher's own choice
CONFIGS = {"fp16": (("1", "auto"), ("2", "auto"), ("2", "all"), ("4", "auto"), ("auto", "auto")),
           "int4": (*((str(nj), "auto") for nj in TILES), ("auto", "auto"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32", type=lambda t: [int(x) for x in t.split(",")])
    args = ap.parse_args()
    import cupy as cp
    from gemm_launch import graph_us

    from providers.cuda.ops import NULL, _mma, _mma_layout, _mma_schedule
    from providers.cuda.provider import CudaProvider
    from providers.cuda.tuning import Tuning

    stream = CudaProvider().stream
    base = Tuning(gemm_wide="off")
    rng = np.random.default_rng(0)
    print("us per launch; fp16 columns NJ 1 / 2 / 2 PIPE / 4 / auto, int4 NJ 1 / 2 / 4 / auto (PIPE always);"
          " auto's NJ in brackets, P: on the PIPE schedule")
    print(f"{'projection':18s} {'kind':5s} " + "  ".join(f"{m:>3d} rows" for m in args.rows))
    for name, (k, n, glu) in SHAPES.items():
        w = cp.asarray((rng.standard_normal((k, n)) * k ** -0.5).astype(np.float16))
        up = cp.asarray((rng.standard_normal((k, n)) * k ** -0.5).astype(np.float16)) if glu else None
        wp = _mma_layout.pack(cp, w, up)
        rows = 2 * n if glu else n
        nb = -(-k // 32)
        codes = cp.asarray(rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8))
        scales = cp.asarray((rng.random((rows, nb)) * 0.02).astype(np.float16))
        w4 = _mma_layout.pack_int4(cp, codes, scales, None, rows, k, 32)
        for kind in CONFIGS:
            cells = []
            for m in args.rows:
                a = cp.asarray(rng.standard_normal((m, k)).astype(np.float16))
                y = cp.empty((m, n), np.float16)
                if kind == "fp16":
                    fn = functools.partial(_mma.dense, a, wp, None, y, m, n, k, NULL, glu=glu)
                else:
                    fn = functools.partial(_mma.nbits4, a, w4, None, y, m, NULL, glu_out=n if glu else 0)
                times, outs = [], []
                for nj, pipeline in CONFIGS[kind]:
                    tuning = attrs.evolve(base, gemm_token_tiles=nj, gemm_pipeline=pipeline)
                    times.append(graph_us(stream, functools.partial(fn, tuning=tuning)))
                    outs.append(y.get().view(np.uint16).copy())
                same = "" if all(np.array_equal(outs[0], o) for o in outs) else " (bits differ!)"
                chosen = _mma_schedule.row_nj(m, rows, kind == "int4", tuning=base)
                piped = _mma_schedule.pipelined(rows, False, m, tuning=base)
                pipe = "P" if kind == "fp16" and chosen > 1 and piped else ""
                cells.append("/".join(f"{t:.1f}" for t in times) + f" [{chosen}{pipe}]" + same)
            print(f"{name:18s} {kind:5s} " + "  ".join(f"{c:>30s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()

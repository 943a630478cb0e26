"""Microseconds per launch of the two RMSNorm kernels (kernels/rms_norm.cu): ``rms_norm``
(scalar loads, gamma read after the sum) and ``rms_norm_h8`` (16-byte loads, one round trip), at
the hidden sizes of SmolLM2-135M, Qwen2.5-0.5B and Llama-3.2-1B, with a skip input and the
residual sum written (SkipSimplifiedLayerNormalization, as a decoder layer runs it). Each time is
a replay of a captured graph of 20 launches, so it holds no host cost; the inputs stay in L2, as
a decode step's activations do when the norm follows the projection that wrote them. The two
kernels' outputs are checked bitwise equal.

    python benchmarks/norm_launch.py [--rows 1,8,32,256] [--dims 576,896,2048]
"""

from __future__ import annotations

import argparse
import functools

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda t: [int(x) for x in t.split(",")]  # noqa: E731
    ap.add_argument("--rows", default="1,8,32,256", type=ints)
    ap.add_argument("--dims", default="576,896,2048", type=ints)
    args = ap.parse_args()
    import cupy as cp
    from gemm_launch import graph_us

    from providers.cuda.ops import _norm
    from providers.cuda.provider import CudaProvider

    stream = CudaProvider().stream
    rng = np.random.default_rng(0)
    print("us per launch, rms_norm / rms_norm_h8 (SkipSimplifiedLayerNormalization with the residual sum)")
    print(f"{'D':>6s} " + "  ".join(f"{m:>4d} rows      " for m in args.rows))
    for d in args.dims:
        cells = []
        gamma = cp.asarray(rng.standard_normal(d).astype(np.float16))
        for m in args.rows:
            x = cp.asarray(rng.standard_normal((m, d)).astype(np.float16))
            skip = cp.asarray(rng.standard_normal((m, d)).astype(np.float16))
            y, total = cp.empty_like(x), cp.empty_like(x)
            launch = functools.partial(_norm.launch, x, skip, None, gamma, y, total, None, None, d, 1e-5)
            times, outs = [], []
            for vector in (False, True):
                _norm.VECTOR = vector
                times.append(graph_us(stream, launch))
                outs.append((y.get().view(np.uint16).copy(), total.get().view(np.uint16).copy()))
            same = all(np.array_equal(a, b) for a, b in zip(*outs, strict=True))
            cells.append(f"{times[0]:5.2f} / {times[1]:5.2f}" + ("" if same else " (bits differ!)"))
        print(f"{d:6d} " + "  ".join(f"{c:>16s}" for c in cells), flush=True)
    _norm.VECTOR = True


if __name__ == "__main__":
    main()

"""Host cost of one kernel launch through CuPy (RawKernel) and through the CUDA driver API with
the arguments packed once (providers/cuda/replay.py's Launch: CuPy's cuLaunchKernel wrapper),
per argument count.

    python benchmarks/launch_cost.py

Prints microseconds per launch (no synchronisation inside the timed loop; the kernel is empty,
so the figure is host time unless the launch queue fills).
"""

from __future__ import annotations

import time

import numpy as np

SRC = r"""
extern "C" __global__ void k4(const float* a, float* b, int n, float s) {}
extern "C" __global__ void k12(const float* a, const float* b, const float* c, float* d, int m, int n, int k,
                               int x, int y, long long z, float s, float t) {}
extern "C" __global__ void k24(const float* a, const float* b, const float* c, float* d, const float* e,
                               const float* f, const float* g, float* h, int i0, int i1, int i2, int i3,
                               int i4, int i5, int i6, int i7, long long l0, long long l1, long long l2,
                               long long l3, float f0, float f1, float f2, float f3) {}
"""


def per_launch(fn, reps=20000) -> float:
    import cupy

    for _ in range(200):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = time.perf_counter() - t0
    cupy.cuda.get_current_stream().synchronize()
    return dt / reps * 1e6


def main():
    import cupy

    mod = cupy.RawModule(code=SRC)
    x = cupy.zeros(1024, cupy.float32)
    args = {
        "k4": (x, x, np.int32(1), np.float32(1)),
        "k12": (x, x, x, x) + tuple(np.int32(i) for i in range(5)) + (np.int64(1), np.float32(1), np.float32(2)),
        "k24": (x,) * 8 + tuple(np.int32(i) for i in range(8)) + tuple(np.int64(i) for i in range(4))
               + tuple(np.float32(i) for i in range(4)),
    }
    for name, a in args.items():
        kern = mod.get_function(name)
        us = per_launch(lambda kern=kern, a=a: kern((1,), (32,), a))
        print(f"cupy RawKernel {name}: {us:6.2f} us/launch")
    from providers.cuda import replay

    stream = cupy.cuda.get_current_stream().ptr
    for name, a in args.items():
        launch = replay.Launch(mod.get_function(name).kernel.ptr, (1,), (32,), a, 0)
        us = per_launch(lambda launch=launch: launch.fire(stream))
        print(f"prepared cuLaunchKernel (replay.Launch, default wrapper) {name}: {us:6.2f} us/launch")
        d = launch.dims
        try:
            us = per_launch(lambda launch=launch, d=d: replay._bindings_launch(launch.fn, *d, launch.shared, stream,
                                                                             launch.params))
            print(f"prepared cuLaunchKernel (cuda-bindings) {name}: {us:6.2f} us/launch")
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"cuda-bindings launch failed: {exc!r}")
    # a trivial CuPy elementwise op, for scale
    y = cupy.zeros(8, cupy.int32)
    print(f"cupy y += 1 (elementwise kernel): {per_launch(lambda: y.__iadd__(1), 5000):6.2f} us")


if __name__ == "__main__":
    main()

"""CUDA execution provider (CuPy + CUDA C kernels compiled with NVRTC through cupy.RawModule).

Registered as the pluggy plugin ``cuda`` through the entry-point group ``lockstep.providers``.
Importing this package does not import CuPy: the factory does, and raises a RuntimeError that
names what is missing (CuPy, a visible GPU, the CUDA headers).
"""

from core.hookspecs import ProviderSpec, hookimpl


def _factory():
    from providers.cuda.provider import CudaProvider

    return CudaProvider()


@hookimpl
def lockstep_providers():
    return [ProviderSpec("cuda", _factory,
                         "CuPy + CUDA C kernels, fp32 accumulation, batch-invariant by design")]

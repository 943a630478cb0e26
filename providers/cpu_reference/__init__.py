"""NumPy reference provider: the oracle every other provider is checked against.

Registered as the pluggy plugin ``cpu_reference`` through the entry-point group
``lockstep.providers`` (see pyproject.toml).
"""

from core.hookspecs import ProviderSpec, hookimpl


@hookimpl
def lockstep_providers():
    from providers.cpu_reference.provider import CpuReferenceProvider

    return [ProviderSpec("cpu_reference", CpuReferenceProvider,
                         "NumPy kernels, fp32 accumulation, row-independent (the oracle)")]

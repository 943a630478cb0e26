"""lockstep-numpy64: an example third-party Lockstep provider (the plugin module).

Lockstep loads this module through the entry point ``numpy64 = "lockstep_numpy64"`` in the
group ``lockstep.providers`` (see pyproject.toml) and calls the hook below once. The provider
class is imported only when somebody asks for ``provider="numpy64"``.
"""

from lockstep import ProviderSpec, hookimpl


@hookimpl
def lockstep_providers():
    """Offer one provider, ``numpy64``."""
    from lockstep_numpy64.provider import Numpy64Provider

    return [ProviderSpec("numpy64", Numpy64Provider,
                         "example plugin: NumPy kernels with float64 accumulation, no capture")]

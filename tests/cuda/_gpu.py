"""Module-level guard for GPU tests: skip the calling module without CuPy or a GPU."""

import pytest


def require_gpu():
    """Return the cupy module, or skip the whole calling test module."""
    cupy = pytest.importorskip("cupy", reason="the cuda tests need CuPy (pip install -e '.[cuda13]')")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, no device
        pytest.skip(f"no usable GPU: {exc}", allow_module_level=True)
    if count < 1:
        pytest.skip("no visible GPU", allow_module_level=True)
    return cupy

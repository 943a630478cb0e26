"""GPU-only tests: skipped as a whole when CuPy or a visible GPU is missing."""

import pytest

cupy = pytest.importorskip("cupy")
try:
    _GPUS = cupy.cuda.runtime.getDeviceCount()
except Exception:  # noqa: BLE001
    _GPUS = 0
if _GPUS < 1:
    pytest.skip("no visible GPU", allow_module_level=True)


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.cuda)


@pytest.fixture(scope="session")
def gpu():
    from providers.cuda.provider import CudaProvider

    return CudaProvider()

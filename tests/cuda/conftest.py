"""GPU-only tests. Each module starts with ``gpu_or_skip()``-style guards (see
``tests/cuda/_gpu.py``), so without CuPy or a visible GPU they are reported as skipped."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/cuda/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(scope="session")
def gpu():
    from providers.cuda.provider import CudaProvider

    return CudaProvider()

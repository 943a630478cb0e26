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


#: the prompts of the tiny gpt-oss expert tests (test_moe_streaming_cuda, test_moe_expert_budget_cuda)
MOE_PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 21)), [200, 7, 7, 31, 64, 128, 9, 250, 1, 33, 77, 12, 6],
               [3, 3, 3], [90, 44, 23, 8, 1, 2], [250, 249, 248, 247], list(range(30, 52, 2)), [11, 64]]

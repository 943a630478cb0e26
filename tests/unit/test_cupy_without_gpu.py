"""CuPy installed but no usable GPU (no driver): the GPU tests are skips, and the parity kit
against cuda is one usage error, not a failure per test. A stand-in ``cupy`` package whose
``getDeviceCount`` raises as CuPy does without a driver is put first on the path of a pytest
subprocess (it shadows a real CuPy too)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE = textwrap.dedent('''
    """Stand-in for CuPy on a machine without a CUDA driver."""
    class CUDARuntimeError(RuntimeError):
        pass

    class _Runtime:
        @staticmethod
        def getDeviceCount():
            raise CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    class cuda:
        runtime = _Runtime
''')


def _pytest(tmp_path, *args):
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(FAKE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_gpu_tests_are_skipped_with_the_reason(tmp_path):
    proc = _pytest(tmp_path, "tests/cuda")
    assert proc.returncode in (0, 5), proc.stdout[-3000:]  # 5: every module skipped at collection
    tail = proc.stdout.strip().splitlines()[-1]
    assert "skipped" in tail and "error" not in tail and "failed" not in tail and "passed" not in tail
    assert "no usable GPU: cudaErrorInsufficientDriver" in proc.stdout


def test_the_parity_kit_against_cuda_is_one_usage_error(tmp_path):
    proc = _pytest(tmp_path, "--lockstep-provider", "cuda")
    assert proc.returncode == 4  # pytest's usage error
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines == ["ERROR: --lockstep-provider cuda: provider 'cuda' (plugin 'cuda', package lockstep) could "
                     "not be created: the 'cuda' provider found no usable GPU: cudaErrorInsufficientDriver: CUDA "
                     "driver version is insufficient"]

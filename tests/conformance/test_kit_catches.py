"""The kit fails providers that break its properties (a kit that never fails proves nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest

from core.testing.kit import run_argmax_case, run_op_case
from core.testing.op_cases import ARGMAX_CASES, OP_CASES
from core.testing.parity import run_parity
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider


def _case(case_id):
    return next(c for c in OP_CASES if c.id == case_id)


class Broken(CpuReferenceProvider):
    """cpu_reference with one kernel replaced (``kernels``: (domain, op) -> kernel)."""

    def __init__(self, kernels=None, argmax=None):
        super().__init__()
        self.kernels = kernels or {}
        self.argmax = argmax

    def kernel(self, node):
        return self.kernels.get((node.domain, node.op_type)) or super().kernel(node)

    def device_argmax(self, logits, positions, result):
        if self.argmax is None:
            return super().device_argmax(logits, positions, result)
        rows = np.asarray(logits)[np.arange(logits.shape[0]), positions].astype(np.float32)
        result[...] = self.argmax(rows)


def test_an_inaccurate_kernel_fails_its_op_case():
    sigmoid = lambda ctx, x: ((1.0 / (1.0 + np.exp(-x)) + 1e-3).astype(x.dtype),)  # noqa: E731
    result = run_op_case(_case("Sigmoid/wide-range"), "float32", Broken({("", "Sigmoid"): sigmoid}),
                         CpuReferenceProvider(), np.random.default_rng(0))
    assert not result.passed and "atol" in result.detail


def test_a_kernel_that_leaves_poisoned_lanes_fails():
    def mul(ctx, a, b):  # writes every row but the last into its persistent (poisoned) buffer
        out = ctx.output(0, np.broadcast_shapes(a.shape, b.shape), a.dtype)
        out[:-1] = (a * b)[:-1]
        return (out,)

    result = run_op_case(_case("Mul/same-shape"), "float32", Broken({("", "Mul"): mul}),
                         CpuReferenceProvider(), np.random.default_rng(0))
    assert result.poisoned and not result.passed and "nan" in result.detail


def test_argmax_with_highest_index_on_ties_fails():
    def last_max(rows):
        out = np.zeros((rows.shape[0], 2), np.int32)
        out[:, 0] = rows.shape[1] - 1 - np.argmax(rows[:, ::-1], axis=1)
        return out

    case = next(c for c in ARGMAX_CASES if c.id == "ties")
    result = run_argmax_case(case, "float32", Broken(argmax=last_max), CpuReferenceProvider(),
                             np.random.default_rng(0))
    assert not result.passed and "rows" in result.detail


def test_argmax_that_returns_token_0_for_nan_fails():
    def silent(rows):
        out = np.zeros((rows.shape[0], 2), np.int32)
        out[:, 0] = np.nan_to_num(rows, nan=-np.inf).argmax(axis=1)
        return out

    case = next(c for c in ARGMAX_CASES if c.id == "nonfinite")
    result = run_argmax_case(case, "float16", Broken(argmax=silent), CpuReferenceProvider(),
                             np.random.default_rng(0))
    assert not result.passed


def test_a_batch_dependent_matmul_fails_batch_invariance(tmp_path):
    def matmul(ctx, a, b):  # a reduction that depends on the number of rows
        y = np.matmul(a.astype(np.float32), b.astype(np.float32))
        return ((y * (1 + 1e-6 * a.shape[0])).astype(a.dtype),)

    report = run_parity(make_tiny_model(tmp_path / "m"), Broken({("", "MatMul"): matmul}),
                        batches=(1, 2), steps=4)
    assert report.gate("batch_invariance").status == "fail"
    assert report.gate("logits").status == "pass"  # small errors: within tolerance
    assert not report.passed


def test_parity_report_round_trips_to_json_and_text(tmp_path):
    import json

    report = run_parity(make_tiny_model(tmp_path / "m", dtype="float16", quant="int4"), "cpu_reference",
                        batches=(1, 3), steps=6)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["passed"] and [g["name"] for g in data["gates"]][:2] == ["logits", "greedy"]
    assert len(data["per_step"]) == 2 * 7
    text = report.render()
    assert "batch_invariance" in text and "overall: PASS" in text


def _plugin_args() -> list[str]:
    installed = any(ep.value == "core.testing.plugin" for ep in metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "core.testing.plugin"]


def test_pytest_lockstep_provider_runs_the_kit_alone(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_plugin_args(),
           "--lockstep-provider", "cpu_reference", "--lockstep-include", "op/Mul/*",
           "--lockstep-include", "gate/row_identity", "--lockstep-steps", "4", "--lockstep-batches", "1,2",
           "--lockstep-exclude", "op/Mul/broadcast/*=demo reason"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lockstep parity kit summary" in proc.stdout
    assert "demo" in proc.stdout and "3 passed, 2 skipped" in proc.stdout


@pytest.mark.parametrize("bad", ["--lockstep-exclude=op/*", "--lockstep-provider=no-such-provider"])
def test_pytest_plugin_rejects_bad_options(tmp_path, bad):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_plugin_args(),
           "--lockstep-provider=cpu_reference", bad]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "PATTERN=REASON" in proc.stderr or "unknown provider" in proc.stderr

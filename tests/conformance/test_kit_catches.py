"""The kit fails providers that break its properties (a kit that never fails proves nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest

from core.testing.kit import UnsupportedCase, run_argmax_case, run_download_async, run_op_case
from core.testing.op_cases import ARGMAX_CASES, OP_CASES, case_params
from core.testing.parity import run_parity
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.ops import group_query_attention
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


def test_an_off_by_one_kernel_that_leaves_its_last_row_unwritten_fails_on_the_poison():
    """The kit poisons the buffers a kernel takes from ctx.output: a row it never writes is NaN
    (without the poison it would hold whatever the buffer held, often a right answer)."""
    def matmul(ctx, a, b):
        out = ctx.output(0, (*a.shape[:-1], b.shape[1]), a.dtype)
        out[:-1] = (a[:-1].astype(np.float32) @ b.astype(np.float32)).astype(a.dtype)
        return (out,)

    result = run_op_case(_case("MatMul/K100-N37-M5"), "float16", Broken({("", "MatMul"): matmul}),
                         CpuReferenceProvider(), np.random.default_rng(0))
    assert result.poisoned and not result.passed and "nan" in result.detail


def test_a_kernel_that_returns_a_fresh_array_is_reported_unpoisoned():
    mul = lambda ctx, a, b: (a * b,)  # noqa: E731 - correct values, but not in its buffer
    result = run_op_case(_case("Mul/same-shape"), "float32", Broken({("", "Mul"): mul}),
                         CpuReferenceProvider(), np.random.default_rng(0))
    assert result.passed and not result.poisoned and result.unpoisoned == ["y"]
    assert "outputs not poisoned: y" in result.summary()


def test_cpu_reference_writes_every_output_into_its_poisoned_buffer():
    """cpu_reference takes every output from ctx.output, so the kit's poison is real for it
    (the present KV of GroupQueryAttention is the past buffer, written in place); MatMulNBits
    included, and its cases are among those checked."""
    provider, reference, rng = CpuReferenceProvider(), CpuReferenceProvider(), np.random.default_rng(0)
    params = list(case_params())
    assert any(case.op == "MatMulNBits" for _, case, _ in params)
    results = {kit_id: run_op_case(case, dtype, provider, reference, rng, iterations=1)
               for kit_id, case, dtype in params}
    assert {name: r.unpoisoned for name, r in results.items() if not r.poisoned} == {}


def test_a_batch_dependent_matmul_fails_its_row_case():
    def matmul(ctx, a, b):  # an error that grows with M: within tolerance, not row-invariant
        y = np.matmul(a.astype(np.float32), b.astype(np.float32)) * np.float32(1 + 1e-6 * a.shape[0])
        out = ctx.output(0, y.shape, a.dtype)
        out[...] = y
        return (out,)

    result = run_op_case(_case("MatMul/rows-M8"), "float32", Broken({("", "MatMul"): matmul}),
                         CpuReferenceProvider(), np.random.default_rng(0))
    assert result.poisoned and not result.passed and "row 0 run alone differs" in result.detail
    assert result.max_abs < 1e-4  # the comparison with the reference alone passes


def test_a_padded_prompt_row_that_depends_on_its_padding_fails_its_row_case():
    """GQA rows are also run alone without their right padding (docs/cases.md 1): a kernel whose real
    rows depend on the padded length S is caught, though within tolerance of the reference."""
    def gqa(ctx, query, *rest):
        outs = group_query_attention.run(ctx, query, *rest)
        outs[0][...] *= np.float32(1 + 1e-6 * query.shape[1])
        return outs

    case = _case("GroupQueryAttention/prompt-right-padding-head_major")
    result = run_op_case(case, "float32", Broken({("com.microsoft", "GroupQueryAttention"): gqa}),
                         CpuReferenceProvider(), np.random.default_rng(0))
    assert not result.passed and "row 1 run alone differs" in result.detail


def test_a_fused_op_that_is_not_its_chain_fails_its_unfused_case():
    def silu_mul(ctx, x, up):  # one fp32 pass rounded once: close to the chain, not its bits
        x32 = x.astype(np.float32)
        out = ctx.output(0, x.shape, x.dtype)
        out[...] = x32 / (1 + np.exp(-x32)) * up.astype(np.float32)
        return (out,)

    result = run_op_case(_case("SiluMul/d1536"), "float16", Broken({("lockstep", "SiluMul"): silu_mul}),
                         CpuReferenceProvider(), np.random.default_rng(0))
    assert not result.passed and "unfused chain (Sigmoid -> Mul -> Mul)" in result.detail
    assert result.max_abs < 0.1  # the comparison with the reference alone passes


class Declining(CpuReferenceProvider):
    """cpu_reference that declines one op; ``reason``: what its support_reason says (None:
    the provider has no support_reason)."""

    def __init__(self, op, reason=None):
        super().__init__()
        self.op = op
        if reason is not None:
            self.support_reason = lambda node: reason if node.op_type == op else None

    def supports(self, node):
        return node.op_type != self.op and super().supports(node)


def test_an_unsupported_case_is_skipped_with_the_providers_reason():
    with pytest.raises(UnsupportedCase) as info:
        run_op_case(_case("Sigmoid/wide-range"), "float16", Declining("Sigmoid", "no Sigmoid kernel yet"),
                    CpuReferenceProvider(), np.random.default_rng(0))
    text = str(info.value)
    assert all(s in text for s in ("'cpu_reference'", "ai.onnx.Sigmoid", "[float16]", "no Sigmoid kernel yet"))


def test_without_support_reason_the_skip_names_the_op_dtypes_and_attributes():
    with pytest.raises(UnsupportedCase) as info:
        run_op_case(_case("GroupQueryAttention/decode-per-row-lengths-seq_major"), "float32",
                    Declining("GroupQueryAttention"), CpuReferenceProvider(), np.random.default_rng(0))
    text = str(info.value)
    assert all(s in text for s in ("com.microsoft.GroupQueryAttention", "float32", "num_heads=4",
                                   "kv_num_heads=2", "gave no reason"))


def test_a_kernel_that_raises_fails_its_case_instead_of_skipping_it():
    def sigmoid(ctx, x):
        raise ValueError("a kernel bug")

    with pytest.raises(ValueError, match="a kernel bug") as info:
        run_op_case(_case("Sigmoid/wide-range"), "float32", Broken({("", "Sigmoid"): sigmoid}),
                    CpuReferenceProvider(), np.random.default_rng(0))
    assert not isinstance(info.value, UnsupportedCase)


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


def test_a_prefill_wrong_before_the_last_position_fails_only_the_prompt_gate(tmp_path):
    """The last layer's attention output is wrong at every prompt position but each row's last
    one: no logit the decode gates read changes (the last position, and KV made by earlier
    layers), so only the every-position gate can see it."""
    def gqa(ctx, *args):
        outs = group_query_attention.run(ctx, *args)
        seqlens = np.asarray(args[5]).reshape(-1)
        y = outs[0]
        if "layers.1/" in ctx.node.name and y.shape[1] > 1:
            y = y.copy()
            for b, last in enumerate(seqlens):
                y[b, :last] += 1.0
        return (y, *outs[1:])

    report = run_parity(make_tiny_model(tmp_path / "m"), Broken({("com.microsoft", "GroupQueryAttention"): gqa}),
                        batches=(1, 3), steps=4)
    assert report.gate("prompt").status == "fail"
    assert all(report.gate(g).status == "pass" for g in ("logits", "greedy", "batch_invariance", "prefill_groups"))


class DropsCopies(CpuReferenceProvider):
    """copy_bytes that copies only the first range of each call."""

    def _copy_bytes(self, dst, src, copies):
        super()._copy_bytes(dst, src, list(copies)[:1])


def test_a_copy_bytes_that_drops_ranges_fails_the_prefill_groups_gate(tmp_path):
    report = run_parity(make_tiny_model(tmp_path / "m"), DropsCopies(), batches=(1, 3), steps=4)
    assert report.gate("prefill_groups").status == "fail"
    assert report.gate("batch_invariance").status == "pass"


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
    installed = any(ep.value in ("core.testing.plugin", "lockstep.testing.plugin")
                    for ep in metadata.entry_points(group="pytest11"))
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


def test_a_download_async_that_reads_at_wait_time_fails():
    """A handle that copies when waited on (not when made) returns what later work wrote."""

    class Lazy(CpuReferenceProvider):
        def download_async(self, tensor):
            provider = self

            class Handle:
                def wait(self):
                    return provider.download(tensor)

            return Handle()

    assert run_download_async(CpuReferenceProvider()).passed
    result = run_download_async(Lazy())
    assert not result.passed and "first handle" in result.detail


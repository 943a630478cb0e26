"""The parity kit's tests: every op case, device_argmax, decode_advance, download_async and every decode gate.

Collected by ``pytest --lockstep-provider NAME`` (the plugin adds this file to the run), or
imported by a project's own conformance tests (``from core.testing.suite import *``) next to a
``lockstep_target`` fixture returning a :class:`core.testing.target.KitTarget`.
Each test has a kit id ("op/<case>/<dtype>", "argmax/<case>/<dtype>", "advance/decode_advance",
"advance/download_async", "gate/<name>") that exclusion patterns match.

A case is skipped only for a stated reason: an exclusion rule (its reason and source), a dtype
or KV layout the provider does not declare, or the provider's support check rejecting the
case's node (:class:`core.testing.kit.UnsupportedCase`, naming the op, dtypes, attributes and
the provider's ``support_reason`` when it has one). Any exception is a failure.
"""

from __future__ import annotations

import numpy as np
import pytest

from core.testing.kit import (
    CaseResult,
    UnsupportedCase,
    run_argmax_case,
    run_decode_advance,
    run_download_async,
    run_op_case,
)
from core.testing.op_cases import argmax_params, case_params

GATES = ("logits", "greedy", "batch_invariance", "row_identity", "reuse", "poison", "layout",
         "growth", "prompt", "prefill_groups", "capture")

__all__ = ["test_op", "test_device_argmax", "test_decode_advance", "test_gate"]


def _enter(target, request, kit_id: str) -> None:
    """Record the kit id for the summary and apply a matching exclusion or xfail rule."""
    request.node.user_properties.append(("lockstep_id", kit_id))
    request.node.user_properties.append(("lockstep_provider", target.provider().name))
    rule = target.rule_for(kit_id)
    if rule is None:
        return
    request.node.user_properties.append(("lockstep_detail", f"{rule.kind}: {rule.reason} ({rule.source})"))
    if rule.kind == "exclude":
        pytest.skip(f"excluded by {rule.source}: {rule.reason}")
    request.applymarker(pytest.mark.xfail(reason=f"{rule.source}: {rule.reason}", strict=True))


def _record(request, result: CaseResult) -> None:
    request.node.user_properties.append(("lockstep_detail", result.summary()))


def _skip(request, reason: str) -> None:
    request.node.user_properties.append(("lockstep_detail", reason))
    pytest.skip(reason)


def _check_declared(request, provider, dtype: str, kv_layout: str = "head_major") -> None:
    caps = provider.capabilities()
    if np.dtype(dtype).kind == "f" and dtype not in caps.dtypes:
        _skip(request, f"provider {provider.name!r} declares dtypes {caps.dtypes}, not {dtype}")
    if kv_layout not in caps.kv_layouts:
        _skip(request, f"provider {provider.name!r} declares KV layouts {caps.kv_layouts}, not {kv_layout}")


@pytest.mark.parametrize("kit_id,case,dtype", [pytest.param(*p, id=p[0]) for p in case_params()])
def test_op(lockstep_target, request, kit_id, case, dtype):
    """One single-node model on the provider vs cpu_reference, two fresh random draws, outputs
    poisoned; rows alone and the unfused chain bitwise where the case asks for them."""
    _enter(lockstep_target, request, kit_id)
    provider = lockstep_target.provider()
    _check_declared(request, provider, dtype, case.kv_layout)
    try:
        result = run_op_case(case, dtype, provider, lockstep_target.reference(), lockstep_target.rng(kit_id))
    except UnsupportedCase as exc:
        _skip(request, str(exc))
    _record(request, result)
    assert result.passed, f"{kit_id}: {result.detail} (seed {lockstep_target.seed})"


@pytest.mark.parametrize("kit_id,case,dtype", [pytest.param(*p, id=p[0]) for p in argmax_params()])
def test_device_argmax(lockstep_target, request, kit_id, case, dtype):
    """device_argmax: lowest index on ties, non-finite rows flagged [-1, 1] (docs/cases.md 11, 12, 23)."""
    _enter(lockstep_target, request, kit_id)
    provider = lockstep_target.provider()
    _check_declared(request, provider, dtype)
    result = run_argmax_case(case, dtype, provider, lockstep_target.reference(), lockstep_target.rng(kit_id))
    _record(request, result)
    assert result.passed, f"{kit_id}: {result.detail} (seed {lockstep_target.seed})"


def test_decode_advance(lockstep_target, request):
    """decode_advance feeds tokens back (pad 0 for a flagged row) and advances mask and lengths."""
    _enter(lockstep_target, request, "advance/decode_advance")
    result = run_decode_advance(lockstep_target.provider(), lockstep_target.reference())
    _record(request, result)
    assert result.passed, result.detail


def test_download_async(lockstep_target, request):
    """download_async (optional) returns the tensor as the queued work left it, whatever is
    queued after the call (what lets a session queue step t + 1 before reading step t)."""
    _enter(lockstep_target, request, "advance/download_async")
    result = run_download_async(lockstep_target.provider())
    _record(request, result)
    assert result.passed, result.detail


@pytest.mark.parametrize("kit_id", [pytest.param(f"gate/{g}", id=f"gate/{g}") for g in GATES])
def test_gate(lockstep_target, request, kit_id):
    """One decode gate of :func:`core.testing.parity.run_parity` (computed once per session)."""
    _enter(lockstep_target, request, kit_id)
    gate = lockstep_target.parity().gate(kit_id.split("/", 1)[1])
    request.node.user_properties.append(("lockstep_detail", gate.detail))
    if gate.status == "skip":
        pytest.skip(gate.detail)
    assert gate.status == "pass", gate.detail

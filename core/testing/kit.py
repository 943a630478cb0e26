"""Runners of the op and device_argmax conformance cases (provider under test vs cpu_reference).

:func:`run_op_case` builds the single-node model of an :class:`~core.testing.op_cases.OpCase`,
plans it on both providers, and for ``iterations`` fresh random inputs: poisons the outputs of
the provider under test (its KernelContext buffers filled with NaN, or -7 for integers, where
the tensor type allows item assignment), runs both plans and compares each output with the
case's tolerance. :func:`run_argmax_case` does the same for ``device_argmax``.
Both return a :class:`CaseResult`; neither raises on a mismatch (the caller asserts).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import onnx
from onnx import helper

from core.executor import Plan
from core.protocol import ExecutionProvider
from core.testing.op_cases import ArgmaxCase, OpCase

OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]


@attrs.define
class CaseResult:
    """Outcome of one case on one provider.

    Attributes:
        kit_id: "op/<case>/<dtype>" or "argmax/<case>/<dtype>".
        passed: every output of every iteration was within tolerance.
        max_abs, max_rel: worst absolute error and worst |t - r| / max(|r|, tiny) seen.
        poisoned: outputs were pre-filled with NaN before each run.
        detail: why it failed (output, iteration, first bad index), or "".
    """

    kit_id: str
    passed: bool = True
    max_abs: float = 0.0
    max_rel: float = 0.0
    poisoned: bool = False
    detail: str = ""

    def summary(self) -> str:
        text = f"max_abs={self.max_abs:.3g} max_rel={self.max_rel:.3g}"
        if not self.poisoned:
            text += " (outputs not poisoned)"
        return text + (f"; {self.detail}" if self.detail else "")


def single_node_model(case: OpCase, inputs: dict, dtype: str) -> onnx.ModelProto:
    """The one-node ONNX model of ``case`` for these inputs (constants become initializers)."""
    names = [n if a is not None else "" for n, a in inputs.items()]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node(case.op, names, list(case.outputs), name=case.id.replace("/", "_"),
                            domain=case.domain or None, **case.attributes)
    out_dtype = np.dtype(case.output_dtype or dtype)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                    for n, a in inputs.items() if a is not None and n not in case.constants]
    graph_outputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(out_dtype), None)
                     for n in case.outputs if n]
    inits = [onnx.numpy_helper.from_array(a, n) for n, a in inputs.items()
             if a is not None and n in case.constants]
    graph = helper.make_graph([node], "kit", graph_inputs, graph_outputs, inits)
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=10)


def _fill(tensor: Any, value) -> bool:
    try:
        tensor[...] = value
    except Exception:  # noqa: BLE001 - a tensor type without item assignment is not poisoned
        return False
    return True


def poison_outputs(plan: Plan, shapes: dict[int, tuple], dtypes: dict[int, np.dtype]) -> bool:
    """Pre-fill the persistent output buffers of every node with NaN (floats) or -7 (integers).

    A kernel that takes its outputs from ``ctx.output(i, shape, dtype)`` then starts from
    garbage, so a lane it forgets to write shows up. Returns False when a buffer could not be
    written (the provider's tensors do not support ``t[...] = v``).
    """
    ok = True
    for ctx in plan.contexts:
        for i, shape in shapes.items():
            buf = ctx.output(i, shape, dtypes[i])
            ok &= _fill(buf, np.nan if dtypes[i].kind == "f" else -7)
    return ok


def _compare(test: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> tuple[float, float, int | None]:
    t, r = test.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
    if t.shape != r.shape:
        return np.inf, np.inf, 0
    both_nan = np.isnan(t) & np.isnan(r)
    err = np.where(both_nan, 0.0, np.abs(t - r))
    err = np.where(np.isnan(err), np.inf, err)
    rel = err / np.maximum(np.abs(r), 1e-30)
    bad = np.flatnonzero(err > atol + rtol * np.abs(np.nan_to_num(r)))
    return (float(err.max(initial=0.0)), float(rel.max(initial=0.0)), int(bad[0]) if bad.size else None)


def run_op_case(case: OpCase, dtype: str, provider: ExecutionProvider, reference: ExecutionProvider,
                rng: np.random.Generator, iterations: int = 2) -> CaseResult:
    """Run ``case`` in ``dtype`` on ``provider`` and ``reference``; see the module docstring.

    Raises:
        core.executor.UnsupportedOpError: the provider does not support the node.
    """
    result = CaseResult(f"op/{case.id}/{dtype}", poisoned=True)
    first = case.make_inputs(rng, dtype)
    model = single_node_model(case, first, dtype)
    consts = {n: a for n, a in first.items() if a is not None and n in case.constants}
    plan_ref = Plan(model.graph, consts, reference, case.kv_layout)
    plan_test = Plan(model.graph, consts, provider, case.kv_layout)
    out_names = [n for n in case.outputs if n]
    atol, rtol = case.tolerance[dtype]
    for it in range(iterations):
        inputs = first if it == 0 else case.make_inputs(rng, dtype)
        feeds = {n: a for n, a in inputs.items() if a is not None and n not in case.constants}
        ref = plan_ref.run({n: reference.upload(a.copy()) for n, a in feeds.items()})
        ref = {n: reference.download(v) for n, v in ref.items()}
        slots = {i: ref[n].shape for i, n in enumerate(case.outputs) if n}
        dts = {i: ref[n].dtype for i, n in enumerate(case.outputs) if n}
        result.poisoned &= poison_outputs(plan_test, slots, dts)
        out = plan_test.run({n: provider.upload(a.copy()) for n, a in feeds.items()})
        for index, name in enumerate(case.outputs):
            if not name:
                continue
            test = provider.download(out[name])
            if test.dtype != ref[name].dtype or test.shape != ref[name].shape:
                result.passed = False
                result.detail = (f"output {name!r}: {test.dtype}{test.shape}, reference "
                                 f"{ref[name].dtype}{ref[name].shape}")
                return result
            t, r = test, ref[name]
            if case.select is not None:
                t, r = case.select(inputs, index, t), case.select(inputs, index, r)
            abs_err, rel_err, bad = _compare(t, r, atol, rtol)
            result.max_abs, result.max_rel = max(result.max_abs, abs_err), max(result.max_rel, rel_err)
            if bad is not None and result.passed:
                result.passed = False
                result.detail = (f"output {name!r} iteration {it}: element {bad} (of the compared part) is "
                                 f"{t.ravel()[bad]!r}, reference {r.ravel()[bad]!r}; atol={atol} rtol={rtol}")
    return result


def run_argmax_case(case: ArgmaxCase, dtype: str, provider: ExecutionProvider,
                    reference: ExecutionProvider, rng: np.random.Generator) -> CaseResult:
    """``device_argmax`` on ``provider`` vs ``reference``: results must be identical.

    The result buffer is poisoned with 12345 first; the reference result itself is checked
    against the policy (lowest index of the maximum; [-1, 1] for a non-finite row).
    """
    result = CaseResult(f"argmax/{case.id}/{dtype}")
    logits, positions = case.make(rng, dtype)
    outs = []
    for p in (reference, provider):
        res = p.allocate((logits.shape[0], 2), np.int32)
        result.poisoned = _fill(res, 12345)
        p.device_argmax(p.upload(logits.copy()), p.upload(positions.copy()), res)
        p.synchronize()
        outs.append(p.download(res))
    ref, test = outs
    rows = logits[np.arange(logits.shape[0]), positions].astype(np.float32)
    finite = np.isfinite(rows).all(axis=1)
    policy = np.stack([np.where(finite, rows.argmax(axis=1), -1), ~finite], axis=1).astype(np.int32)
    if not np.array_equal(ref, policy):
        result.passed = False
        result.detail = f"the reference breaks the argmax policy: {ref.tolist()} != {policy.tolist()}"
    elif not np.array_equal(test, ref):
        result.passed = False
        rows_bad = np.flatnonzero((test != ref).any(axis=1)).tolist()
        result.detail = f"rows {rows_bad}: got {test[rows_bad].tolist()}, expected {ref[rows_bad].tolist()}"
    result.max_abs = float(np.abs(test.astype(np.int64) - ref).max(initial=0))
    return result


def run_decode_advance(provider: ExecutionProvider, reference: ExecutionProvider) -> CaseResult:
    """``decode_advance`` on both providers: a flagged row feeds pad id 0; mask and lengths advance."""
    result = CaseResult("advance/decode_advance", poisoned=True)
    res = np.array([[7, 0], [-1, 1], [3, 0]], np.int32)
    lengths = np.array([2, 5, 0], np.int32)
    outs = []
    for p in (reference, provider):
        ids, mask, lens = p.upload(np.full((3, 1), 99, np.int64)), p.upload(np.zeros((3, 8), np.int64)), \
            p.upload(lengths.copy())
        p.decode_advance(p.upload(res.copy()), ids, mask, lens)
        p.synchronize()
        outs.append([p.download(t) for t in (ids, mask, lens)])
    want_mask = np.zeros((3, 8), np.int64)
    want_mask[[0, 1, 2], lengths] = 1
    want = [np.array([[7], [0], [3]], np.int64), want_mask, lengths + 1]
    for name, got, exp in zip(("input_ids", "attention_mask", "lengths"), outs[1], want):
        if not np.array_equal(got, exp):
            result.passed = False
            result.detail = f"{name}: got {got.tolist()}, expected {exp.tolist()}"
    return result

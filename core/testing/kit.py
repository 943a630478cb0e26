"""Runners of the op and device_argmax conformance cases (provider under test vs cpu_reference).

:func:`run_op_case` builds the single-node model of an :class:`~core.testing.op_cases.OpCase`,
checks that the provider supports its node (else it raises :class:`UnsupportedCase`, whose
message says why; the suite skips the case with it), plans it on both providers, and for
``iterations`` fresh random inputs: poisons the node's output buffers on the provider under
test (its KernelContext buffers filled with NaN, -7 for integers), runs both plans and compares
each output with the case's tolerance. On the first inputs it also checks the case's bitwise
properties on the provider under test: every row run alone equals its row of the batch
(``OpCase.rows``), and a fused node equals its unfused chain (``OpCase.unfused``).

``CaseResult.poisoned`` is True only when every output came back in the very buffer that was
poisoned (or is an input written in place, like a shared KV cache): a kernel that returns a
fresh array instead of writing into ``ctx.output`` is reported as not poisoned, since nothing
then shows an element it forgets to write.

:func:`run_argmax_case` does the same for ``device_argmax``. Both return a :class:`CaseResult`
and do not raise on a mismatch (the caller asserts); an exception raised by a kernel
propagates (a failure, never a skip).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import onnx
from onnx import helper

from core.executor import Plan, UnsupportedOpError, node_infos
from core.fusion import FUSED_DOMAIN
from core.protocol import ExecutionProvider, NodeInfo
from core.testing.op_cases import ArgmaxCase, OpCase

OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1),
          helper.make_opsetid(FUSED_DOMAIN, 1)]


class UnsupportedCase(UnsupportedOpError):
    """The provider's support check rejects a node of the case; the message names the
    provider, op, domain, input dtypes and attributes, and the provider's own reason."""


@attrs.define
class CaseResult:
    """Outcome of one case on one provider.

    Attributes:
        kit_id: "op/<case>/<dtype>" or "argmax/<case>/<dtype>".
        passed: every output of every iteration was within tolerance, and the case's bitwise
            properties (rows, unfused) held.
        max_abs, max_rel: worst absolute error and worst |t - r| / max(|r|, tiny) seen.
        poisoned: every output came back in its poisoned buffer (or is an input written in
            place), so an element the kernel did not write would have shown as NaN.
        unpoisoned: names of the outputs that came back in other buffers.
        detail: why it failed (output, iteration, first bad index), or "".
    """

    kit_id: str
    passed: bool = True
    max_abs: float = 0.0
    max_rel: float = 0.0
    poisoned: bool = False
    unpoisoned: list[str] = attrs.field(factory=list)
    detail: str = ""

    def fail(self, detail: str) -> None:
        """Mark the case failed; the first failure's detail is kept."""
        if self.passed:
            self.passed, self.detail = False, detail

    def summary(self) -> str:
        """One line: the worst errors, whether the outputs were poisoned, and the detail."""
        text = f"max_abs={self.max_abs:.3g} max_rel={self.max_rel:.3g}"
        if not self.poisoned:
            names = ", ".join(self.unpoisoned)
            text += f" (outputs not poisoned{': ' + names if names else ''})"
        return text + (f"; {self.detail}" if self.detail else "")


def _output_dtypes(case: OpCase, dtype: str) -> list[np.dtype]:
    spec = case.output_dtype
    per_output = spec if isinstance(spec, tuple) else (spec,) * len(case.outputs)
    return [np.dtype(d or dtype) for d in per_output]


def _model(case: OpCase, nodes: list[onnx.NodeProto], inputs: dict, dtype: str) -> onnx.ModelProto:
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                    for n, a in inputs.items() if a is not None and n not in case.constants]
    graph_outputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(d), None)
                     for n, d in zip(case.outputs, _output_dtypes(case, dtype)) if n]
    inits = [onnx.numpy_helper.from_array(a, n) for n, a in inputs.items()
             if a is not None and n in case.constants]
    graph = helper.make_graph(nodes, "kit", graph_inputs, graph_outputs, inits)
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=10)


def single_node_model(case: OpCase, inputs: dict, dtype: str) -> onnx.ModelProto:
    """The one-node ONNX model of ``case`` for these inputs (constants become initializers;
    an absent input, None, is written as "")."""
    names = [n if a is not None else "" for n, a in inputs.items()]
    node = helper.make_node(case.op, names, list(case.outputs), name=case.id.replace("/", "_"),
                            domain=case.domain or None, **case.attributes)
    return _model(case, [node], inputs, dtype)


def unfused_model(case: OpCase, inputs: dict, dtype: str) -> onnx.ModelProto:
    """The model of ``case.unfused()``: the chain of standard ops the case's fused node stands for."""
    assert case.unfused is not None
    return _model(case, case.unfused(), inputs, dtype)


def support_message(provider: ExecutionProvider, node: NodeInfo) -> str | None:
    """None when ``provider.supports(node)``; else why not, naming the provider, the op and its
    domain, the input dtypes and the attributes, followed by the provider's own reason when it
    gives one (the optional member ``support_reason(node) -> str | None``)."""
    if provider.supports(node):
        return None
    reason = provider.support_reason(node)
    dtypes = ", ".join("-" if d is None else np.dtype(d).name for d in node.input_dtypes)
    attributes = ", ".join(f"{k}={v!r}" for k, v in sorted(node.attrs.items()))
    return (f"provider {provider.name!r} does not support {node.domain or 'ai.onnx'}.{node.op_type} "
            f"(input dtypes [{dtypes}]; attributes {{{attributes}}}): "
            f"{reason or 'supports() returned False and gave no reason'}")


def _require_support(provider: ExecutionProvider, model: onnx.ModelProto) -> None:
    for node in node_infos(model.graph):
        message = support_message(provider, node)
        if message is not None:
            raise UnsupportedCase(message)


class _Unfused:
    """``provider`` with the fused (lockstep-domain) ops hidden from planning, so the executor
    keeps a chain of standard ops unfused."""

    def __init__(self, provider: ExecutionProvider):
        self._provider = provider

    def __getattr__(self, name: str) -> Any:
        return getattr(self._provider, name)

    def supports(self, node: NodeInfo) -> bool:
        return node.domain != FUSED_DOMAIN and self._provider.supports(node)


def _poison_value(dtype: np.dtype):
    if dtype.kind == "f":
        return np.nan
    if dtype.kind == "b":
        return True
    return np.iinfo(dtype).max if dtype.kind == "u" else -7


def _fill(tensor: Any, value) -> bool:
    try:
        tensor[...] = value
    except Exception:  # noqa: BLE001 - a tensor type without item assignment is not poisoned
        return False
    return True


def poison_outputs(plan: Plan, like: dict[int, np.ndarray]) -> dict[int, Any]:
    """Pre-fill the persistent output buffers of the node of a single-node ``plan`` with NaN
    (floats), -7 (signed integers) or the largest value (unsigned, bool True), for outputs
    shaped like ``like`` (slot -> array of the output's shape and dtype).

    A kernel that takes its outputs from ``ctx.output(i, shape, dtype)`` then starts from
    garbage, so a lane it forgets to write shows up. Returns slot -> the poisoned buffer (a
    slot is missing when its tensor type does not support ``t[...] = v``).
    """
    ctx = plan.contexts[0]
    buffers = {}
    for i, array in like.items():
        buf = ctx.output(i, array.shape, array.dtype)
        if _fill(buf, _poison_value(array.dtype)):
            buffers[i] = buf
    return buffers


def _address(tensor: Any) -> int | None:
    """Address of a tensor's first element (device or host), None without an array interface."""
    for attr in ("__cuda_array_interface__", "__array_interface__"):
        face = getattr(tensor, attr, None)
        if face is not None:
            return face["data"][0]
    return None


def _feeds(provider: ExecutionProvider, case: OpCase, inputs: dict) -> dict[str, Any]:
    """The fed inputs on ``provider``: uploaded copies (host copies for ``case.host``)."""
    return {n: a.copy() if n in case.host else provider.upload(a.copy()) for n, a in inputs.items()
            if a is not None and n not in case.constants}


def _reference(plan: Plan, reference: ExecutionProvider, case: OpCase, inputs: dict) -> dict[str, np.ndarray]:
    out = plan.run(_feeds(reference, case, inputs))
    return {n: reference.download(out[n]) for n in case.outputs if n}


def _run_test(plan: Plan, provider: ExecutionProvider, case: OpCase, inputs: dict,
              like: dict[str, np.ndarray], result: CaseResult) -> dict[str, np.ndarray]:
    """Run ``plan`` on poisoned output buffers (shaped like the reference outputs ``like``);
    returns the host outputs and records in ``result`` the ones not in their poisoned buffer."""
    buffers = poison_outputs(plan, {i: like[n] for i, n in enumerate(case.outputs) if n})
    feeds = _feeds(provider, case, inputs)
    out = plan.run(feeds)
    in_place = {_address(t) for t in feeds.values()}
    host = {}
    for i, name in enumerate(case.outputs):
        if not name:
            continue
        at = _address(out[name])
        if at is None or (at != _address(buffers.get(i)) and at not in in_place):
            result.poisoned = False
            if name not in result.unpoisoned:
                result.unpoisoned.append(name)
        host[name] = provider.download(out[name])
    return host


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


def _first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """Index of the first element whose bits differ (0 for another dtype or size), or None."""
    a, b = np.ascontiguousarray(a).ravel(), np.ascontiguousarray(b).ravel()
    if a.dtype != b.dtype or a.size != b.size:
        return 0
    if a.size == 0:
        return None
    diff = (a.view(np.uint8).reshape(a.size, -1) != b.view(np.uint8).reshape(b.size, -1)).any(axis=1)
    bad = np.flatnonzero(diff)
    return int(bad[0]) if bad.size else None


def _selected(case: OpCase, inputs: dict, index: int, array: np.ndarray) -> np.ndarray:
    return (array if case.select is None else case.select(inputs, index, array)).ravel()


def _check_rows(case: OpCase, inputs: dict, batch: dict[str, np.ndarray], plan_ref: Plan, plan_test: Plan,
                reference: ExecutionProvider, provider: ExecutionProvider, result: CaseResult) -> None:
    """Each row alone (``case.rows`` sliced, then ``case.alone``) must give the bits of its row
    in ``batch`` (the provider's outputs for ``inputs``), on poisoned buffers."""
    n_rows = inputs[case.rows[0]].shape[0]
    for i in range(n_rows):
        row = {n: a[i:i + 1] if n in case.rows else a for n, a in inputs.items()}
        alone = case.alone(row) if case.alone is not None else row
        got = _run_test(plan_test, provider, case, alone, _reference(plan_ref, reference, case, alone), result)
        for k, name in enumerate(case.outputs):
            if not name:
                continue
            want = _selected(case, row, k, batch[name][i:i + 1])
            have = _selected(case, alone, k, got[name])
            j = _first_difference(want, have)
            if j is not None:
                result.fail(f"output {name!r}: row {i} run alone differs from row {i} of the batch of "
                            f"{n_rows} at element {j} (of the compared part): {have[j:j + 1].tolist()} alone, "
                            f"{want[j:j + 1].tolist()} in the batch")
                return


def _check_unfused(case: OpCase, dtype: str, inputs: dict, fused: dict[str, np.ndarray],
                   provider: ExecutionProvider, result: CaseResult) -> None:
    """The chain ``case.unfused()`` run unfused on ``provider`` must give the bits of ``fused``."""
    model = unfused_model(case, inputs, dtype)
    constants = {n: a for n, a in inputs.items() if a is not None and n in case.constants}
    plan = Plan(model.graph, constants, _Unfused(provider), case.kv_layout)
    out = plan.run(_feeds(provider, case, inputs))
    chain = " -> ".join(n.op_type for n in plan.nodes)
    for name in case.outputs:
        if not name:
            continue
        want, have = fused[name].ravel(), provider.download(out[name]).ravel()
        j = _first_difference(want, have)
        if j is not None:
            result.fail(f"output {name!r}: {case.domain}.{case.op} differs from its unfused chain ({chain}) "
                        f"at element {j}: {want[j:j + 1].tolist()} fused, {have[j:j + 1].tolist()} unfused")


def run_op_case(case: OpCase, dtype: str, provider: ExecutionProvider, reference: ExecutionProvider,
                rng: np.random.Generator, iterations: int = 2) -> CaseResult:
    """Run ``case`` in ``dtype`` on ``provider`` and ``reference``; see the module docstring.

    Raises:
        UnsupportedCase: ``provider.supports`` rejects the case's node (or a node of its
            unfused chain); the message says why.
    """
    result = CaseResult(f"op/{case.id}/{dtype}", poisoned=True)
    first = case.make_inputs(rng, dtype)
    model = single_node_model(case, first, dtype)
    _require_support(provider, model)
    if case.unfused is not None:
        _require_support(provider, unfused_model(case, first, dtype))
    consts = {n: a for n, a in first.items() if a is not None and n in case.constants}
    plan_ref = Plan(model.graph, consts, reference, case.kv_layout)
    plan_test = Plan(model.graph, consts, provider, case.kv_layout)
    atol, rtol = case.tolerance[dtype]
    for it in range(iterations):
        inputs = first if it == 0 else case.make_inputs(rng, dtype)
        ref = _reference(plan_ref, reference, case, inputs)
        out = _run_test(plan_test, provider, case, inputs, ref, result)
        for index, name in enumerate(case.outputs):
            if not name:
                continue
            test = out[name]
            if test.dtype != ref[name].dtype or test.shape != ref[name].shape:
                result.fail(f"output {name!r}: {test.dtype}{test.shape}, reference {ref[name].dtype}{ref[name].shape}")
                return result
            t, r = _selected(case, inputs, index, test), _selected(case, inputs, index, ref[name])
            abs_err, rel_err, bad = _compare(t, r, atol, rtol)
            result.max_abs, result.max_rel = max(result.max_abs, abs_err), max(result.max_rel, rel_err)
            if bad is not None:
                result.fail(f"output {name!r} iteration {it}: element {bad} (of the compared part) is "
                            f"{t[bad]!r}, reference {r[bad]!r}; atol={atol} rtol={rtol}")
        if it == 0 and result.passed:
            if case.rows:
                _check_rows(case, inputs, out, plan_ref, plan_test, reference, provider, result)
            if case.unfused is not None:
                _check_unfused(case, dtype, inputs, out, provider, result)
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
        result.fail(f"the reference breaks the argmax policy: {ref.tolist()} != {policy.tolist()}")
    elif not np.array_equal(test, ref):
        rows_bad = np.flatnonzero((test != ref).any(axis=1)).tolist()
        result.fail(f"rows {rows_bad}: got {test[rows_bad].tolist()}, expected {ref[rows_bad].tolist()}")
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
    want: list[np.ndarray] = [np.array([[7], [0], [3]], np.int64), want_mask, lengths + 1]
    for name, got, exp in zip(("input_ids", "attention_mask", "lengths"), outs[1], want):
        if not np.array_equal(got, exp):
            result.fail(f"{name}: got {got.tolist()}, expected {exp.tolist()}")
    return result


def run_download_async(provider: ExecutionProvider) -> CaseResult:
    """``download_async`` (optional): the handle returns the tensor as the queued work left it,
    although a write and a decode_advance queued after the call change the tensor before
    ``wait()``; two handles in flight at once; the default (a synchronous download,
    :class:`core.provider.ReadyDownload`) passes."""
    result = CaseResult("advance/download_async", poisoned=True)
    start = provider.download_async
    first = np.array([[7, 0], [-1, 1], [3, 0]], np.int32)
    t = provider.upload(first.copy())
    a = start(t)
    provider.write(t, first + 10)
    b = start(t)
    ids, mask, lens = provider.upload(np.zeros((3, 1), np.int64)), provider.upload(np.zeros((3, 8), np.int64)), \
        provider.upload(np.zeros(3, np.int32))
    provider.decode_advance(t, ids, mask, lens)  # a kernel reading t, queued behind both copies
    provider.write(t, first + 20)
    for name, handle, want in (("first", a, first), ("second", b, first + 10)):
        got = np.asarray(handle.wait())
        if got.shape != want.shape or not np.array_equal(got, want):
            result.fail(f"download_async ({name} handle): got {got.tolist()}, expected {want.tolist()}")
    provider.synchronize()
    if not np.array_equal(provider.download(t), first + 20):
        result.fail("download_async: the tensor did not take the later write")
    return result


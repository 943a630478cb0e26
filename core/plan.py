"""``lockstep plan``: the residency plan of a model under a budget, before loading it.

The sizes come from the ONNX header and the external data's layout (memory maps that are never
read: no weight is loaded, prepared or uploaded). The graph is fused with the provider's fusion
rules, so the pages are the nodes the provider will run; the planner is the one the Runner uses
(:func:`core.runtime.residency.plan_residency`), over the prepared forms the provider declares
(packed for the tensor cores: :mod:`core.runtime.forecast`), as the load plans them.

Per batch size B, the device budget is shared as the Runner shares it once the KV cache of B
rows at ``context`` tokens and their workspace (:mod:`core.runtime.workspace`: a decode step's,
and a prefill's of B prompts of ``context`` tokens on top) are allocated: the weight budget is
the device budget less that KV and that workspace.
The copy floor of a step is the streamed bytes over the measured host-to-device bandwidth; the
expected step is the longer of the copy floor and the time to read every weight byte once at
the device bandwidth (copies overlap compute on their own stream), and the expected rate is B
tokens per expected step.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np

from core import fusion
from core.errors import RequestError
from core.executor import is_host_constant, node_infos
from core.models.model import Model, load_model
from core.opdefs import constant_supports, constant_value
from core.ops import Spec
from core.runtime import expert_budget as expert_budget_mod
from core.runtime import residency, rowblocks
from core.runtime.experts import ExpertBudgetError
from core.runtime.forecast import Forecast

#: KV tokens per row of ``lockstep plan`` without ``--context`` (the model context when shorter).
DEFAULT_CONTEXT = 2048

#: Ops whose folded output has the bytes of their first input.
_VIEWS = ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity")


@attrs.frozen
class BatchPlan:
    """The plan of one batch size.

    Attributes:
        batch: rows decoded together.
        kv_bytes: KV cache bytes of ``batch`` rows at the plan's context.
        workspace_bytes: the workspace of ``batch`` rows (activations, the provider's scratch
            and the decode state's buffers: :mod:`core.runtime.workspace`), with what a prefill
            of ``batch`` prompts of the plan's context allocates on top; reserved in a device
            budget beside the KV.
        residency: the residency plan for the weight budget left.
        copy_floor_s: seconds per step the streamed bytes take at the host-to-device bandwidth
            (None: bandwidth unknown).
        expected_tok_s: tokens/s expected (module docstring; None: no bandwidth known).
        error: why no plan works at this batch (then ``residency`` is None).
        expert_bytes: device bytes of a MoE model's paged experts (resident experts and the
            ring; 0: not paged), beside ``residency``'s dense weights.
    """

    batch: int
    kv_bytes: int
    residency: residency.ResidencyPlan | None
    copy_floor_s: float | None = None
    expected_tok_s: float | None = None
    error: str = ""
    expert_bytes: int = 0
    workspace_bytes: int = 0

    def row(self) -> dict:
        """The plan as one JSON-able row."""
        r = self.residency
        if r is None:
            return {"batch": self.batch, "kv_bytes": self.kv_bytes, "workspace_bytes": self.workspace_bytes,
                    "error": self.error}
        return {"batch": self.batch, "kv_bytes": self.kv_bytes, "workspace_bytes": self.workspace_bytes,
                "weight_budget": r.budget, "expert_bytes": self.expert_bytes,
                "weight_bytes_resident": r.weight_bytes_resident,
                "weight_bytes_streamed_per_step": r.weight_bytes_streamed_per_step,
                "weight_bytes_mapped": r.weight_bytes_mapped, "staging_slots": r.slots,
                "slot_bytes": r.slot_bytes, "pages_per_step": r.page_ins_per_step, "page_bytes": r.page_bytes,
                "row_block_pages_per_step": r.row_block_pages,
                "copy_floor_ms": None if self.copy_floor_s is None else self.copy_floor_s * 1e3,
                "expected_tok_s": self.expected_tok_s}


class _Header:
    """The parts of :class:`core.executor.Plan` that :class:`core.runtime.forecast.Forecast`
    reads, built from the graph and the initializers' shapes alone (no kernel runs, nothing is
    uploaded): every constant as a :class:`core.ops.Spec` (a folded view of a weight: a copy of
    its bytes, in the view's shape where the header gives it)."""

    def __init__(self, model: Model, provider: Any, device: bool):
        inits = model.initializers
        outputs = {o.name for o in model.graph.output}
        self.provider = provider
        self.nodes = fusion.apply(node_infos(model.graph), outputs, provider.supports, set(inits))
        nbytes = {name: 0 if device and is_host_constant(a) else int(a.nbytes) for name, a in inits.items()}
        self.constants: dict[str, Spec] = {name: Spec(a.shape, a.dtype, name) for name, a in inits.items()}
        self._pending = {name for name, a in inits.items() if not is_host_constant(a)}
        self.steps: list[int] = []
        consumed: set[str] = set()
        for i, n in enumerate(self.nodes):
            if all(not x or x in self.constants for x in n.inputs):  # folded once at load
                consumed.update(x for x in n.inputs if x)
                for y in n.outputs:
                    if n.op_type in _VIEWS and n.inputs and n.inputs[0]:
                        # under a budget a reshape folds on the host into a copy of its input
                        nbytes[y] = nbytes[n.inputs[0]]
                        self.constants[y] = _view_spec(n, self.constants[n.inputs[0]], inits)
                        continue
                    # a Constant's value is in its attribute; a device provider keeps it on the host
                    value = constant_value(n) if n.op_type == "Constant" and constant_supports(n) else None
                    nbytes.setdefault(y, 0 if device or value is None else int(np.asarray(value).nbytes))
                    array: np.ndarray = np.asarray(value) if value is not None else np.zeros(0, np.uint8)
                    self.constants[y] = Spec(array.shape, array.dtype, y)
            else:
                self.steps.append(i)
        read = {x for i in self.steps for x in self.nodes[i].inputs} | outputs
        for name in consumed - read:  # a folded node's input nothing else reads: dropped, as the plan does
            del self.constants[name]
        self._nbytes = nbytes
        self.staged_weights: dict = {}

    def _weight_nbytes(self, name: str, value: Any) -> int:
        return self._nbytes[name]

    def _storage_names(self) -> dict[str, str]:
        return {}  # every constant owns its bytes (a folded view is a copy)

    def _prepare_order(self) -> list[int]:
        from core.executor.prepare import Preparing

        return Preparing._prepare_order(self)  # type: ignore[arg-type]


def _view_spec(node, spec: Spec, inits: dict) -> Spec:
    """The Spec of a folded view op's output (``_VIEWS``) of a constant ``spec``: a Reshape to a
    constant shape or an Identity in their shapes, another view flat (its bytes are what count)."""
    shape: tuple[int, ...] | None = spec.shape if node.op_type == "Identity" else None
    target = inits.get(node.inputs[1]) if node.op_type == "Reshape" and len(node.inputs) > 1 else None
    if target is not None:
        dims = [int(d) for d in np.asarray(target).reshape(-1)]
        dims = [spec.shape[k] if d == 0 and not node.attrs.get("allowzero") and k < spec.ndim else d
                for k, d in enumerate(dims)]
        known = int(np.prod([d for d in dims if d != -1], dtype=np.int64))
        if dims.count(-1) <= 1 and known and spec.size % known == 0:
            shape = tuple(spec.size // known if d == -1 else d for d in dims)
    return Spec(shape if shape is not None else (spec.size,), spec.dtype, node.outputs[0])


def header_of(model: Model, provider: Any) -> _Header:
    """The header of ``model`` on ``provider`` (cpu_reference when None): its fused nodes and
    the constants' shapes, nothing read."""
    if provider is None:
        from providers.cpu_reference.provider import CpuReferenceProvider

        provider = CpuReferenceProvider()
    from core.opdefs import is_host

    return _Header(model, provider, not is_host(provider.allocate((1,), np.float32)))


def _forecast(model: Model, provider: Any) -> Forecast:
    """The header of ``model`` on ``provider`` (cpu_reference when None) as the load will prepare
    it (:class:`core.runtime.forecast.Forecast`: the declared prepared forms)."""
    return Forecast(header_of(model, provider))


def header_weights(model: Model, provider: Any = None) -> tuple[residency.Weight, ...]:
    """The per-step weights of ``model`` (:func:`residency.weights_of`) from its header, and
    the constants no step reads as one always-resident entry (as the Runner plans): the graph
    fused with ``provider``'s rules (cpu_reference's when None), sizes from the initializers'
    shapes and dtypes and the prepared forms ``provider`` declares, nothing read."""
    view = _forecast(model, provider)
    other = view.unread_bytes()
    weights = residency.weights_of(view)
    return (*weights, residency.unread_weight(other)) if other else weights


def header_splits(model: Model, provider: Any = None) -> dict:
    """The nodes of ``model`` that ``provider`` runs in row blocks
    (:func:`core.runtime.rowblocks.node_splits`), from the header: the shapes of the
    initializers and of the prepared forms ``provider`` declares."""
    return rowblocks.plan_splits(_forecast(model, provider))


def kv_bytes(model: Model, batch: int, context: int) -> int:
    """KV cache bytes of ``batch`` rows of ``context`` tokens (keys and values, every layer)."""
    c = model.config
    return 2 * c.num_layers * batch * c.num_kv_heads * c.head_size * context * np.dtype(model.io_dtype).itemsize


def expected_rate(streamed: int, resident: int, batch: int, provider: Any = None,
                  h2d: float | None = None, device_bw: float | None = None) -> float | None:
    """Tokens/s expected at ``batch`` rows (module docstring): B over the longer of the copy
    floor (``streamed`` bytes at ``h2d`` bytes/s) and reading every weight byte once at
    ``device_bw`` bytes/s; bandwidths the caller does not give come from ``provider``'s
    measurements. None when the host-to-device bandwidth is unknown and something streams."""
    if h2d is None and provider is not None:
        h2d = provider.host_to_device_bandwidth()
    if device_bw is None and provider is not None:
        device_bw = provider.device_bandwidth()
    floor = streamed / h2d if h2d else (0.0 if not streamed else None)
    if floor is None:
        return None
    read = (streamed + resident) / device_bw if device_bw else 0.0
    step = max(floor, read)
    return batch / step if step > 0 else None


def plan_model(model: Model | str, batches: Sequence[int], context: int, provider: Any = None,
               device_budget: int | str | None = None, weight_budget: int | float | str | None = None,
               slots: int | None = None, h2d: float | None = None,
               device_bw: float | None = None, page_bytes: int | str | None = None,
               expert_budget: int | float | str | None = None) -> list[BatchPlan]:
    """The plan of each batch size (module docstring).

    Args:
        model: a loaded model or its folder (only the header and the data file's size are read).
        batches: batch sizes.
        context: KV tokens per row.
        provider: a provider object (its fusion rules and measured bandwidths), or None.
        device_budget, weight_budget: as the Runner's (bytes or sizes; a weight budget may be a
            fraction of the weight bytes). Neither: everything resident.
        slots: staging slots (default: the planner's).
        h2d, device_bw: bandwidths in bytes/s replacing the provider's measurements.
        page_bytes: the page size of row blocks (as the Runner's; default ``LOCKSTEP_PAGE_BYTES``).
        expert_budget: as the Runner's: with it, or another budget on a MoE model, the experts
            are paged (ring of 2 slots) and the dense weights planned beside them.

    Returns:
        one :class:`BatchPlan` per batch size; one whose budget is too small carries the reason
        (the smallest working weight budget, the KV the batch takes) instead of a plan.

    Raises:
        core.runtime.residency.BudgetError: a malformed budget.
    """
    from core.runtime import workspace

    if not isinstance(model, Model):
        model = load_model(model)
    weights = header_weights(model, provider)
    header = header_of(model, provider)
    splits, page = header_splits(model, provider), rowblocks.page_bytes(page_bytes)
    total = sum(w.nbytes for w in weights)
    device = residency.parse_budget(device_budget, total, fractions=False)
    budget = residency.parse_budget(weight_budget, total)
    layout = expert_budget_mod.ExpertLayout.of(model)
    if expert_budget is not None and not layout.counts:
        raise residency.BudgetError("an expert budget needs a model with MoE / QMoE nodes; this one has none")
    paged = bool(layout.counts) and (expert_budget is not None or device is not None or budget is not None)
    experts = residency.parse_budget(expert_budget, layout.total_bytes)
    if paged:
        weights = tuple(w for w in weights if not expert_budget_mod.is_expert(w, set(layout.counts)))
    mappable = provider is None or bool(provider.capabilities().weight_streaming)
    if h2d is None and provider is not None:
        h2d = provider.host_to_device_bandwidth()
    if device_bw is None and provider is not None:
        device_bw = provider.device_bandwidth()
    out = []
    for b in batches:
        kv = kv_bytes(model, b, context)
        work = workspace.estimate(model, header, header.provider, b, context, (b, context))
        wb = budget
        if device is not None:
            wb = min(budget if budget is not None else device, device - kv - work)
            need = kv + work + residency.smallest_budget(weights, slots, mappable, splits, page)
            if wb <= 0 or need > device:
                out.append(BatchPlan(b, kv, None, workspace_bytes=work,
                                     error=f"the {kv:,} bytes of KV and the {work:,} bytes of workspace leave the "
                                           f"weights too little of the device budget of {device:,} bytes; this batch "
                                           f"needs a device budget of at least {need:,} bytes (its KV and workspace "
                                           "plus the smallest working weight budget)"))
                continue
        held = 0
        try:
            if paged:
                wb, got = expert_budget_mod.split(wb, experts, sum(w.nbytes for w in weights), layout, 2)
                held = got or 0
            r = residency.plan_residency(weights, wb, slots, mappable, splits, page)
        except (residency.BudgetError, ExpertBudgetError) as exc:
            more = "" if not held or isinstance(exc, ExpertBudgetError) else (
                f"; beside the experts' {held:,} bytes the smallest working budget is "
                f"{held + residency.smallest_budget(weights, slots, mappable, splits, page):,} bytes")
            out.append(BatchPlan(b, kv, None, workspace_bytes=work, error=str(exc) + more))
            continue
        streamed = r.weight_bytes_streamed_per_step
        floor = streamed / h2d if h2d else (0.0 if not streamed else None)
        rate = expected_rate(streamed, r.weight_bytes_resident, b, None, h2d, device_bw)
        out.append(BatchPlan(b, kv, r, floor, rate, expert_bytes=held, workspace_bytes=work))
    return out


def main(a, console) -> int:
    """``lockstep plan``: print (or write as JSON) :func:`plan_model`'s rows for ``a.model``.

    Raises:
        core.runtime.residency.BudgetError: a budget too small (the smallest working one named).
        core.models.model.ModelError: the folder is not a builder model.
        RequestError: ``--context`` beyond the model context.
    """
    import json

    from rich.markup import escape
    from rich.table import Table

    from core.plugins import get_provider

    provider, note, short = None, "", ""  # an unknown provider name is refused by the command (core.cli)
    try:
        provider = get_provider(a.provider)
    except Exception as exc:  # noqa: BLE001 - an unusable provider: plan with the reference fusion rules
        note = f"provider {a.provider!r} unavailable ({exc}); fusion rules of cpu_reference"
        short = (f"provider {a.provider!r} cannot start here, `lockstep providers` says why; "
                 "fusion rules of cpu_reference")  # the title: the whole reason is the JSON's note
    h2d = a.h2d_gbps * 1e9 if a.h2d_gbps else None
    model = load_model(a.model)
    context = model.config.context_length
    if a.context is None:
        a.context = min(DEFAULT_CONTEXT, context)
    elif a.context > context:
        raise RequestError(f"--context {a.context} is more than the model context of {context} positions; "
                           f"give at most --context {context}")
    rows = plan_model(model, a.batch, a.context, provider, a.device_budget, a.weight_budget, a.staging_slots,
                      h2d=h2d, page_bytes=a.page_size, expert_budget=a.expert_budget)
    if a.json:
        print(json.dumps({"model": str(model.folder), "provider": a.provider, "context": a.context,
                          "device_budget": a.device_budget, "weight_budget": a.weight_budget,
                          "weight_bytes": model.weight_bytes(), "note": note,
                          "rows": [r.row() for r in rows]}, indent=2))
        return 0
    gb = 1e9
    title = (f"{model.folder.name}: {model.weight_bytes() / gb:.2f} GB of weights, {a.context} tokens of KV per row"
             + (f" ({short})" if short else ""))
    table = Table("batch", "KV GB", "workspace MiB", "weight budget GB", "resident GB", "mapped GB", "streamed GB/step",
                  "ring", "copy floor ms", "expected tok/s", title=escape(title))
    for p in rows:
        r = p.residency
        if r is None:
            table.add_row(str(p.batch), f"{p.kv_bytes / gb:.2f}", f"{p.workspace_bytes / 2**20:.1f}", *["-"] * 7)
            continue
        ring = f"{r.slots} x {r.slot_bytes / 2**20:.0f} MiB, {r.page_ins_per_step} pages" if r.slots else "-"
        table.add_row(str(p.batch), f"{p.kv_bytes / gb:.2f}", f"{p.workspace_bytes / 2**20:.1f}",
                      "-" if r.budget is None else f"{r.budget / gb:.2f}",
                      f"{r.weight_bytes_resident / gb:.2f}", f"{r.weight_bytes_mapped / gb:.2f}",
                      f"{r.weight_bytes_streamed_per_step / gb:.2f}", ring,
                      "?" if p.copy_floor_s is None else f"{p.copy_floor_s * 1e3:.1f}",
                      "?" if p.expected_tok_s is None else f"{p.expected_tok_s:.1f}")
    console.print(table)
    for p in rows:
        if p.residency is None:
            console.print(f"batch {p.batch} does not fit: {escape(p.error)}")
    return 0

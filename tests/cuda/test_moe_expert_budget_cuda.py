"""One budget for a MoE model's dense weights and experts on cuda (core.runtime.expert_budget,
providers/cuda/expert_pager.py page_runner; GPU only).

The tiny gpt-oss folders of core.testing.moe_families (fp16 CUDA build: MoE; int4 CPU build:
QMoE), 2 MoE layers of 8 experts, top 2. A Runner with an expert budget loads its experts
straight from the file into pinned host pages (never onto the device: the load's device peak
stays below the all-resident load's by most of the cold experts), and decodes bitwise the
all-resident run, eager and captured, at batch 1 and 8, with the session's expert counters
showing the page-ins; a weight budget shared with the experts likewise, and a plain device budget
(the experts sized around the session's KV cache and workspace, ``reserve_for``) within its
accounting; a budget too small is refused naming the smallest, which then runs bitwise.

    pytest -q tests/cuda/test_moe_expert_budget_cuda.py      # builds 2 tiny folders (~20 s each)
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from _gpu import MOE_PROMPTS, require_gpu

require_gpu()
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai", reason="the builder (the models extra) makes the family folders")

from core.generation.loop import decode  # noqa: E402
from core.runtime.expert_budget import ExpertLayout  # noqa: E402
from core.runtime.residency import BudgetError  # noqa: E402
from core.runtime.runner import Runner  # noqa: E402
from core.session import Session  # noqa: E402

STEPS = 10
CAPACITY = 64
PROMPTS = MOE_PROMPTS


def _run(model, rows, capture, **budgets):
    """(tokens, logits, session, runner) under ``budgets`` (Runner kwargs; none: all resident)."""
    runner = Runner(model, "cuda", **budgets)
    session = Session(runner, batch=len(rows), capacity=CAPACITY, capture=capture)
    logits: list[np.ndarray] = []
    trace = decode(session, rows, STEPS,
                   observer=lambda *_: logits.append(np.asarray(session.last_logits(), np.float32)))
    return trace.tokens, np.stack(logits), session, runner


def _paged(session, size):
    c = session.counters
    assert c.expert_page_ins > 0 and c.expert_routed == c.expert_hits + c.expert_page_ins
    assert c.expert_bytes_copied == c.expert_page_ins * size and c.expert_bytes_per_token > 0


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_an_expert_budget_loads_the_experts_off_the_device_and_decodes_bitwise(gpt_oss, precision, batch, capture):
    model = gpt_oss(precision)
    layout = ExpertLayout.of(model)
    size = max(layout.sizes.values())
    budget = (2 * len(layout.counts) + 2) * size  # 2 experts a layer and a ring of 2
    tokens, logits, _, full = _run(model, PROMPTS[:batch], capture)
    paged_tokens, paged_logits, session, runner = _run(model, PROMPTS[:batch], capture, expert_budget=budget)
    plan = runner.expert_residency.plan
    assert all(len(r) == 2 for r in plan.resident.values())
    _paged(session, size)
    cold = layout.total_bytes - plan.resident_bytes
    assert runner.plan.load_peak_bytes is not None and full.plan.load_peak_bytes is not None
    assert runner.plan.load_peak_bytes <= full.plan.load_peak_bytes - cold // 2  # cold experts never uploaded
    assert runner.weight_bytes < full.weight_bytes
    if capture:
        assert session.counters.captures == 1 and not session.counters.fallbacks
    assert np.array_equal(paged_tokens, tokens) and np.array_equal(paged_logits, logits)


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_a_weight_budget_shares_one_plan_with_the_experts(gpt_oss, precision):
    model = gpt_oss(precision)
    layout = ExpertLayout.of(model)
    size = max(layout.sizes.values())
    tokens, logits, _, full = _run(model, PROMPTS, True)
    dense = full.weight_bytes - layout.total_bytes
    paged_tokens, paged_logits, session, runner = _run(model, PROMPTS, True,
                                                       weight_budget=dense + (len(layout.counts) + 2) * size)
    assert runner.residency.weight_bytes_streamed_per_step == 0  # the experts stream first
    assert 0 < runner.expert_residency.plan.resident_bytes <= len(layout.counts) * size
    _paged(session, size)
    assert np.array_equal(paged_tokens, tokens) and np.array_equal(paged_logits, logits)


def test_a_budget_too_small_names_the_smallest_which_runs_bitwise(gpt_oss):
    model = gpt_oss("fp16")
    ring = ExpertLayout.of(model).ring_bytes(2)
    with pytest.raises(BudgetError, match="smallest working budget is") as err:
        Runner(model, "cuda", weight_budget=ring + 1000)
    smallest = int(re.search(r"smallest working budget is ([\d,]+) bytes", str(err.value)).group(1).replace(",", ""))
    tokens, logits, _, _ = _run(model, PROMPTS, True)
    paged_tokens, paged_logits, session, runner = _run(model, PROMPTS, True, weight_budget=smallest)
    assert session.counters.expert_page_ins > 0
    assert np.array_equal(paged_tokens, tokens) and np.array_equal(paged_logits, logits)


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_a_plain_device_budget_leaves_the_experts_room_for_the_kv_cache(gpt_oss, precision):
    model = gpt_oss(precision)
    layout = ExpertLayout.of(model)
    size = max(layout.sizes.values())
    tokens, logits, _, full = _run(model, PROMPTS, True)
    budget = full.weight_bytes - layout.total_bytes + (len(layout.counts) + 2) * size
    budget += full.reservation(len(PROMPTS), CAPACITY)
    paged_tokens, paged_logits, session, runner = _run(model, PROMPTS, True, device_budget=budget,
                                                       reserve_for=(len(PROMPTS), CAPACITY))
    assert runner.expert_residency is not None and runner.replans == 0
    assert session.counters.captures == 1 and not session.counters.fallbacks
    _paged(session, size)
    used = runner.weight_bytes + runner.residency.staging_bytes + runner.kv_device_bytes + runner.workspace_reserved
    assert used <= budget
    assert np.array_equal(paged_tokens, tokens) and np.array_equal(paged_logits, logits)


def test_kv_growth_moves_resident_experts_to_the_ring_and_steps_never_read_the_counters(gpt_oss, monkeypatch):
    """A plain device budget sized around a KV cache of 16 positions, a growing captured session
    past it (run ahead): the resident stores shrink (CudaExpertResidency.replan) instead of the
    dense weights streaming, within the budget, bitwise the all-resident growing session; the
    device counters are never read while decoding (Counters reads a queued copy of them when
    they are read), and then equal the pager's."""
    from providers.cuda.expert_pager import CudaExpertResidency

    model = gpt_oss("fp16")
    layout = ExpertLayout.of(model)
    size = max(layout.sizes.values())
    context = model.config.context_length
    shape = dict(batch=len(PROMPTS), capacity=16, max_capacity=context, kv_policy="growing", capture=True)
    want = decode(Session(model, "cuda", **shape), PROMPTS, STEPS).tokens
    full = Runner(model, "cuda")
    budget = full.weight_bytes - layout.total_bytes + (2 * len(layout.counts) + 2) * size
    budget += full.reservation(len(PROMPTS), 16)
    runner = Runner(model, "cuda", device_budget=budget, reserve_for=(len(PROMPTS), 16))
    before = runner.expert_residency.plan.resident_bytes
    reads: list = []
    counters = CudaExpertResidency.counters
    monkeypatch.setattr(CudaExpertResidency, "counters", property(lambda self: reads.append(1) or counters.fget(self)))
    session = Session(runner, **shape)
    got = decode(session, PROMPTS, STEPS).tokens
    assert reads == [] and np.array_equal(got, want)
    c = session.counters
    monkeypatch.undo()
    assert c.expert_page_ins == runner.expert_residency.counters.page_ins > 0
    assert runner.expert_residency.plan.resident_bytes < before and runner.replans >= 1
    assert runner.residency.weight_bytes_streamed_per_step == 0
    used = runner.weight_bytes + runner.residency.staging_bytes + runner.kv_device_bytes + runner.workspace_reserved
    assert used <= budget

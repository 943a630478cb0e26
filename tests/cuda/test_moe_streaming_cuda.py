"""Expert residency on cuda (providers/cuda/expert_pager.py, kernels/moe_paged.cu; GPU only).

The tiny gpt-oss folders of core.testing.moe_families (fp16 CUDA build: MoE; int4 CPU build:
QMoE), 2 MoE layers of 8 experts, top 2, under a budget of 2 experts per layer plus a ring of
2 slots: every step routes cold experts, which the device planner copies from mapped pinned
host memory into the ring inside the step (several waves at batch 8). Tokens and logits are
bitwise the all-resident run's, eager and captured, at batch 1 and 8, with page-ins counted;
the plan from measured frequencies too.

    pytest -q tests/cuda/test_moe_streaming_cuda.py      # builds 2 tiny folders (~20 s each)
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu import MOE_PROMPTS, require_gpu

require_gpu()
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai", reason="the builder (the models extra) makes the family folders")

from core.generation.loop import decode  # noqa: E402
from core.runtime.experts import moe_layout  # noqa: E402
from core.session import Session  # noqa: E402
from providers.cpu_reference.expert_pager import use_expert_residency  # noqa: E402

STEPS = 10
CAPACITY = 64
PROMPTS = MOE_PROMPTS


def _run(model, rows, capture, budget="resident", frequencies=None):
    """(tokens, logits, residency or None, session); budget "resident": no expert residency."""
    session = Session(model, "cuda", batch=len(rows), capacity=CAPACITY, capture=capture)
    residency = None if budget == "resident" else use_expert_residency(session, budget, 2, frequencies)
    logits: list[np.ndarray] = []
    trace = decode(session, rows, STEPS,
                   observer=lambda *_: logits.append(np.asarray(session.last_logits(), np.float32)))
    return trace.tokens, np.stack(logits), residency, session


def _budget(model):
    counts, sizes = moe_layout(model.graph, model.initializers)
    assert set(counts.values()) == {8} and len(counts) == 2
    return (2 * len(counts) + 2) * max(sizes.values()), max(sizes.values())


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_paged_experts_are_bitwise_the_resident_run(gpt_oss, precision, batch, capture):
    model = gpt_oss(precision)
    budget, size = _budget(model)
    tokens, logits, _, _ = _run(model, PROMPTS[:batch], capture)
    paged_tokens, paged_logits, residency, session = _run(model, PROMPTS[:batch], capture, budget)
    c = residency.counters
    assert all(len(r) == 2 for r in residency.plan.resident.values())
    assert c.page_ins > 0 and 0 < c.hit_rate < 1 and c.routed == c.hits + c.page_ins
    assert c.page_in_bytes == c.page_ins * size and c.bytes_per_token > 0
    if capture:
        assert session.counters.captures == 1 and not session.counters.fallbacks
        assert session.counters.replays >= STEPS - 2
    assert np.array_equal(paged_tokens, tokens) and np.array_equal(paged_logits, logits)


def test_the_plan_from_measured_frequencies_is_bitwise_too(gpt_oss):
    model = gpt_oss("fp16")
    budget, _ = _budget(model)
    tokens, logits, calibration, _ = _run(model, PROMPTS, True, None)
    c = calibration.counters
    assert c.page_ins == 0 and c.hit_rate == 1.0 and c.routed > 0
    measured = c.frequencies()
    paged_tokens, paged_logits, residency, _ = _run(model, PROMPTS, True, budget, measured)
    kept = [measured[n][e] for n, r in residency.plan.resident.items() for e in r]
    left = [measured[n][e] for n, r in residency.plan.resident.items() for e in range(8) if e not in r]
    assert min(kept) >= max(left)
    assert residency.counters.page_ins > 0
    assert np.array_equal(paged_tokens, tokens) and np.array_equal(paged_logits, logits)


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_the_device_planner_decides_as_its_numpy_model(gpt_oss, precision):
    """After every eager decode step at batch 8, plan_step replayed on each node's routed experts
    (read back from the node's scratch) gives the device's ring keys, cursor and counters."""
    from providers.cuda.expert_pager import plan_step, waves

    model = gpt_oss(precision)
    budget, _ = _budget(model)
    session = Session(model, "cuda", batch=len(PROMPTS), capacity=CAPACITY, capture=False)
    res = use_expert_residency(session, budget, 2)
    plan, download = session.runner.plan, session.runner.provider.download
    nodes = [(i, res.nodes[n.name], int(n.attrs.get("k", 1))) for i, n in enumerate(plan.nodes) if n.name in res.nodes]
    state: dict = {}

    def observe(t, *_):
        if t == 0:  # after the prefill: the device state the decode steps start from
            state.update(holds=download(res.holds), cursor=int(download(res.cursor)[0]),
                         counts=download(res._counts)[:, :3].copy())
            return False
        for i, node, k in nodes:
            experts = download(plan.contexts[i].output("moe_experts", (len(PROMPTS), k), np.int32))
            n_waves = waves(experts.size, node.cold, res.slots)
            sp = plan_step(experts, download(node.resident_row), state["holds"], state["cursor"], n_waves,
                           node.key_base)
            state.update(holds=sp.holds, cursor=sp.cursor)
            state["counts"][node.index] += (sp.routed, sp.hits, sp.page_ins)
        assert np.array_equal(download(res.holds), state["holds"]) and int(download(res.cursor)[0]) == state["cursor"]
        assert np.array_equal(download(res._counts)[:, :3], state["counts"]), f"step {t}"
        return False

    decode(session, PROMPTS, STEPS, observer=observe)
    assert res.counters.page_ins > 0

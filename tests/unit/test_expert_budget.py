"""One budget for a MoE model's dense weights and experts (core.runtime.expert_budget): the split,
the load's placer keeping the experts off the device, the cuda pager building its pages from
those host arrays, the session counters, and --expert-budget on the command line."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from core.counters import Counters
from core.runtime.expert_budget import ExpertLayout, ExpertPlacer, refusal, split
from core.runtime.experts import ExpertBudgetError

LAYOUT = ExpertLayout({"l0": 8, "l1": 8}, {"l0": 100, "l1": 100})


def test_the_experts_stream_first_under_a_shared_budget():
    # room for the dense weights and more than the ring: the dense weights all resident
    assert split(2000, None, 1000, LAYOUT, 2) == (None, 1000)
    # not enough: the experts keep the ring only, the dense weights get the rest (and stream)
    assert split(1100, None, 1000, LAYOUT, 2) == (900, 200)
    # an explicit expert budget is the experts' share; the dense weights get the rest
    assert split(1100, 400, 1000, LAYOUT, 2) == (700, 400)
    assert split(None, 400, 1000, LAYOUT, 2) == (None, 400)


@pytest.mark.parametrize("budget,experts,match", [(None, 199, "smallest expert budget is 200 bytes"),
                                                  (300, 300, "leaves nothing")])
def test_an_expert_budget_that_cannot_work_is_refused_with_the_smallest(budget, experts, match):
    with pytest.raises(ExpertBudgetError, match=match):
        split(budget, experts, 1000, LAYOUT, 2)


def test_a_refusal_under_a_plain_device_budget_counts_the_reserved_kv_and_workspace():
    error = str(refusal(1000, 700, 200, 300))
    assert "a budget of 1,000 bytes" in error and "300 bytes reserved for the KV cache and workspace" in error
    assert error.endswith("the smallest working budget is 1,200 bytes")
    assert "reserved" not in str(refusal(1000, 700, 200)) and str(refusal(1000, 700, 200)).endswith("900 bytes")


def test_the_placer_keeps_the_experts_as_host_arrays_and_never_uploads_them():
    uploaded = []
    provider = SimpleNamespace(upload=lambda v: uploaded.append(v) or ("device", v),
                               download=lambda v: pytest.fail("an expert was on the device"))
    plan = SimpleNamespace(provider=provider, _pending={"w_moe", "w_dense"}, host_dispatch=True)
    placer = ExpertPlacer({"moe"})
    assert not placer.prepare_on_device(plan, SimpleNamespace(name="moe"))
    assert placer.prepare_on_device(plan, SimpleNamespace(name="dense"))
    experts = np.ones((8, 4, 4), np.float32)
    assert placer.place(plan, "w_moe", experts, "moe", "w_moe") is experts and placer.experts == {"w_moe": experts}
    assert placer.place(plan, "w_dense", np.ones(4), "dense", "w_dense")[0] == "device"
    assert len(uploaded) == 1


def test_the_cuda_pager_builds_its_pages_from_host_experts(monkeypatch):
    """page_runner on constants the load kept on the host (the ExpertPlacer's arrays): the bank
    holds each expert's bytes and nothing is downloaded (the experts were never on the device)."""
    from onnx import helper
    from test_cuda_expert_planner import _FakeCupy

    from core.runtime.experts import plan_experts
    from providers.cuda import expert_pager as pager

    rng = np.random.default_rng(5)
    e, h, inter = 8, 32, 16
    tensors = {"w1": rng.standard_normal((e, 2 * inter, h)).astype(np.float16),
               "w2": rng.standard_normal((e, h, inter)).astype(np.float16)}
    node = helper.make_node("MoE", ["x", "r", "w1", "", "w2"], ["y"], "moe0", domain="com.microsoft", k=2)
    provider = SimpleNamespace(name="cuda", cupy=_FakeCupy, map_host=lambda a: a,
                               download=lambda v: pytest.fail("downloaded an expert"),
                               stream=SimpleNamespace(synchronize=lambda: None), reset_peak=lambda: None)
    ctx = SimpleNamespace(cache={})
    plan = SimpleNamespace(nodes=[SimpleNamespace(name="moe0", op_type="MoE", inputs=list(node.input))],
                           contexts=[ctx], constants=dict(tensors))
    per = sum(v.nbytes // e for v in tensors.values())
    expert_plan = plan_experts({"moe0": e}, {"moe0": per}, 4 * per, 2)
    res = pager.page_runner(SimpleNamespace(provider=provider, plan=plan), expert_plan)
    pages = res.nodes["moe0"]
    offsets, _ = pager.page_layout({0: tensors["w1"].nbytes // e, 4: tensors["w2"].nbytes // e})
    for name, t in (("w1", 0), ("w2", 4)):
        size = tensors[name].nbytes // e
        assert all(pages.bank[x, offsets[t]:offsets[t] + size].tobytes() == tensors[name][x].tobytes()
                   for x in range(e))
        assert not any(plan.constants[name].strides)  # the host copies are dropped too
    assert res.plan.resident["moe0"] == frozenset({0, 1}) and ctx.cache["expert_pager"] is res


class _Meter:
    """A runner's expert meter as a device keeps it: ``expert_meter_async`` queues a copy of the
    counts as they are now (the work queued so far) and only ``wait()`` reads it."""

    expert_residency = "paged"

    def __init__(self):
        self.now, self.copies, self.reads = (0, 0, 0, 0), 0, 0

    def expert_meter_async(self):
        self.copies += 1
        value = self.now
        return SimpleNamespace(wait=lambda: self._read(value))

    def _read(self, value):
        self.reads += 1
        return value


def test_the_counters_read_the_expert_meter_per_span_not_per_step():
    """A decode step only counts itself: the meter is copied when a span ends (the first mark,
    before and after a prefill) and read when a counter is read, once, and the figures are the
    exact totals of the spans (per step: the steps' total over their number)."""
    runner, c = _Meter(), Counters()
    runner.now = (4, 1, 3, 300)  # before the session: not its traffic
    c.mark_experts(runner)
    c.end_decode_span()  # nothing decoded yet
    runner.now = (8, 2, 5, 500)
    c.count_experts(runner)  # a prefill: 4 routed, 1 hit, 2 page-ins, 200 bytes
    for step in range(1, 11):  # ten steps of two rows, one page-in of 100 bytes each
        runner.now = (8 + 2 * step, 2 + step, 5 + step, 500 + 100 * step)
        c.count_experts(runner, decode_tokens=2)
    assert (runner.copies, runner.reads) == (2, 0)  # the steps neither copied nor read the meter
    assert (c.expert_routed, c.expert_hits, c.expert_page_ins, c.expert_bytes_copied) == (24, 11, 12, 1200)
    assert (runner.copies, runner.reads) == (3, 3)  # one copy ends the steps' span; the counters read once
    assert c.expert_hit_rate == 11 / 24
    assert c.expert_page_ins_per_step == 1 and c.expert_bytes_per_step == 100 and c.expert_bytes_per_token == 50
    assert c.to_dict()["expert_page_ins"] == 12 and "_expert_sums" not in c.to_dict() and runner.reads == 3
    c.count_experts(runner, decode_tokens=2)
    with pytest.raises(RuntimeError, match="end_decode_span"):
        c.count_experts(runner)  # a prefill must end the steps' span first
    c.end_decode_span()
    assert c.expert_page_ins_per_step == 10 / 11 and c.expert_bytes_per_token == 1000 / 22  # it paged nothing
    plain = SimpleNamespace()  # a runner without paging: nothing is counted
    c.mark_experts(plain)
    c.count_experts(plain, decode_tokens=2)
    c.end_decode_span()
    c.count_experts(plain)
    assert c.expert_routed == 24 and c.expert_page_ins_per_step == 10 / 11


@pytest.mark.parametrize("command", [["run", "--prompt", "hi"], ["profile", "m", "--provider", "cpu_reference"],
                                     ["serve"], ["plan", "m"]])
@pytest.mark.parametrize("value, message", [("lots", "--expert-budget: cannot read the budget 'lots'"),
                                            ("0", "--expert-budget: a budget must be positive"),
                                            ("150%", "--expert-budget: a fractional budget must be in (0, 1]")])
def test_a_bad_expert_budget_is_refused_before_any_work_naming_its_flag(monkeypatch, capsys, command, value, message):
    import core.cli
    from core.cli import main

    monkeypatch.setattr(core.cli, "_resolve_model", lambda *a, **k: pytest.fail("model prepared"))
    monkeypatch.setattr("core.models.model.load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(SystemExit) as exit_:
        code = main([*command, "--expert-budget", value])
        raise SystemExit(code)
    out = capsys.readouterr()
    assert exit_.value.code == 2 and message in out.err, out.err

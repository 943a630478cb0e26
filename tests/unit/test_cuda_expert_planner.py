"""The cuda expert planner without a GPU (providers/cuda/expert_pager.py, docs/moe.md).

``plan_step`` is ``moe_plan`` of kernels/moe_paged.cu in NumPy. Fuzzed over routings, resident
sets, ring sizes and two nodes sharing one ring, with the ring's contents simulated wave by
wave: every routed expert is read from its resident page or from a slot that holds it when its
wave runs, no slot serves two experts of one wave, the waves stay within :func:`waves` (fixed by
the shapes), and the decisions are those of cpu_reference's pager. The launcher's sequence of
launches is checked against the kernels' signatures and the routing with a recording stub.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from core.runtime.experts import plan_experts
from providers.cpu_reference.expert_pager import ExpertResidency, use_expert_residency
from providers.cpu_reference.ops._moe import Experts, Routing
from providers.cuda import expert_pager as pager

SOURCE = Path(pager.__file__).parent / "kernels" / "moe_paged.cu"


def _simulate(rng, num_experts, k, slots, resident, calls, nodes=2):
    """Run ``calls`` random node calls over ``nodes`` nodes sharing one ring; check each."""
    holds = np.full(slots, -1, np.int32)
    content = holds.copy()  # the key whose bytes each slot holds
    cursor = 0
    row = np.full(num_experts, -1, np.int32)
    row[sorted(resident)] = np.arange(len(resident))
    cold = num_experts - len(resident)
    for _ in range(calls):
        node = int(rng.integers(nodes))
        rows = int(rng.integers(1, 9))
        experts = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(rows)])
        n_waves = pager.waves(rows * k, cold, slots)
        sp = pager.plan_step(experts, row, holds, cursor, n_waves, node * pager.KEY_STRIDE)
        routed = set(np.unique(experts).tolist())
        assert {e for e in range(num_experts) if sp.wave_of[e] >= 0} == routed
        assert sp.routed == len(routed) == sp.hits + sp.page_ins
        assert sp.wave_of.max() < n_waves
        for e in routed:
            assert (row[e] >= 0) == (sp.slot_of[e] < 0), "resident or a slot, never both"
        for w in range(n_waves):
            used = [sp.slot_of[e] for e in routed if sp.wave_of[e] == w and row[e] < 0]
            assert len(used) == len(set(used)) <= slots, "a slot serves one expert per wave"
            for s, e in enumerate(sp.copies[w]):
                if e >= 0:
                    content[s] = node * pager.KEY_STRIDE + e
            for e in routed:
                if sp.wave_of[e] == w and row[e] < 0:
                    assert content[sp.slot_of[e]] == node * pager.KEY_STRIDE + e, "read before its copy"
        assert np.array_equal(sp.holds, content)
        holds, cursor = sp.holds, sp.cursor
        yield node, experts, sp


@pytest.mark.parametrize("seed", range(40))
def test_fuzzed_plans_read_every_routed_expert_from_its_page(seed):
    rng = np.random.default_rng(seed)
    num_experts = int(rng.integers(2, 40))
    k = int(rng.integers(1, min(num_experts, 4) + 1))
    slots = int(rng.integers(1, 6))
    resident = set(rng.choice(num_experts, int(rng.integers(0, num_experts)), replace=False).tolist())
    assert sum(1 for _ in _simulate(rng, num_experts, k, slots, resident, 30)) == 30


def test_waves_depend_on_the_shapes_only():
    assert pager.waves(4, 28, 2) == 2 and pager.waves(256, 28, 2) == 14 and pager.waves(256, 28, 32) == 1
    assert pager.waves(8, 0, 2) == 1 and pager.waves(8, 5, 0) == 1


@pytest.mark.parametrize("seed", range(6))
def test_the_decisions_are_cpu_reference_pager_decisions(seed):
    """The same calls through cpu_reference's pager (core.runtime.experts.SlotRing) give the same
    waves, page-ins and hits, call after call."""
    rng = np.random.default_rng(100 + seed)
    e, k, slots = 12, 2, int(rng.integers(1, 4))
    nodes = {"n0": e, "n1": e}
    expert_plan = plan_experts(nodes, {"n0": 10, "n1": 10}, budget_bytes=10 * (6 + slots), ring_slots=slots)
    resident = expert_plan.resident["n0"]
    assert resident == expert_plan.resident["n1"] and len(resident) == 3
    ref = ExpertResidency(expert_plan)
    bank = Experts(np.zeros((e, 1, 2), np.float32), np.zeros((e, 2, 1), np.float32))
    for node, experts, sp in _simulate(rng, e, k, slots, resident, 40):
        name = f"n{node}"
        before = (ref.counters.page_ins, ref.counters.hits)
        waves = list(ref.waves(name, bank, Routing(experts, np.ones(experts.shape, np.float32))))
        got = {int(x): w for w, wave in enumerate(waves) for x, _ in wave}
        want = {x: int(sp.wave_of[x]) for x in range(e) if sp.wave_of[x] >= 0}
        cold = {x for x in want if x not in resident}
        assert {x: got[x] for x in cold} == {x: want[x] for x in cold}
        assert (ref.counters.page_ins - before[0], ref.counters.hits - before[1]) == (sp.page_ins, sp.hits)


def test_page_layout_aligns_each_tensor():
    offsets, nbytes = pager.page_layout({0: 1000, 3: 10, 4: 256})
    assert offsets.tolist() == [0, -1, -1, 1024, 1280] + [-1] * 7 and nbytes == 1536


def _signatures() -> dict[str, int]:
    text = SOURCE.read_text()
    out = {}
    for m in re.finditer(r"__global__ void (\w+)\(([^)]*)\)", text):
        out[m.group(1)] = len([p for p in m.group(2).split(",") if p.strip()])
    return out


def test_the_launches_fit_the_kernels_and_never_depend_on_the_routing(monkeypatch):
    """CudaExpertResidency.launch with a recording stub: one moe_plan, then per wave a page-in,
    an up and a down launch; every launch has the kernel's parameter count and the same grids
    whatever the routing (the routing is device data the stub never reads)."""
    from providers.cuda import module

    calls: list[tuple[str, tuple, int]] = []

    def function(name, expression, expressions):
        assert name == "moe_paged" and expression in expressions == pager.EXPRS
        return lambda grid, block, args: calls.append((expression.split("<")[0], grid, len(args)))

    monkeypatch.setattr(module, "function", function)
    monkeypatch.setattr(module, "multiprocessors", lambda: 132)
    sig = _signatures()
    assert set(sig) == {"moe_plan", "moe_page_in", "moe_up_paged", "moe_down_paged"}

    class Ctx:
        class node:
            name = "n0"

        def output(self, slot, shape, dtype):
            return np.zeros(shape, dtype)

    res = object.__new__(pager.CudaExpertResidency)
    node = object.__new__(pager._Node)
    node.num_experts, node.cold, node.page_bytes, node.key_base = 32, 28, 4096, 0
    node.resident_row = node.resident = node.offsets = node.bank_device = np.zeros(1)
    res.nodes, res.slots, res.slot_bytes = {"n0": node}, 2, 4096
    res.ring = res.holds = res.cursor = res.pinned = np.zeros(1)
    res._rows = {"n0": (np.zeros(4), np.zeros(32))}
    tail = (1,) * 10
    for rows in (1, 8):
        calls.clear()
        res.launch(Ctx(), "__half", (4, 4), *(np.zeros(1),) * 4, (rows, 4, 64, 64), (128, 0, 128), 32, tail)
        n_waves = pager.waves(rows * 4, 28, 2)
        assert [c[0] for c in calls] == ["moe_plan"] + ["moe_page_in", "moe_up_paged", "moe_down_paged"] * n_waves
        assert all(n == sig[kernel] for kernel, _, n in calls)
        assert calls[1][1] == (132, 2) and calls[2][1] == (rows * 4, 16)


@pytest.mark.parametrize("placer,budget,match", [(object(), None, "weight_budget"), (None, 1, "device_budget"),
                                                 (None, None, "no MoE")])
def test_sessions_it_cannot_page_are_refused_before_any_work(placer, budget, match):
    from types import SimpleNamespace

    from onnx import helper

    graph = helper.make_graph([], "g", [], [])
    runner = SimpleNamespace(provider=SimpleNamespace(name="cuda"), placer=placer, device_budget=budget,
                             model=SimpleNamespace(graph=graph, initializers={}), plan=None)
    with pytest.raises(ValueError, match=match):
        use_expert_residency(SimpleNamespace(runner=runner), 1 << 20)


class _FakeCupy:
    """The few CuPy calls use_expert_residency makes, on NumPy (no device)."""

    uint8, int32, int64, uint64 = np.uint8, np.int32, np.int64, np.uint64
    zeros, full = staticmethod(np.zeros), staticmethod(np.full)

    class cuda:
        alloc_pinned_memory = staticmethod(bytearray)

    @staticmethod
    def asarray(a):
        return np.array(a)

    @staticmethod
    def empty(n, dtype):
        from types import SimpleNamespace

        return SimpleNamespace(data=None)

    @staticmethod
    def ndarray(shape, dtype, memptr, strides):
        return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, strides)


def test_the_pages_hold_each_experts_bytes_and_the_node_drops_its_copies():
    """use_expert_residency on a one-node QMoE plan with NumPy standing in for the device: each
    expert's page in the bank holds its tensors' bytes at the layout's offsets, the resident store
    holds the resident experts' pages, and the node's constants become zero-stride views."""
    from types import SimpleNamespace

    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    e, h, inter = 8, 32, 16
    tensors = {"w1": rng.integers(0, 256, (e, 2 * inter, h // 2), dtype=np.uint8),
               "s1": rng.standard_normal((e, 2 * inter, h // 16)).astype(np.float16),
               "b1": rng.standard_normal((e, 2 * inter)).astype(np.float16),
               "w2": rng.integers(0, 256, (e, h, inter // 2), dtype=np.uint8),
               "s2": rng.standard_normal((e, h, 1)).astype(np.float16)}
    node = helper.make_node("QMoE", ["x", "r", "w1", "s1", "b1", "w2", "s2"], ["y"], "moe0", domain="com.microsoft",
                            k=2, block_size=16, expert_weight_bits=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, h])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, h])],
                              [numpy_helper.from_array(v, k) for k, v in tensors.items()])
    provider = SimpleNamespace(name="cuda", cupy=_FakeCupy, download=lambda v: getattr(v, "a", v), map_host=lambda a: a,
                               stream=SimpleNamespace(synchronize=lambda: None), reset_peak=lambda: None)
    ctx = SimpleNamespace(cache={})
    plan = SimpleNamespace(nodes=[SimpleNamespace(name="moe0", op_type="QMoE", inputs=list(node.input))],
                           contexts=[ctx], constants={k: _FakeDevice(v) for k, v in tensors.items()})
    runner = SimpleNamespace(provider=provider, placer=None, device_budget=None, plan=plan,
                             model=SimpleNamespace(graph=graph, initializers=tensors))
    per = sum(v.nbytes // e for v in tensors.values())
    res = use_expert_residency(SimpleNamespace(runner=runner), 3 * per + 2 * per, ring_slots=2)
    assert ctx.cache["expert_pager"] is res and res.plan.resident["moe0"] == frozenset({0, 1, 2})
    pages = res.nodes["moe0"]
    offsets, nbytes = pager.page_layout({t: tensors[n].nbytes // e for n, t in
                                         zip(("w1", "s1", "b1", "w2", "s2"), (0, 1, 3, 4, 5))})
    assert pages.page_bytes == nbytes == res.slot_bytes and pages.cold == 5
    for name, t in zip(("w1", "s1", "b1", "w2", "s2"), (0, 1, 3, 4, 5)):
        size = tensors[name].nbytes // e
        for x in range(e):
            assert pages.bank[x, offsets[t]:offsets[t] + size].tobytes() == tensors[name][x].tobytes()
        assert plan.constants[name].shape == tensors[name].shape and not any(plan.constants[name].strides)
    assert np.array_equal(pages.resident.reshape(3, -1), pages.bank[:3])
    assert pages.resident_row.tolist() == [0, 1, 2, -1, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="already"):
        use_expert_residency(SimpleNamespace(runner=runner), None)


class _FakeDevice:
    """A device tensor to the pager (not a host value): the NumPy array ``a`` it stands for."""

    def __init__(self, a):
        self.a, self.shape, self.dtype, self.nbytes, self.ndim = a, a.shape, a.dtype, a.nbytes, a.ndim

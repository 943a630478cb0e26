"""Weight streaming through the hooks a plan declares (core/executor/hooks.py): the copy schedule
runs around the nodes' launches from the executor's dispatch, the plan's kernels stay the
provider's own (nothing wraps them), and a re-plan replaces the hooks."""

import numpy as np
import pytest

from core.executor.hooks import Launch, NodeHooks
from core.generation.loop import decode
from core.runtime import residency
from core.runtime.runner import Runner
from core.session import Session
from core.testing.tiny_model import TinyConfig, make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider

ROWS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


@pytest.fixture(autouse=True)
def small_tensors_stream(monkeypatch):
    """The tiny model's matrices are a few KiB: let everything but the embedding stream."""
    monkeypatch.setattr(residency, "SMALL_BYTES", 512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), config=TinyConfig(layers=4, vocab=128, context=256))


def trace(runner, rows, steps=6):
    s = Session(runner, batch=len(rows), capacity=64)
    return decode(s, rows, steps).tokens, s.counters


def own_kernels(plan, provider) -> bool:
    """Every kernel of ``plan`` is the one the provider's op table gives for its node."""
    return all(plan.kernels[i] is provider.kernel(node) for i, node in enumerate(plan.nodes) if i not in plan.branches)


def test_streaming_copies_run_through_the_plans_hooks_and_no_kernel_is_wrapped(model_dir):
    want, _ = trace(Runner(model_dir, CpuReferenceProvider()), ROWS)
    provider = CpuReferenceProvider()
    runner = Runner(model_dir, provider, weight_budget=0.5, staging_slots=2)
    plan, r = runner.plan, runner.residency
    assert r.streams and plan.hooks
    assert own_kernels(plan, provider)
    # every node that reads a streamed page has hooks (its ready and release, at least)
    streamed = set(r.streamed_tensors)
    readers = {i for i in plan.steps if streamed & set(plan.nodes[i].inputs)}
    assert readers <= set(plan.hooks)
    before = sum(h.count for h in plan.hooks.values())
    got, c = trace(runner, ROWS)
    assert np.array_equal(want, got)
    runs = c.decode_steps + 1  # the prefill streams too
    assert sum(h.count for h in plan.hooks.values()) - before == runs * len(plan.hooks)
    assert c.htod_bytes == runner.stream.bytes_copied == runs * r.weight_bytes_streamed_per_step > 0
    assert own_kernels(plan, provider)
    # the copies are the hooks' work: without them a step copies nothing
    hooks, copies = plan.hooks, runner.stream.copies
    plan.set_hooks({})
    trace(runner, ROWS[:1], steps=1)
    assert runner.stream.copies == copies
    plan.set_hooks(hooks)


def test_a_replan_declares_new_hooks_and_keeps_the_kernels(tmp_path):
    folder = make_tiny_model(tmp_path / "m", config=TinyConfig(layers=2, vocab=1024, tied=False), external=True)
    want, _ = trace(Runner(folder, CpuReferenceProvider()), ROWS[:2])
    provider = CpuReferenceProvider()
    weights = Runner(folder, CpuReferenceProvider()).plan.step_weight_bytes()
    runner = Runner(folder, provider, device_budget=2 * weights)
    assert not runner.residency.streams and runner.plan.hooks == {}
    kernels = list(runner.plan.kernels)
    least = residency.smallest_budget(runner._weights, mappable=True)
    Session(runner, batch=2, capacity=64).close()  # the traced session's KV and workspace (its state pooled)
    assert not runner.residency.streams
    room = 2 * weights - runner.kv_device_bytes - runner.workspace_reserved  # what they leave the weights
    assert runner.reserve_kv(room - (least + weights) // 2) is not None  # the re-plan streams
    assert runner.residency.streams and runner.plan.hooks
    assert all(a is b for a, b in zip(runner.plan.kernels, kernels)) and own_kernels(runner.plan, provider)
    got, c = trace(runner, ROWS[:2])
    assert np.array_equal(want, got) and c.htod_bytes > 0


def test_hooks_run_around_the_kernel_inside_the_observer(model_dir):
    runner = Runner(model_dir, CpuReferenceProvider())
    plan = runner.plan
    index = plan.steps[len(plan.steps) // 2]
    log = []

    class Observer:
        def begin(self, node):
            if node is plan.nodes[index]:
                log.append("begin")

        def end(self, node, args, results):
            if node is plan.nodes[index]:
                log.append("end")

    plan.set_hooks({index: NodeHooks([Launch((lambda: log.append("before"),), (lambda: log.append("after"),))])})
    plan.observer = Observer()
    trace(runner, ROWS[:1], steps=1)
    assert log == ["begin", "before", "after", "end"] * 2  # the prefill and one step
    assert plan.hooks[index].count == 2


def test_hooks_that_do_not_fit_their_node_are_refused():
    with pytest.raises(ValueError, match="one launch"):
        NodeHooks([Launch(), Launch()])
    with pytest.raises(ValueError, match="names its rows"):
        NodeHooks([Launch(rows=(0, 16)), Launch()], n=32, axes={1: 1})
    assert NodeHooks([Launch(rows=(0, 16)), Launch(rows=(16, 32))], n=32, axes={1: 1}).ranges == ((0, 16), (16, 32))

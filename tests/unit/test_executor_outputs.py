"""The executor checks every kernel's outputs and names the node, op and kernel on a mismatch."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from core.executor import KernelOutputError, Plan
from providers.cpu_reference.provider import CpuReferenceProvider


class WithKernel(CpuReferenceProvider):
    """cpu_reference with the Add kernel replaced."""

    def __init__(self, add):
        super().__init__()
        self.add = add

    def kernel(self, node):
        return self.add if node.op_type == "Add" else super().kernel(node)


def _graph(value_info_rank: bool = False):
    """y = Neg(Add(a, b)) for a, b float32 [3, 2]; y declared float32 [3, 2]; the Add output
    declared in value_info (with its rank when ``value_info_rank``)."""
    nodes = [helper.make_node("Add", ["a", "b"], ["s"], name="the_add"),
             helper.make_node("Neg", ["s"], ["y"], name="the_neg")]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 2]) for n in ("a", "b")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])]
    info = [helper.make_tensor_value_info("s", TensorProto.FLOAT, [3, 2] if value_info_rank else None)]
    return helper.make_graph(nodes, "g", ins, outs, value_info=info)


FEEDS = {"a": np.ones((3, 2), np.float32), "b": np.arange(6, dtype=np.float32).reshape(3, 2)}


def bare_array(ctx, a, b):
    return a + b


def too_many(ctx, a, b):
    return (a + b, a)


def too_few(ctx, a, b):
    return ()


def float64(ctx, a, b):
    return ((a + b).astype(np.float64),)


def flat(ctx, a, b):
    return ((a + b).reshape(-1),)


def none_output(ctx, a, b):
    return (None,)


@pytest.mark.parametrize("kernel,what", [
    (bare_array, "returned a ndarray, not a tuple"),
    (too_many, "returned 2 entries for 1 declared output"),
    (too_few, "returned 0 entries for 1 declared output"),
    (float64, "returned float64 for output 's', declared float32"),
    (flat, "returned rank 1 for output 's', declared 2"),
    (none_output, "returned None for output 's'"),
])
def test_a_bad_kernel_raises_naming_node_op_and_kernel(kernel, what):
    plan = Plan(_graph(value_info_rank=True), {}, WithKernel(kernel))
    with pytest.raises(KernelOutputError) as info:
        plan.run(FEEDS)
    message = str(info.value)
    assert "'the_add' (Add)" in message and what in message
    assert f"{__name__}.{kernel.__name__}" in message


def test_rank_is_checked_only_where_the_graph_declares_it():
    plan = Plan(_graph(value_info_rank=False), {}, WithKernel(flat))
    with pytest.raises(KernelOutputError, match="'the_neg' .*rank 1 for output 'y', declared 2"):
        plan.run(FEEDS)  # the Add output has no declared shape; the Neg output (graph output) has


def test_trailing_none_entries_past_the_declared_outputs_are_accepted():
    plan = Plan(_graph(), {}, WithKernel(lambda ctx, a, b: (a + b, None, None)))
    assert np.array_equal(plan.run(FEEDS)["y"], -(FEEDS["a"] + FEEDS["b"]))


def test_a_kernel_that_goes_bad_on_a_later_call_is_caught():
    calls = []

    def flaky(ctx, a, b):
        calls.append(1)
        return (a + b,) if len(calls) == 1 else a + b

    plan = Plan(_graph(), {}, WithKernel(flaky))
    plan.run(FEEDS)
    with pytest.raises(KernelOutputError, match="not a tuple"):
        plan.run(FEEDS)


def test_a_result_identical_to_the_last_one_is_not_checked_again():
    """A replayed node returns its recorded tuple: one identity test, no check call."""
    out = (np.zeros((3, 2), np.float32),)
    plan = Plan(_graph(value_info_rank=True), {}, WithKernel(lambda ctx, a, b: out))
    plan.run(FEEDS)
    checked = []
    original = plan._check_outputs
    plan._check_outputs = lambda step, results: (checked.append(step.index), original(step, results))
    plan.run(FEEDS)
    assert [plan.nodes[i].name for i in checked] == ["the_neg"]  # Neg makes a new tuple each call


def test_folded_nodes_are_checked_at_plan_time():
    init = {n: v for n, v in FEEDS.items()}
    graph = _graph(value_info_rank=True)
    del graph.input[:]
    with pytest.raises(KernelOutputError, match="'the_add'"):
        Plan(graph, init, WithKernel(bare_array))

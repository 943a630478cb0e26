"""Host nodes of a device provider run on the cpu_reference kernels, chosen by the core; the
provider's kernels run whenever an input is on the device."""

import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper

from core.executor import HostFallback, Plan, default_host_fallback
from providers.cpu_reference.provider import CpuReferenceProvider


class Dev:
    """A 'device' tensor: not a host value for the executor (wraps a numpy array)."""

    def __init__(self, array):
        self.a = np.asarray(array)
        self.shape, self.dtype, self.ndim, self.nbytes = self.a.shape, self.a.dtype, self.a.ndim, self.a.nbytes


class FakeDevice(CpuReferenceProvider):
    """Kernels for Shape, Gather, Cast and Mul that log their calls; Gather and Cast refuse
    host inputs (the core must route those to cpu_reference)."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.allocated = []  # shapes of the device buffers asked for
        self.host_args = []  # the host inputs the Mul kernel got

    def allocate(self, shape, dtype, zero=False):
        self.allocated.append(tuple(shape))
        return Dev(np.zeros(shape, dtype))

    def upload(self, array):
        return Dev(array)

    def download(self, tensor):
        return np.array(tensor.a)

    def kernel(self, node):
        def run(ctx, *xs):
            self.calls.append(node.op_type)
            if node.op_type == "Shape":
                return (np.array(xs[0].shape, np.int64),)  # a host result, as on cuda
            if node.op_type == "Mul":
                self.host_args.append(xs[1])
                return (Dev(xs[0].a * np.asarray(xs[1]).astype(xs[0].dtype)),)
            raise AssertionError(f"{node.op_type} got host inputs: the core should have run it")
        return run


def _graph():
    """y = x * Cast(Gather(Shape(x), 1)) for x float32 [B, 4]."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Gather", ["s", "one"], ["n"], name="gather", axis=0),
             helper.make_node("Cast", ["n"], ["f"], name="cast", to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x", "f"], ["y"], name="mul")]
    return helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4])])


INITS = {"one": np.array(1, np.int64)}
X = np.arange(8, dtype=np.float32).reshape(2, 4)


def test_host_nodes_run_on_reference_kernels_and_device_nodes_on_the_provider():
    provider = FakeDevice()
    plan = Plan(_graph(), INITS, provider)
    assert plan.host_dispatch
    y = plan.run({"x": Dev(X)})["y"]
    assert np.array_equal(y.a, X * 4)
    assert provider.calls == ["Shape", "Mul"]
    assert plan.host_nodes() == ["gather", "cast"]


def test_the_choice_is_kept_for_later_runs_and_remade_for_other_feed_types():
    provider = FakeDevice()
    plan = Plan(_graph(), INITS, provider)
    plan.run({"x": Dev(X)})
    plan.run({"x": Dev(X[:1])})
    assert provider.calls == ["Shape", "Mul"] * 2 and plan.host_nodes() == ["gather", "cast"]
    y = plan.run({"x": X})["y"]  # a host feed: every node is a host node now
    assert np.array_equal(y, X * 4) and provider.calls == ["Shape", "Mul"] * 2
    assert plan.host_nodes() == ["shape", "gather", "cast", "mul"]


def test_host_kernels_write_into_persistent_host_buffers_of_their_contexts():
    """The host contexts of a device provider allocate numpy buffers (the plan's HostFallback, core.executor.host),
    never device tensors: each host node's output is its context's buffer, the same every step."""
    provider = FakeDevice()
    plan = Plan(_graph(), INITS, provider)
    for rows in (2, 2, 1):
        plan.run({"x": Dev(X[:rows])})
    assert provider.allocated == [(1,)]  # only the plan's host-dispatch probe: no host buffer on the device
    assert len(provider.host_args) == 3 and all(type(f) is np.ndarray for f in provider.host_args)
    assert provider.host_args[0] is provider.host_args[1] is provider.host_args[2]  # persistent
    index = {n.name: i for i, n in enumerate(plan.nodes)}
    for name, dtype in (("gather", np.int64), ("cast", np.float32)):
        ctx = plan._host_contexts[index[name]]
        assert ctx is not None and ctx.provider.name == "cpu_reference" and ctx.allocations == 1
        assert type(ctx.output(0, (), dtype)) is np.ndarray
    assert plan._host_contexts[index["cast"]].output(0, (), np.float32) is provider.host_args[0]
    assert float(provider.host_args[0]) == 4.0


def test_a_host_provider_runs_every_node_itself():
    plan = Plan(_graph(), INITS, CpuReferenceProvider())
    assert not plan.host_dispatch and all(k is None for k in plan.host_kernels)
    plan.run({"x": X})
    assert plan.host_nodes() == []


def test_cuda_ops_import_no_other_provider():
    code = ("import importlib, pkgutil, sys\n"
            "import providers.cuda.ops as ops\n"
            "for m in pkgutil.iter_modules(ops.__path__):\n"
            "    importlib.import_module('providers.cuda.ops.' + m.name)\n"
            "import providers.cuda.provider\n"
            "print(sorted(m for m in sys.modules if m.startswith('providers.cpu_reference')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class CountingMemory(CpuReferenceProvider):
    """A host provider whose allocations are counted (an injected fallback's memory)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def allocate(self, shape, dtype, zero=False):
        self.shapes.append(tuple(shape))
        return super().allocate(shape, dtype, zero)


def test_the_host_fallback_is_injected_and_its_kernels_and_memory_run_the_host_nodes():
    memory = CountingMemory()
    fallback = HostFallback.of(memory)
    provider = FakeDevice()
    plan = Plan(_graph(), INITS, provider, host_fallback=fallback)
    assert plan.host_fallback is fallback
    y = plan.run({"x": Dev(X)})["y"]
    assert np.array_equal(y.a, X * 4) and plan.host_nodes() == ["gather", "cast"]
    assert memory.shapes == [(), ()]  # the gather and cast outputs, in the injected memory
    index = {n.name: i for i, n in enumerate(plan.nodes)}
    assert plan._host_contexts[index["cast"]].provider is memory


def test_the_default_host_fallback_is_the_registrys_cpu_reference():
    fallback = default_host_fallback()
    assert fallback.memory.name == "cpu_reference" and fallback.ops is fallback.memory.ops
    assert Plan(_graph(), INITS, FakeDevice()).host_fallback is fallback
    assert Plan(_graph(), INITS, CpuReferenceProvider()).host_fallback is None  # no host dispatch


def test_a_host_fallback_needs_a_provider_with_an_op_table():
    bare = CpuReferenceProvider()
    bare.ops = None
    with pytest.raises(ValueError, match="no op table"):
        HostFallback.of(bare)

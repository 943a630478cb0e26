"""LFM2-MoE's in-graph router on the cuda provider, checked without a GPU (docs/moe.md "On cuda").

The cuda op table declares every op the builder's LFM2-MoE graph holds, so the support check
of a tiny LFM2-MoE folder refuses no node (built with the builder when it is installed). The
launchers' host-side choices run on numpy stand-ins with a launch recorder (as
test_executor_cuda_prepare.py does): the shapes they give the kernels come from the tensors'
shapes only, the sentinel logits of ConstantOfShape are written as a fill value, not uploaded.
The kernels' results are checked on a GPU by the parity kit's router cases
(tests/cuda/test_ops.py) and tests/cuda/test_moe_cuda.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from core.executor import node_infos, unsupported_nodes
from core.ops import OpTable
from core.protocol import KernelContext, NodeInfo
from providers.cuda import ops as cuda_ops
from providers.cuda.ops import _router, clip, constant_of_shape, gather_elements, reduce_sum, scatter_elements, topk

#: the ops between LFM2-MoE's router projection and its MoE node (the builder, onnxruntime-genai 0.18).
ROUTER_OPS = ("Neg", "Exp", "Add", "Reciprocal", "TopK", "GatherElements", "ReduceSum", "Div", "Shape", "Slice",
              "Concat", "Reshape", "Cast", "Clip", "Log", "ConstantOfShape", "ScatterElements", "Mul")


class _Table:
    """The cuda provider's support answers without a device: its op table."""

    name = "cuda"

    def __init__(self):
        self.ops = OpTable(cuda_ops)

    def supports(self, node: NodeInfo) -> bool:
        return self.ops.supports(node)

    def support_reason(self, node: NodeInfo) -> str | None:
        return self.ops.support_reason(node)


def _node(op, dtypes=(np.float32,), attrs=None, n_inputs=None):
    names = tuple(f"i{j}" for j in range(n_inputs or len(dtypes)))
    return NodeInfo(name=op, op_type=op, domain="", attrs=attrs or {}, inputs=names, outputs=("y",),
                    input_dtypes=tuple(dtypes))


@pytest.mark.parametrize("op", ROUTER_OPS)
def test_the_cuda_provider_declares_every_router_op(op):
    node = _node(op, attrs={"to": 10} if op == "Cast" else None)  # the router's fp32 -> fp16 Cast
    assert _Table().supports(node), _Table().support_reason(node)


@pytest.mark.parametrize("node,reason", [
    (_node("TopK", attrs={"sorted": 0}), "sorted=0"),
    (_node("Exp", (np.float64,)), "float64"),
    (_node("ScatterElements", (np.float32, np.int64, np.float32), {"reduction": "add"}), "reduction"),
    (_node("GatherElements", (np.bool_, np.int64)), "2, 4 or 8 bytes"),
])
def test_what_the_kernels_do_not_run_is_refused_with_its_reason(node, reason):
    assert not _Table().supports(node) and reason in _Table().support_reason(node)


def test_the_support_check_of_an_lfm2_moe_folder_refuses_no_node(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime_genai", reason="the builder makes the family folder")
    from core.models.model import load_model
    from core.testing.families import prepared_family

    model = load_model(prepared_family("lfm2-moe", tmp_path_factory.mktemp("lfm2"), "fp16", "cuda"))
    nodes = node_infos(model.graph)
    assert {"TopK", "ScatterElements", "GatherElements", "Log", "Reciprocal"} <= {n.op_type for n in nodes}
    assert unsupported_nodes(_Table(), nodes) == []


# -- the launchers' host-side choices on numpy stand-ins -----------------------------------------

class Dev(np.ndarray):
    """A numpy array standing in for a device array."""


def dev(a) -> Dev:
    return np.ascontiguousarray(a).view(Dev)


class _Memory:
    def allocate(self, shape, dtype, zero=False):
        return np.zeros(shape, dtype).view(Dev)


def _ctx(op, attrs=None):
    return KernelContext(_node(op, attrs=attrs), _Memory(), "head_major")


@pytest.fixture
def launches(monkeypatch):
    """Kernel launches as (expression, grid, block, args); numpy ``Dev`` arrays are the device ones."""
    record = []

    def function(name, expression, expressions):
        assert name == "router" and expression in expressions
        return lambda grid, block, args, shared_mem=0: record.append((expression, grid, block, args))

    def is_host(x):
        return x is None or not isinstance(x, Dev)

    for module in (_router, clip, topk, gather_elements, scatter_elements, reduce_sum):
        monkeypatch.setattr(module, "function", function, raising=False)
        monkeypatch.setattr(module, "is_host", is_host, raising=False)
    return record


def test_topk_launches_over_the_slices_of_its_axis(launches):
    x = dev(np.zeros((9, 32), np.float16))
    values, indices = topk.run(_ctx("TopK", {"axis": -1, "largest": 1}), x, np.array([2], np.int64))
    assert values.shape == indices.shape == (9, 2) and indices.dtype == np.int64 and values.dtype == np.float16
    (expr, _, _, args), = launches
    assert expr == "topk<__half>" and [int(a) for a in args[3:]] == [9, 32, 1, 2, 1]
    topk.run(_ctx("TopK", {"axis": 0, "largest": 0}), dev(np.zeros((5, 4, 3), np.float32)), np.array([2], np.int64))
    assert [int(a) for a in launches[1][3][3:]] == [1, 5, 12, 2, 0]


def test_topk_needs_a_host_k(launches):
    with pytest.raises(ValueError, match="host value"):
        topk.run(_ctx("TopK"), dev(np.zeros((2, 8), np.float32)), dev(np.array([2], np.int64)))


def test_the_sentinel_logits_are_a_fill_value_not_an_upload(launches):
    """ConstantOfShape runs on the host (a host shape); ScatterElements writes its value itself."""
    sentinel, = constant_of_shape.run(_ctx("ConstantOfShape", {"value": np.array([-10000.0], np.float32)}),
                                      np.array([9, 32], np.int64))
    assert isinstance(sentinel, np.ndarray) and not isinstance(sentinel, Dev) and sentinel.shape == (9, 32)
    ctx = _ctx("ScatterElements", {"axis": 1})
    idx, upd = dev(np.zeros((9, 2), np.int64)), dev(np.zeros((9, 2), np.float32))
    out, = scatter_elements.run(ctx, sentinel, idx, upd)
    (expr, _, _, args), = launches
    assert expr == "scatter_elements<unsigned int, long long>" and out.shape == (9, 32)
    assert int(args[0]) == 0, "no data pointer: the kernel writes the fill"
    assert args[1].dtype == np.uint32 and args[1] == np.float32(-10000.0).view(np.uint32)
    assert not ctx.cache, "nothing uploaded"
    data = dev(np.ones((9, 32), np.float32))
    scatter_elements.run(ctx, data, idx, upd)
    assert launches[1][3][0] is data


def test_float_reduce_sum_over_adjacent_axes_takes_the_kernel(launches):
    x = dev(np.zeros((3, 5, 7, 2), np.float32))
    out, = reduce_sum.run(_ctx("ReduceSum", {"keepdims": 0}), x, np.array([1, 2], np.int64))
    (expr, _, _, args), = launches
    assert expr == "reduce_axis<float>" and out.shape == (3, 2) and [int(a) for a in args[2:]] == [3, 35, 2]
    out, = reduce_sum.run(_ctx("ReduceSum", {"keepdims": 1}), dev(np.zeros((9, 2), np.float16)),
                          np.array([-1], np.int64))
    assert launches[1][0] == "reduce_axis<__half>" and out.shape == (9, 1)


def test_clip_bounds_are_scalars_on_the_host_and_pointers_on_the_device(launches):
    x = dev(np.zeros((4, 8), np.float16))
    clip.run(_ctx("Clip"), x, np.array(1e-30, np.float32), None)
    args = launches[0][3]
    assert int(args[3]) == 0 and args[5] == np.float16(1e-30) and (int(args[7]), int(args[8])) == (1, 0)
    high = dev(np.array(0.5, np.float16))
    clip.run(_ctx("Clip"), x, None, high)
    args = launches[1][3]
    assert args[4] is high and (int(args[7]), int(args[8])) == (0, 1)


def test_gather_elements_checks_the_other_axes(launches):
    data, idx = dev(np.zeros((9, 32), np.float16)), dev(np.zeros((9, 2), np.int64))
    out, = gather_elements.run(_ctx("GatherElements", {"axis": 1}), data, idx)
    assert out.shape == (9, 2) and launches[0][0] == "gather_elements<unsigned short, long long>"
    with pytest.raises(ValueError, match="every axis but 1"):
        gather_elements.run(_ctx("GatherElements", {"axis": 1}), data, dev(np.zeros((8, 2), np.int64)))

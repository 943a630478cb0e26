"""Standard ONNX ops of cpu_reference against ONNX Runtime CPU (fresh random inputs per run).

Tolerances: fp32 rtol 1e-5 (atol 1e-6); fp16 rtol 1e-3; integer/shape ops exact.
"""

import numpy as np
import pytest
from onnx import TensorProto, helper

from core.executor import Plan
from core.ops import OpTable
from core.protocol import KernelContext, NodeInfo
from core.testing.op_cases import OP_CASES
from providers.cpu_reference import ops
from providers.cpu_reference.provider import CpuReferenceProvider

F32 = dict(rtol=1e-5, atol=1e-6)
F16 = dict(rtol=1e-3, atol=1e-3)


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                               **(F16 if dtype == np.float16 else F32))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_binary_broadcast_matches_ort(one_node, rng, op, dtype):
    a = rng.standard_normal((2, 3, 4)).astype(dtype)
    b = (rng.standard_normal((3, 1)) + 3).astype(dtype)
    (want,), (got,) = one_node.both(op, {"a": a, "b": b}, {"y": dtype})
    _close(got, want, dtype)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_binary_int64_exact_with_truncating_div(one_node, rng, op):
    a = rng.integers(-50, 50, (3, 5)).astype(np.int64)
    b = rng.integers(1, 7, (5,)).astype(np.int64) * rng.choice([-1, 1], 5)
    (want,), (got,) = one_node.both(op, {"a": a, "b": b}, {"y": np.int64})
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("op", ["Sigmoid", "Tanh", "Sqrt", "Neg", "Softmax"])
def test_unary_matches_ort(one_node, rng, op, dtype):
    x = rng.standard_normal((2, 3, 7)).astype(dtype) * 4
    if op == "Sqrt":
        x = np.abs(x)
    (want,), (got,) = one_node.both(op, {"x": x}, {"y": dtype})
    _close(got, want, dtype)


def test_softmax_axis_1_matches_ort(one_node, rng):
    x = rng.standard_normal((2, 5, 3)).astype(np.float32)
    (want,), (got,) = one_node.both("Softmax", {"x": x}, {"y": np.float32}, axis=1)
    _close(got, want, np.float32)


def test_pow_with_float_exponent_matches_ort(one_node, rng):
    x = np.abs(rng.standard_normal((4, 6))).astype(np.float32)
    y = np.array(2.0, np.float32)
    (want,), (got,) = one_node.both("Pow", {"x": x, "y": y}, {"z": np.float32})
    _close(got, want, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_matmul_matches_ort_for_2d_weight_and_batched(one_node, rng, dtype):
    a = rng.standard_normal((2, 5, 16)).astype(dtype)
    for b in (rng.standard_normal((16, 9)).astype(dtype), rng.standard_normal((2, 16, 9)).astype(dtype)):
        (want,), (got,) = one_node.both("MatMul", {"a": a, "b": b}, {"y": dtype})
        _close(got, want, dtype)


def test_matmul_row_is_bitwise_independent_of_batch(one_node, rng):
    w = rng.standard_normal((64, 96)).astype(np.float32)
    a = rng.standard_normal((7, 3, 64)).astype(np.float32)
    m = one_node.model("MatMul", {"a": a, "w": w}, {"y": np.float32})
    (full,) = one_node.ref(m, {"a": a, "w": w})
    for i in (0, 4, 6):
        (alone,) = one_node.ref(m, {"a": a[i:i + 1, 1:2], "w": w})
        np.testing.assert_array_equal(alone[0, 0], full[i, 1])


def test_gather_embedding_with_negative_index(one_node, rng):
    data = rng.standard_normal((10, 4)).astype(np.float32)
    idx = np.array([[0, 9, -1], [3, 3, 2]], np.int64)
    (want,), (got,) = one_node.both("Gather", {"data": data, "idx": idx}, {"y": np.float32})
    np.testing.assert_array_equal(got, want)


def test_gather_out_of_range_raises(one_node):
    m = one_node.model("Gather", {"d": np.zeros((3, 2), np.float32), "i": np.array([3])}, {"y": np.float32})
    with pytest.raises(IndexError):
        one_node.ref(m, {"d": np.zeros((3, 2), np.float32), "i": np.array([3])})


@pytest.mark.parametrize("to,dtype", [(TensorProto.INT32, np.int32), (TensorProto.FLOAT16, np.float16),
                                      (TensorProto.FLOAT, np.float32), (TensorProto.INT64, np.int64)])
def test_cast_matches_ort(one_node, rng, to, dtype):
    x = (rng.standard_normal((3, 4)) * 100).astype(np.float32)
    (want,), (got,) = one_node.both("Cast", {"x": x}, {"y": dtype}, to=to)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("attrs", [{}, {"start": 1}, {"end": -1}, {"start": -2, "end": 3}])
def test_shape_start_end(one_node, attrs):
    x = np.zeros((2, 3, 4, 5), np.float32)
    (want,), (got,) = one_node.both("Shape", {"x": x}, {"y": np.int64}, **attrs)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axes,keepdims,noop", [([1], 0, 0), ([0, -1], 1, 0), (None, 1, 0), (None, 0, 1),
                                                 ([], 0, 0)])
@pytest.mark.parametrize("dtype", [np.int64, np.float32])
def test_reduce_sum_axes_keepdims_noop(one_node, rng, axes, keepdims, noop, dtype):
    x = rng.integers(0, 5, (3, 4, 2)).astype(dtype)
    inputs = {"x": x, "axes": None if axes is None else np.array(axes, np.int64)}
    (want,), (got,) = one_node.both("ReduceSum", inputs, {"y": dtype}, keepdims=keepdims,
                                    noop_with_empty_axes=noop)
    np.testing.assert_array_equal(got, want)


def test_seqlens_k_subgraph_gives_3_1_and_total_4(one_node):
    """docs/cases.md 3: the builder's mask -> seqlens_k / total_sequence_length subgraph."""
    nodes = [
        helper.make_node("ReduceSum", ["mask", "one"], ["rs"], keepdims=0),
        helper.make_node("Sub", ["rs", "one"], ["sub"]),
        helper.make_node("Cast", ["sub"], ["seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["mask"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["len"], axis=0),
        helper.make_node("Cast", ["len"], ["total"], to=TensorProto.INT32),
    ]
    graph = helper.make_graph(
        nodes, "seqlens", [helper.make_tensor_value_info("mask", TensorProto.INT64, [2, 4])],
        [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, None),
         helper.make_tensor_value_info("total", TensorProto.INT32, None)],
        [helper.make_tensor("one", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    from core.executor import Plan
    from providers.cpu_reference.provider import CpuReferenceProvider
    plan = Plan(graph, {"one": np.array([1], np.int64)}, CpuReferenceProvider())
    out = plan.run({"mask": np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int64)})
    np.testing.assert_array_equal(out["seqlens_k"], np.array([3, 1], np.int32))
    assert out["seqlens_k"].dtype == np.int32 and out["total"].dtype == np.int32
    np.testing.assert_array_equal(out["total"], np.array([4], np.int32))
    want = one_node.ort(model, {"mask": np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int64)})
    np.testing.assert_array_equal(want[0], out["seqlens_k"])


def test_constant_value_tensor_and_ints(one_node):
    t = helper.make_tensor("v", TensorProto.FLOAT, [2], [1.5, -2.0])
    (want,), (got,) = one_node.both("Constant", {}, {"y": np.float32}, value=t)
    np.testing.assert_array_equal(got, want)
    (want,), (got,) = one_node.both("Constant", {}, {"y": np.int64}, value_ints=[3, 4])
    np.testing.assert_array_equal(got, want)


def test_transpose_default_and_perm(one_node, rng):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    for attrs in ({}, {"perm": [0, 2, 1]}):
        (want,), (got,) = one_node.both("Transpose", {"x": x}, {"y": np.float32}, **attrs)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("in_shape,shape,allowzero", [((2, 3, 4), [0, -1], 0), ((2, 3, 4), [2, 0, 4], 0),
                                                      ((2, 3, 4), [-1], 0), ((2, 0, 3), [0, 3], 1)])
def test_reshape_zero_and_allowzero(one_node, rng, in_shape, shape, allowzero):
    x = rng.standard_normal(in_shape).astype(np.float32)
    inputs = {"x": x, "s": np.array(shape, np.int64)}
    (want,), (got,) = one_node.both("Reshape", inputs, {"y": np.float32}, allowzero=allowzero)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_where_equal_expand_concat(one_node, rng):
    a = rng.integers(0, 3, (2, 3)).astype(np.int64)
    b = rng.integers(0, 3, (3,)).astype(np.int64)
    (want,), (got,) = one_node.both("Equal", {"a": a, "b": b}, {"y": np.bool_})
    np.testing.assert_array_equal(got, want)
    c, d = np.array([[0, 1, 2], [2, 1, 0]], np.int64), np.array([1, 1, 1], np.int64)
    for op in ("Greater", "Less"):
        (want,), (got,) = one_node.both(op, {"a": c, "b": d}, {"y": np.bool_})
        np.testing.assert_array_equal(got, want)
        assert want.any() and not want.all()
    x, y = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((1, 3)).astype(np.float32)
    (want,), (got,) = one_node.both("Where", {"c": a > 1, "x": x, "y": y}, {"z": np.float32})
    np.testing.assert_array_equal(got, want)
    (want,), (got,) = one_node.both("Expand", {"x": y, "s": np.array([4, 1, 1], np.int64)}, {"z": np.float32})
    np.testing.assert_array_equal(got, want)
    (want,), (got,) = one_node.both("Concat", {"x": x, "y": y}, {"z": np.float32}, axis=0)
    np.testing.assert_array_equal(got, want)


def test_unsqueeze_squeeze_axes(one_node, rng):
    x = rng.standard_normal((2, 3)).astype(np.float32)
    (want,), (got,) = one_node.both("Unsqueeze", {"x": x, "a": np.array([0, -1], np.int64)}, {"y": np.float32})
    np.testing.assert_array_equal(got, want)
    z = rng.standard_normal((1, 2, 1, 3)).astype(np.float32)
    for axes in (np.array([2], np.int64), None):
        (want,), (got,) = one_node.both("Squeeze", {"x": z, "a": axes}, {"y": np.float32})
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([1], [1000], [1], None), ([-1], [-1000], [0], [-1]), ([0, 2], [-1, 100], [0, 2], [2, 1]),
    ([3], [0], [2], [-2]), ([-3], [2**62], None, None)])
def test_slice_clamping_and_negative_steps(one_node, rng, starts, ends, axes, steps):
    x = rng.standard_normal((5, 4, 6)).astype(np.float32)
    arr = lambda v: None if v is None else np.array(v, np.int64)  # noqa: E731
    inputs = {"x": x, "s": arr(starts), "e": arr(ends), "a": arr(axes), "p": arr(steps)}
    (want,), (got,) = one_node.both("Slice", inputs, {"y": np.float32})
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("start,limit,delta,dtype", [(0, 7, 2, np.int64), (10, 1, -3, np.int32),
                                                     (0.5, 3.3, 0.1, np.float32), (5, 5, 1, np.int64)])
def test_range_matches_ort_bitwise(one_node, start, limit, delta, dtype):
    inputs = {"a": np.array(start, dtype), "b": np.array(limit, dtype), "c": np.array(delta, dtype)}
    (want,), (got,) = one_node.both("Range", inputs, {"y": dtype})
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("split,num_outputs", [([2, 5, 1], None), (None, 3)])
def test_split_sizes_and_equal_chunks(one_node, rng, split, num_outputs):
    x = rng.standard_normal((3, 8)).astype(np.float32)
    attrs = {"axis": 1} | ({"num_outputs": num_outputs} if num_outputs else {})
    inputs = {"x": x, "s": None if split is None else np.array(split, np.int64)}
    want, got = one_node.both("Split", inputs, {"a": np.float32, "b": np.float32, "c": np.float32}, **attrs)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


# -- output buffers ------------------------------------------------------------------------

def _every_op() -> dict:
    """op -> (domain, attributes, inputs, number of outputs): one node of every cpu_reference
    op that has no case in the parity kit (whose poison covers the others), plus MatMul."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    y = rng.standard_normal(4).astype(np.float32)

    def i64(*v):
        return np.array(v, np.int64)

    angles = np.arange(4)[:, None] * np.arange(1, 5)[None, :] / 10
    rotary = (rng.standard_normal((1, 2, 16)).astype(np.float32), i64(0, 1)[None],
              np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
    return {
        "Add": ("", {}, (x, y), 1), "Sub": ("", {}, (x, y), 1), "Mul": ("", {}, (x, y), 1),
        "Div": ("", {}, (x, y + 3), 1), "Pow": ("", {}, (np.abs(x), np.array(2.0, np.float32)), 1),
        "Neg": ("", {}, (x,), 1), "Sqrt": ("", {}, (np.abs(x),), 1), "Tanh": ("", {}, (x,), 1),
        "Sigmoid": ("", {}, (x,), 1), "Softmax": ("", {}, (x,), 1),
        "Equal": ("", {}, (i64(1, 2, 3), i64(1, 0, 3)), 1), "Greater": ("", {}, (i64(1, 2, 3), i64(1, 0, 3)), 1),
        "Less": ("", {}, (i64(1, 2, 3), i64(1, 0, 3)), 1), "Where": ("", {}, (x > 0, x, y), 1),
        "Cast": ("", {"to": TensorProto.FLOAT16}, (x,), 1), "Concat": ("", {"axis": 1}, (x, x), 1),
        "Constant": ("", {"value": np.arange(3)}, (), 1), "Expand": ("", {}, (x[:, :1], i64(2, 3, 4)), 1),
        "Gather": ("", {"axis": 1}, (x, i64(0, 2, 2)), 1),
        "Range": ("", {}, (np.array(0), np.array(7), np.array(2)), 1),
        "ReduceSum": ("", {"keepdims": 0}, (x, i64(1)), 1), "Reshape": ("", {}, (x, i64(6, 4)), 1),
        "Shape": ("", {}, (x,), 1), "Slice": ("", {}, (x, i64(0), i64(2), i64(1)), 1),
        "Split": ("", {"axis": 2}, (x, i64(1, 3)), 2), "Squeeze": ("", {}, (x[:, :1], i64(1)), 1),
        "Unsqueeze": ("", {}, (x, i64(0)), 1), "Transpose": ("", {"perm": [2, 0, 1]}, (x,), 1),
        "MatMul": ("", {}, (x, rng.standard_normal((4, 5)).astype(np.float32)), 1),
        "SimplifiedLayerNormalization": ("", {"axis": -1}, (x, y), 2),
        "RotaryEmbedding": ("com.microsoft", {"num_heads": 2}, rotary, 1),
        # the router ops of LFM2-MoE (docs/moe.md)
        "Exp": ("", {}, (x,), 1), "Log": ("", {}, (np.abs(x) + 1,), 1), "Reciprocal": ("", {}, (y + 3,), 1),
        "Clip": ("", {}, (x, np.array(-0.5, np.float32), np.array(0.5, np.float32)), 1),
        "ConstantOfShape": ("", {"value": np.array([1.5], np.float32)}, (i64(2, 3),), 1),
        "TopK": ("", {"axis": -1}, (x, i64(2)), 2),
        "GatherElements": ("", {"axis": 2}, (x, np.zeros((2, 3, 2), np.int64) + i64(3, 1)), 1),
        "ScatterElements": ("", {"axis": 2}, (x, np.zeros((2, 3, 1), np.int64) + 2, x[:, :, :1] * 7), 1),
    }


EVERY_OP = _every_op()


def test_every_cpu_reference_op_is_checked_here_or_by_the_kit():
    assert {op for _, op in OpTable(ops).modules} <= set(EVERY_OP) | {c.op for c in OP_CASES}


def _poison(array: np.ndarray) -> None:
    array[...] = np.nan if array.dtype.kind == "f" else (True if array.dtype.kind == "b" else -7)


@pytest.mark.parametrize("op", sorted(EVERY_OP))
def test_outputs_are_the_nodes_buffers_fully_rewritten_and_never_an_input(op):
    """Each output is the node's ctx.output buffer: the same buffer on the next call, every
    element rewritten (the buffers are poisoned in between), sharing no memory with an input."""
    domain, attrs, inputs, n_out = EVERY_OP[op]
    node = NodeInfo(op, op, domain, attrs, tuple(f"x{i}" for i in range(len(inputs))),
                    tuple(f"y{i}" for i in range(n_out)), tuple(np.asarray(x).dtype for x in inputs))
    ctx = KernelContext(node, CpuReferenceProvider(), "head_major")
    run = OpTable(ops).kernel(node)
    first = run(ctx, *inputs)
    want = [np.array(o, copy=True) for o in first]
    for out in first:
        _poison(out)
    again = run(ctx, *inputs)
    for i, (got, expected) in enumerate(zip(again, want)):
        assert got is first[i] and got is ctx.output(i, expected.shape, expected.dtype)
        np.testing.assert_array_equal(got, expected)
        assert not any(np.shares_memory(got, x) for x in inputs if isinstance(x, np.ndarray))


def test_a_folded_value_is_frozen_read_only_and_never_rewritten(rng):
    """The builder's Transpose of the tied embedding runs once at plan time: its output becomes a
    frozen plan constant that later steps read and never write, and the folded node's context
    lets go of it (the node never runs again)."""
    w = rng.standard_normal((6, 4)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    plan = Plan(graph, {"w": w}, CpuReferenceProvider())
    folded = plan.constants["wt"]
    assert not folded.flags.writeable and plan.contexts[0].buffer_bytes() == 0
    for _ in range(2):
        x = rng.standard_normal((2, 4)).astype(np.float32)
        y = plan.run({"x": x})["y"]
        # fp32 sums of 4 products in another order: an absolute bound too (an output near 0
        # failed a relative one; the data is unseeded)
        np.testing.assert_allclose(y, x @ w.T, rtol=1e-5, atol=1e-5)
        assert not np.shares_memory(y, folded)
    np.testing.assert_array_equal(folded, w.T)

"""The standard ONNX ops of an in-graph MoE router (LFM2-MoE: sigmoid, bias, TopK, gather,
log, scatter into sentinel logits) on cpu_reference against ONNX Runtime CPU.

Exact where ORT's result is one correctly rounded op (TopK, the gathers and scatters, Clip,
ConstantOfShape); fp32 rtol 1e-6 for Exp / Log / Reciprocal (ORT's vectorized exp and log
differ from NumPy's in the last bit); fp16 computed in fp32 and rounded once.
"""

import numpy as np
import pytest
from onnx import helper

F32 = dict(rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("op", ["Exp", "Log", "Reciprocal"])
def test_unary_matches_ort(one_node, rng, op, dtype):
    x = (rng.standard_normal((3, 17)) * 3).astype(dtype)
    if op == "Log":
        x = np.abs(x)
        x[0, 0] = 0  # -inf
    (want,), (got,) = one_node.both(op, {"x": x}, {"y": dtype})
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                               **(F32 if dtype == np.float32 else dict(rtol=1e-3)))


@pytest.mark.parametrize("bounds", [("low",), ("high",), ("low", "high"), ()])
def test_clip_with_optional_bounds_matches_ort(one_node, rng, bounds):
    x = rng.standard_normal((4, 9)).astype(np.float32)
    x[0, 0] = np.nan
    inputs = {"x": x, "low": np.array(-0.5, np.float32) if "low" in bounds else None,
              "high": np.array(0.7, np.float32) if "high" in bounds else None}
    (want,), (got,) = one_node.both("Clip", inputs, {"y": np.float32})
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("axis", [-1, 0])
def test_topk_with_ties_matches_ort(one_node, rng, largest, axis):
    x = rng.integers(0, 4, (6, 8)).astype(np.float32)  # many ties
    inputs = {"x": x, "k": np.array([3], np.int64)}
    want, got = one_node.both("TopK", inputs, {"values": np.float32, "indices": np.int64}, axis=axis, largest=largest)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_gather_and_scatter_elements_match_ort(one_node, rng):
    data = rng.standard_normal((5, 8)).astype(np.float32)
    idx = np.stack([rng.permutation(8)[:3] for _ in range(5)]).astype(np.int64)
    idx[0, 0] = -1
    (want,), (got,) = one_node.both("GatherElements", {"data": data, "idx": idx}, {"y": np.float32}, axis=1)
    np.testing.assert_array_equal(got, want)
    updates = rng.standard_normal((5, 3)).astype(np.float32)
    (want,), (got,) = one_node.both("ScatterElements", {"data": data, "idx": idx, "updates": updates},
                                    {"y": np.float32}, axis=1)
    np.testing.assert_array_equal(got, want)


def test_constant_of_shape_matches_ort(one_node):
    value = helper.make_tensor("value", 1, [1], [-10000.0])
    (want,), (got,) = one_node.both("ConstantOfShape", {"shape": np.array([3, 8], np.int64)}, {"y": np.float32},
                                    value=value)
    assert got.shape == (3, 8)
    np.testing.assert_array_equal(got, want)


def test_sorted_0_and_scatter_reductions_are_refused(one_node):
    from core.executor import UnsupportedOpError

    m = one_node.model("TopK", {"x": np.zeros((2, 4), np.float32), "k": np.array([1], np.int64)},
                       {"v": np.float32, "i": np.int64}, sorted=0)
    with pytest.raises(UnsupportedOpError, match="TopK"):
        one_node.ref(m, {"x": np.zeros((2, 4), np.float32), "k": np.array([1], np.int64)})
    inputs = {"d": np.zeros((2, 4), np.float32), "i": np.zeros((2, 1), np.int64), "u": np.ones((2, 1), np.float32)}
    m = one_node.model("ScatterElements", inputs, {"y": np.float32}, axis=1, reduction="add")
    with pytest.raises(UnsupportedOpError, match="ScatterElements"):
        one_node.ref(m, inputs)

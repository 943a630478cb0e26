"""RMSNorm ops and RotaryEmbedding of cpu_reference against ONNX Runtime CPU (docs/ops.md 3, 4).

Tolerances: fp32 rtol 1e-5 atol 1e-5; fp16 rtol 1e-3 atol 2e-3.
"""

import numpy as np
import pytest

TOL = {np.float32: dict(rtol=1e-5, atol=1e-5), np.float16: dict(rtol=1e-3, atol=2e-3)}


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("skip_shape", [(2, 5, 32), (1, 5, 32), (5, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_simplified_layer_norm_outputs_0_2_3_broadcast_skip_and_bias(one_node, rng, dtype, skip_shape, with_bias):
    x = rng.standard_normal((2, 5, 32)).astype(dtype)
    inputs = {"x": x, "skip": rng.standard_normal(skip_shape).astype(dtype),
              "gamma": rng.standard_normal(32).astype(dtype),
              "bias": rng.standard_normal(32).astype(dtype) if with_bias else None}
    outputs = {"y": dtype, "mean": None, "inv_std": np.float32, "sum": dtype}
    want, got = one_node.both("SkipSimplifiedLayerNormalization", inputs, outputs, domain="com.microsoft",
                              epsilon=1e-6)
    _close(got[0], want[0], dtype)
    _close(got[1], want[1], np.float32)
    _close(got[2], want[2], dtype)


def test_skip_simplified_layer_norm_builder_outputs_y_and_sum(one_node, rng):
    x = rng.standard_normal((3, 4, 16)).astype(np.float32)
    inputs = {"x": x, "skip": rng.standard_normal((3, 4, 16)).astype(np.float32),
              "gamma": rng.standard_normal(16).astype(np.float32)}
    want, got = one_node.both("SkipSimplifiedLayerNormalization", inputs,
                              {"y": np.float32, "m": None, "i": None, "sum": np.float32}, domain="com.microsoft")
    _close(got[0], want[0], np.float32)
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("axis", [-1, 1])
def test_simplified_layer_norm_y_and_inv_std_var(one_node, rng, dtype, axis):
    x = rng.standard_normal((2, 3, 16)).astype(dtype)
    scale_shape = (16,) if axis == -1 else (3, 16)
    inputs = {"x": x, "scale": rng.standard_normal(scale_shape).astype(dtype)}
    want, got = one_node.both("SimplifiedLayerNormalization", inputs, {"y": dtype, "inv": np.float32},
                              axis=axis, epsilon=1e-6)
    _close(got[0], want[0], dtype)
    _close(got[1], want[1], np.float32)


def _caches(rng, max_pos, half, dtype):
    theta = rng.uniform(0.01, 1.0, half)
    t = np.arange(max_pos)[:, None] * theta[None, :]
    return np.cos(t).astype(dtype), np.sin(t).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("layout", ["bsd", "bnsh"])
@pytest.mark.parametrize("pos_kind", ["matrix", "base"])
def test_rotary_embedding_full_matches_ort(one_node, rng, dtype, interleaved, layout, pos_kind):
    b, s, n, h = 2, 5, 3, 16
    x = rng.standard_normal((b, s, n * h) if layout == "bsd" else (b, n, s, h)).astype(dtype)
    pos = (rng.integers(0, 20, (b, s)) if pos_kind == "matrix" else np.array([4])).astype(np.int64)
    cos, sin = _caches(rng, 32, h // 2, dtype)
    inputs = {"x": x, "pos": pos, "cos": cos, "sin": sin}
    (want,), (got,) = one_node.both("RotaryEmbedding", inputs, {"y": dtype}, domain="com.microsoft",
                                    interleaved=interleaved)
    _close(got, want, dtype)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding_partial_leaves_tail_dims_unchanged(one_node, rng, interleaved):
    b, s, n, h, rot = 2, 4, 2, 32, 16
    x = rng.standard_normal((b, s, n * h)).astype(np.float32)
    cos, sin = _caches(rng, 16, rot // 2, np.float32)
    inputs = {"x": x, "pos": rng.integers(0, 16, (b, s)).astype(np.int64), "cos": cos, "sin": sin}
    (want,), (got,) = one_node.both("RotaryEmbedding", inputs, {"y": np.float32}, domain="com.microsoft",
                                    interleaved=interleaved, num_heads=n, rotary_embedding_dim=rot)
    _close(got, want, np.float32)
    tail = got.reshape(b, s, n, h)[..., rot:]
    np.testing.assert_array_equal(tail, x.reshape(b, s, n, h)[..., rot:])

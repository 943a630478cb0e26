"""MoE and QMoE of cpu_reference against ONNX Runtime CPU and an independent NumPy loop (docs/moe.md).

ORT 1.32's CPU kernels run the fused interleaved SwiGLU (swiglu_fusion=1) and the plain
activations; the other SwiGLU layouts (fusion 0 and 2) are checked against the loop below.
Tolerances: fp32 rtol 1e-4 atol 1e-5 (ORT sums in another order); routing is exact (ties included).
"""

import numpy as np
import pytest

from providers.cpu_reference.ops._moe import route

F32 = dict(rtol=1e-4, atol=1e-5)
E, H, INTER, T = 6, 32, 32, 7
SWIGLU = dict(activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.702, activation_beta=1.0,
              swiglu_limit=7.0)


def _pack4(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [..., K] packed LSB-first (element 2i in the low nibble of byte i)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _quantized(rng, n, k, bs):
    """(packed [E, N, K/2], scales [E, N, K/bs], dequantized [E, N, K]) with random codes."""
    codes = rng.integers(0, 16, (E, n, k)).astype(np.uint8)
    scales = rng.uniform(0.02, 0.1, (E, n, k // bs)).astype(np.float32)
    deq = (codes.astype(np.float32) - 8).reshape(E, n, k // bs, bs) * scales[..., None]
    return _pack4(codes), scales, deq.reshape(E, n, k)


def _loop(x, router, w1, b1, w2, b2, k, normalize, act, w3=None):
    """The op, one token and one expert at a time in float64 (module docstring of ops._moe)."""
    out = np.zeros((x.shape[0], w2.shape[1]))
    for t in range(x.shape[0]):
        p = np.exp(router[t] - router[t].max())
        p /= p.sum()
        order = sorted(range(E), key=lambda e: (-p[e], -e))[:k]
        w = p[order] / (p[order].sum() if normalize else 1.0)
        for weight, e in zip(w, order):
            h = w1[e] @ x[t] + (0 if b1 is None else b1[e])
            up = None if w3 is None else w3[e] @ x[t]
            out[t] += weight * (w2[e] @ act(h, up) + (0 if b2 is None else b2[e]))
    return out


def _swiglu(fusion, alpha=1.702, beta=1.0, limit=7.0):
    def act(h, up):
        g, lin = {1: (h[0::2], h[1::2]), 2: (h[: h.size // 2], h[h.size // 2:]), 0: (h, up)}[fusion]
        g, lin = np.minimum(g, limit), np.clip(lin, -limit, limit)
        return g / (1 + np.exp(-alpha * g)) * (lin + beta)
    return act


def _dense(rng, fused=True):
    f = 2 if fused else 1
    return dict(w1=rng.standard_normal((E, f * INTER, H)).astype(np.float32) * 0.3,
                b1=rng.standard_normal((E, f * INTER)).astype(np.float32),
                w2=rng.standard_normal((E, H, INTER)).astype(np.float32) * 0.3,
                b2=rng.standard_normal((E, H)).astype(np.float32))


def _moe_inputs(x, router, w):
    return {"x": x, "router": router, "w1": w["w1"], "b1": w["b1"], "w2": w["w2"], "b2": w["b2"]}


@pytest.mark.parametrize("k,normalize", [(1, 0), (2, 1), (2, 0), (4, 1)])
def test_moe_swiglu_interleaved_matches_ort(one_node, rng, k, normalize):
    x = rng.standard_normal((T, H)).astype(np.float32)
    router = rng.standard_normal((T, E)).astype(np.float32)
    w = _dense(rng)
    (want,), (got,) = one_node.both("MoE", _moe_inputs(x, router, w), {"y": np.float32}, "com.microsoft",
                                    k=k, normalize_routing_weights=normalize, **SWIGLU)
    np.testing.assert_allclose(got, want, **F32)
    np.testing.assert_allclose(got, _loop(x, router, w["w1"], w["b1"], w["w2"], w["b2"], k, normalize,
                                          _swiglu(1)), **F32)


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "identity"])
def test_moe_plain_activations_match_ort(one_node, rng, activation):
    x = rng.standard_normal((2, 3, H)).astype(np.float32)  # 3-D input: B*S token rows
    router = rng.standard_normal((6, E)).astype(np.float32)
    w = _dense(rng, fused=False)
    (want,), (got,) = one_node.both("MoE", _moe_inputs(x, router, w), {"y": np.float32}, "com.microsoft",
                                    k=2, normalize_routing_weights=1, activation_type=activation)
    assert got.shape == x.shape
    np.testing.assert_allclose(got, want, **F32)


@pytest.mark.parametrize("fusion", [0, 2])
def test_moe_swiglu_separate_and_concatenated_layouts_follow_the_spec(one_node, rng, fusion):
    x = rng.standard_normal((T, H)).astype(np.float32) * 3  # some gate/up values beyond the limit
    router = rng.standard_normal((T, E)).astype(np.float32)
    w = _dense(rng, fused=fusion == 2)
    inputs = _moe_inputs(x, router, w)
    w3 = None
    if fusion == 0:
        w3 = rng.standard_normal((E, INTER, H)).astype(np.float32) * 0.3
        inputs |= {"w3": w3}
    m = one_node.model("MoE", inputs, {"y": np.float32}, "com.microsoft", k=2, normalize_routing_weights=1,
                       **(SWIGLU | {"swiglu_fusion": fusion}))
    (got,) = one_node.ref(m, inputs)
    want = _loop(x, router, w["w1"], w["b1"], w["w2"], w["b2"], 2, 1, _swiglu(fusion), w3)
    np.testing.assert_allclose(got, want, **F32)


def test_moe_fp16_is_computed_in_fp32_and_rounded_once(one_node, rng):
    x = rng.standard_normal((T, H)).astype(np.float16)
    router = rng.standard_normal((T, E)).astype(np.float16)
    w = {n: a.astype(np.float16) for n, a in _dense(rng).items()}
    inputs = _moe_inputs(x, router, w)
    m = one_node.model("MoE", inputs, {"y": np.float16}, "com.microsoft", k=2, normalize_routing_weights=1, **SWIGLU)
    (got,) = one_node.ref(m, inputs)
    wide = [w[n].astype(np.float64) for n in ("w1", "b1", "w2", "b2")]
    want = _loop(x.astype(np.float64), router.astype(np.float32), *wide, 2, 1, _swiglu(1))
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3, atol=2e-3)


def test_routing_ties_go_to_the_larger_expert_index_as_in_ort(one_node):
    """Expert e adds a one-hot bias at e (zero weights): the output row shows which experts were
    chosen and with what weight."""
    n = 4
    w1 = np.zeros((n, 8, 8), np.float32)
    w2 = np.zeros((n, 8, 8), np.float32)
    b2 = np.eye(n, 8, dtype=np.float32)
    router = np.array([[2, 2, 2, 2], [1, 2, 2, 0], [3, 1, 1, 1], [0, 5, 0, 5]], np.float32)
    x = np.ones((4, 8), np.float32)
    for k in (1, 2, 3):
        inputs = {"x": x, "router": router, "w1": w1, "b1": None, "w2": w2, "b2": b2}
        (want,), (got,) = one_node.both("MoE", inputs, {"y": np.float32}, "com.microsoft", k=k,
                                        normalize_routing_weights=0, activation_type="identity")
        np.testing.assert_array_equal(got[:, :n] > 0, want[:, :n] > 0)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    routing = route(router, 1, True)
    assert routing.experts[:, 0].tolist() == [3, 2, 0, 3]


@pytest.mark.parametrize("bs", [16, 32])
def test_qmoe_int4_blockwise_matches_ort(one_node, rng, bs):
    x = rng.standard_normal((T, H)).astype(np.float32)
    router = rng.standard_normal((T, E)).astype(np.float32)
    p1, s1, d1 = _quantized(rng, 2 * INTER, H, bs)
    p2, s2, d2 = _quantized(rng, H, INTER, bs)
    b1 = rng.standard_normal((E, 2 * INTER)).astype(np.float32)
    b2 = rng.standard_normal((E, H)).astype(np.float32)
    inputs = {"x": x, "router": router, "w1": p1, "s1": s1, "b1": b1, "w2": p2, "s2": s2, "b2": b2}
    (want,), (got,) = one_node.both("QMoE", inputs, {"y": np.float32}, "com.microsoft", k=2,
                                    normalize_routing_weights=1, expert_weight_bits=4, block_size=bs, **SWIGLU)
    np.testing.assert_allclose(got, want, **F32)
    np.testing.assert_allclose(got, _loop(x, router, d1, b1, d2, b2, 2, 1, _swiglu(1)), **F32)


def test_qmoe_per_row_scales_and_zero_points_dequantize_as_the_spec(one_node, rng):
    """No block_size: one scale per output row; packed uint8 zero points, 8-bit codes."""
    x = rng.standard_normal((T, H)).astype(np.float32)
    router = rng.standard_normal((T, E)).astype(np.float32)
    c1 = rng.integers(0, 256, (E, INTER, H)).astype(np.uint8)
    c2 = rng.integers(0, 256, (E, H, INTER)).astype(np.uint8)
    s1 = rng.uniform(0.001, 0.004, (E, INTER)).astype(np.float32)
    s2 = rng.uniform(0.001, 0.004, (E, H)).astype(np.float32)
    z1 = rng.integers(100, 156, (E, INTER)).astype(np.uint8)
    z2 = rng.integers(100, 156, (E, H)).astype(np.uint8)
    inputs = {"x": x, "router": router, "w1": c1, "s1": s1, "b1": None, "w2": c2, "s2": s2, "b2": None,
              "w3": None, "s3": None, "b3": None, "z1": z1, "z2": z2}
    m = one_node.model("QMoE", inputs, {"y": np.float32}, "com.microsoft", k=2, normalize_routing_weights=1,
                       expert_weight_bits=8, activation_type="relu")
    (got,) = one_node.ref(m, inputs)
    d1 = (c1.astype(np.float64) - z1[..., None]) * s1[..., None]
    d2 = (c2.astype(np.float64) - z2[..., None]) * s2[..., None]
    want = _loop(x, router, d1, None, d2, None, 2, 1, lambda h, _: np.maximum(h, 0))
    np.testing.assert_allclose(got, want, **F32)


@pytest.mark.parametrize("op", ["MoE", "QMoE"])
def test_each_row_alone_is_bitwise_its_row_of_the_batch(one_node, rng, op):
    """Batch invariance: rows sharing experts with others give the bits they give alone."""
    rows = 24
    x = rng.standard_normal((rows, H)).astype(np.float32)
    router = rng.standard_normal((rows, E)).astype(np.float32)
    if op == "MoE":
        w = _dense(rng)
        weights = {"w1": w["w1"], "b1": w["b1"], "w2": w["w2"], "b2": w["b2"]}
        attrs = {}
    else:
        p1, s1, _ = _quantized(rng, 2 * INTER, H, 16)
        p2, s2, _ = _quantized(rng, H, INTER, 16)
        weights = {"w1": p1, "s1": s1, "b1": None, "w2": p2, "s2": s2, "b2": None}
        attrs = {"expert_weight_bits": 4, "block_size": 16}
    inputs = {"x": x, "router": router, **weights}
    m = one_node.model(op, inputs, {"y": np.float32}, "com.microsoft", k=2, normalize_routing_weights=1,
                       **SWIGLU, **attrs)
    (batch,) = one_node.ref(m, inputs)
    assert len(set(route(router, 2, True).experts.reshape(-1).tolist())) == E  # experts shared by rows
    for i in range(rows):
        (alone,) = one_node.ref(m, inputs | {"x": x[i:i + 1], "router": router[i:i + 1]})
        assert np.array_equal(alone[0], batch[i]), f"row {i}"


@pytest.mark.parametrize("attrs,reason", [
    ({"use_sparse_mixer": 1}, "use_sparse_mixer"),
    ({"activation_type": "relu2"}, "activation_type"),
    ({"swiglu_limit_after_activation": 1}, "swiglu_limit_after_activation"),
])
def test_unsupported_moe_configurations_are_refused_with_their_reason(one_node, rng, attrs, reason):
    from core.executor import UnsupportedOpError

    w = _dense(rng, fused=False)
    x, router = rng.standard_normal((2, H)).astype(np.float32), rng.standard_normal((2, E)).astype(np.float32)
    inputs = _moe_inputs(x, router, w)
    m = one_node.model("MoE", inputs, {"y": np.float32}, "com.microsoft", k=2, **attrs)
    with pytest.raises(UnsupportedOpError, match=reason):
        one_node.ref(m, inputs)


def test_router_of_the_wrong_width_raises_before_any_work(one_node, rng):
    w = _dense(rng)
    x, router = rng.standard_normal((2, H)).astype(np.float32), rng.standard_normal((2, E + 1)).astype(np.float32)
    inputs = _moe_inputs(x, router, w)
    m = one_node.model("MoE", inputs, {"y": np.float32}, "com.microsoft", k=2, **SWIGLU)
    with pytest.raises(ValueError, match="router_probs"):
        one_node.ref(m, inputs)


def test_qwen_moe_experts_plain_swiglu_without_biases_match_ort(one_node, rng):
    """Qwen3.5-MoE's expert layer as the builder writes it: SwiGLU with alpha 1 and beta 0 (silu(g) * l),
    no limit, no expert biases, top 4 of the experts, normalized."""
    x = rng.standard_normal((T, H)).astype(np.float32)
    router = rng.standard_normal((T, E)).astype(np.float32)
    w = _dense(rng)
    inputs = _moe_inputs(x, router, w) | {"b1": None, "b2": None}
    attrs = dict(activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0)
    (want,), (got,) = one_node.both("MoE", inputs, {"y": np.float32}, "com.microsoft", k=4,
                                    normalize_routing_weights=1, **attrs)
    np.testing.assert_allclose(got, want, **F32)
    loop = _loop(x, router, w["w1"], None, w["w2"], None, 4, 1, _swiglu(1, 1.0, 0.0, np.inf))
    np.testing.assert_allclose(got, loop, **F32)

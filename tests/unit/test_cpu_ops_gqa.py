"""GroupQueryAttention of cpu_reference against ONNX Runtime CPU (docs/ops.md 1.3 / 1.4; docs/cases.md 1, 2, 5, 7).

ORT runs with a non-shared past (present is a new buffer); cpu_reference additionally runs in
share-buffer mode (past holds >= total rows and is written in place). Tolerances: fp32 rtol 1e-5
atol 2e-5; fp16 rtol 2e-3 atol 2e-3. Batch and layout invariance are checked bitwise.
"""

import numpy as np
import pytest

NAMES = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
         "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink"]
TOL = {np.float32: dict(rtol=1e-5, atol=2e-5), np.float16: dict(rtol=2e-3, atol=2e-3)}


def _caches(rng, max_pos, half, dtype):
    theta = rng.uniform(0.01, 1.0, half)
    t = np.arange(max_pos)[:, None] * theta[None, :]
    return np.cos(t).astype(dtype), np.sin(t).astype(dtype)


class Case:
    """Random GQA inputs for B rows, S new tokens, past lengths ``pasts`` and ``cap`` cache rows."""

    def __init__(self, rng, *, b=2, s=1, pasts=(0, 0), totals=None, nq=4, nkv=2, h=16, dtype=np.float32,
                 packed=False, rotary=None, cap=16, **attrs):
        self.rng, self.dtype, self.nq, self.nkv, self.h, self.s, self.b = rng, dtype, nq, nkv, h, s, b
        self.attrs = {"num_heads": nq, "kv_num_heads": nkv} | attrs
        self.pasts = list(pasts)
        self.totals = list(totals) if totals is not None else [p + s for p in pasts]
        self.total = max(self.totals) if s == 1 or b == 1 else s
        if packed:
            self.q = rng.standard_normal((b, s, (nq + 2 * nkv) * h)).astype(dtype)
            self.k = self.v = None
        else:
            self.q = rng.standard_normal((b, s, nq * h)).astype(dtype)
            self.k = rng.standard_normal((b, s, nkv * h)).astype(dtype)
            self.v = rng.standard_normal((b, s, nkv * h)).astype(dtype)
        self.cos = self.sin = None
        if rotary is not None:
            self.attrs |= {"do_rotary": 1, "rotary_interleaved": int(rotary == "interleaved")}
            half = (h // 4) if rotary == "partial" else h // 2
            self.cos, self.sin = _caches(rng, 64, half, dtype)
        # The KV history: rows [0, past_b) valid, NaN elsewhere (docs/cases.md 7).
        self.kv = [rng.standard_normal((b, nkv, cap, h)).astype(dtype) for _ in range(2)]
        for buf in self.kv:
            for i, p in enumerate(self.pasts):
                buf[i, :, p:] = np.nan
        self.extra = {}

    def inputs(self, past):
        vals = [self.q, self.k, self.v, past[0], past[1],
                np.array([t - 1 for t in self.totals], np.int32), np.array(self.total, np.int32),
                self.cos, self.sin, None, self.extra.get("attention_bias"), self.extra.get("head_sink")]
        return dict(zip(NAMES, vals))

    def ort_past(self):
        """Non-shared past of max(past) rows, zeros instead of NaN (ORT must not read them either)."""
        rows = max(self.pasts)
        return [np.nan_to_num(buf[:, :, :rows], nan=0.0) for buf in self.kv]

    def outputs(self):
        return {"out": self.dtype, "present_key": self.dtype, "present_value": self.dtype}

    def run_ort(self, one_node):
        inputs = self.inputs(self.ort_past())
        model = one_node.model("GroupQueryAttention", inputs, self.outputs(), "com.microsoft", **self.attrs)
        return one_node.ort(model, inputs)

    def run_ref(self, one_node, past=None, layout="head_major"):
        past = past if past is not None else [buf.copy() for buf in self.kv]
        inputs = self.inputs(past)
        model = one_node.model("GroupQueryAttention", inputs, self.outputs(), "com.microsoft", **self.attrs)
        return one_node.ref(model, inputs, kv_layout=layout), past


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **TOL[dtype])


FEATURES = [dict(), dict(rotary="half"), dict(rotary="interleaved"), dict(rotary="partial", h=32),
            dict(softcap=5.0), dict(local_window_size=3), dict(smooth_softmax=1), dict(scale=0.3),
            dict(rotary="half", softcap=2.0, local_window_size=2)]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()) or "plain")
def test_gqa_decode_shared_buffer_matches_ort_nonshared(one_node, rng, dtype, packed, feature):
    case = Case(rng, b=3, s=1, pasts=(5, 2, 9), dtype=dtype, packed=packed, **feature)
    want = case.run_ort(one_node)
    got, buf = case.run_ref(one_node)
    _close(got[0], want[0], dtype)
    assert got[1] is buf[0] and got[2] is buf[1]
    for b, t in enumerate(case.totals):
        for g in (1, 2):
            _close(got[g][b, :, :t], want[g][b, :, :t], dtype)
            assert np.isnan(got[g][b, :, t:]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()) or "plain")
def test_gqa_first_prompt_nonshared_matches_ort(one_node, rng, dtype, packed, feature):
    case = Case(rng, b=2, s=6, pasts=(0, 0), dtype=dtype, packed=packed, cap=0, **feature)
    want = case.run_ort(one_node)
    got, _ = case.run_ref(one_node, past=[np.zeros((2, case.nkv, 0, case.h), dtype) for _ in range(2)])
    for g in range(3):
        _close(got[g], want[g], dtype)


def test_gqa_head_sink_and_attention_bias_match_ort(one_node, rng):
    case = Case(rng, b=2, s=1, pasts=(4, 7), rotary="half")
    case.extra["attention_bias"] = rng.standard_normal((2, 1, 1, case.total)).astype(np.float32)
    case.extra["head_sink"] = rng.standard_normal(case.nq).astype(np.float32)
    want = case.run_ort(one_node)
    got, _ = case.run_ref(one_node)
    _close(got[0], want[0], np.float32)


def test_gqa_prompt_right_padding_valid_rows_match_ort_and_batch1(one_node, rng):
    """docs/cases.md 1 at op level: row 1 has 3 real tokens of 6; its valid rows equal its unpadded batch-1 run."""
    case = Case(rng, b=2, s=6, pasts=(0, 0), totals=(6, 3), rotary="half", cap=16)
    case.kv = [np.zeros_like(k) for k in case.kv]
    want = case.run_ort(one_node)
    got, buf = case.run_ref(one_node)
    _close(got[0][0], want[0][0], np.float32)
    _close(got[0][1, :3], want[0][1, :3], np.float32)
    alone = Case(rng, b=1, s=3, pasts=(0,), rotary="half", cap=16)
    alone.q, alone.k, alone.v = case.q[1:, :3], case.k[1:, :3], case.v[1:, :3]
    alone.cos, alone.sin = case.cos, case.sin
    got1, buf1 = alone.run_ref(one_node, past=[np.zeros((1, 2, 16, 16), np.float32) for _ in range(2)])
    np.testing.assert_array_equal(got1[0][0], got[0][1, :3])
    np.testing.assert_array_equal(buf1[0][0, :, :3], buf[0][1, :, :3])


@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()) or "plain")
def test_gqa_decode_row_bitwise_equals_its_batch1_call(one_node, rng, feature):
    case = Case(rng, b=3, s=1, pasts=(5, 2, 9), **feature)
    got, buf = case.run_ref(one_node)
    for b in range(3):
        alone = Case(rng, b=1, s=1, pasts=(case.pasts[b],), **feature)
        alone.q = case.q[b:b + 1]
        alone.k = None if case.k is None else case.k[b:b + 1]
        alone.v = None if case.v is None else case.v[b:b + 1]
        alone.cos, alone.sin = case.cos, case.sin
        alone.kv = [k[b:b + 1] for k in case.kv]
        got1, buf1 = alone.run_ref(one_node)
        np.testing.assert_array_equal(got1[0][0], got[0][b])
        np.testing.assert_array_equal(buf1[0][0], buf[0][b])


@pytest.mark.parametrize("filler", [np.nan, 1e4, -1e4])
def test_gqa_unused_slots_change_nothing(one_node, rng, filler):
    """docs/cases.md 7: values in cache rows >= T_b (any capacity) do not change the output."""
    case = Case(rng, b=2, s=1, pasts=(3, 6), rotary="half", cap=12)
    clean, _ = case.run_ref(one_node, past=[np.nan_to_num(k, nan=0.0) for k in case.kv])
    dirty_kv = [np.where(np.isnan(k), filler, k).astype(k.dtype) for k in case.kv]
    dirty, _ = case.run_ref(one_node, past=dirty_kv)
    np.testing.assert_array_equal(dirty[0], clean[0])
    big = [np.concatenate([k, np.full((2, 2, 20, 16), filler, np.float32)], axis=2) for k in dirty_kv]
    bigger, _ = case.run_ref(one_node, past=big)
    np.testing.assert_array_equal(bigger[0], clean[0])


def test_gqa_append_into_shared_buffer_subsequent_prompt(one_node, rng):
    """docs/cases.md 5 at op level (B = 1): capacity 16, past 3, append 4: rows [3, 7) written, rows < 3
    unchanged, NaN in rows >= 7 changes nothing; output matches ORT."""
    case = Case(rng, b=1, s=4, pasts=(3,), rotary="half", cap=16)
    before = case.kv[0].copy()
    want = case.run_ort(one_node)
    got, buf = case.run_ref(one_node)
    _close(got[0], want[0], np.float32)
    assert got[1] is buf[0]
    np.testing.assert_array_equal(buf[0][:, :, :3], before[:, :, :3])
    _close(buf[0][:, :, 3:7], want[1][:, :, 3:7], np.float32)
    assert np.isnan(buf[0][:, :, 7:]).all()


def test_gqa_subsequent_prompt_with_batch_2_raises(one_node, rng):
    case = Case(rng, b=2, s=4, pasts=(3, 3), cap=16)
    case.total = 7
    with pytest.raises(ValueError):
        case.run_ref(one_node)


def test_gqa_head_sink_with_smooth_softmax_raises(one_node, rng):
    case = Case(rng, b=1, s=1, pasts=(3,), smooth_softmax=1)
    case.extra["head_sink"] = np.zeros(case.nq, np.float32)
    with pytest.raises(ValueError):
        case.run_ref(one_node)


@pytest.mark.parametrize("s,pasts", [(1, (5, 2, 9)), (6, (0, 0, 0))])
def test_gqa_seq_major_equals_head_major_bitwise(one_node, rng, s, pasts):
    case = Case(rng, b=3, s=s, pasts=pasts, rotary="half", cap=16)
    head, hbuf = case.run_ref(one_node)
    seq_past = [np.ascontiguousarray(k.transpose(0, 2, 1, 3)) for k in case.kv]
    seq, sbuf = case.run_ref(one_node, past=seq_past, layout="seq_major")
    np.testing.assert_array_equal(seq[0], head[0])
    assert seq[1] is sbuf[0]
    np.testing.assert_array_equal(sbuf[0].transpose(0, 2, 1, 3), hbuf[0])
    np.testing.assert_array_equal(sbuf[1].transpose(0, 2, 1, 3), hbuf[1])


def test_gqa_quantized_kv_and_qk_output_are_refused():
    from core.protocol import NodeInfo
    from providers.cpu_reference.ops import group_query_attention as gqa
    base = dict(name="n", op_type="GroupQueryAttention", domain="com.microsoft",
                inputs=tuple(NAMES[:9]), outputs=("o", "pk", "pv"))
    assert gqa.supports(NodeInfo(attrs={"num_heads": 2, "kv_num_heads": 1}, **base))
    assert not gqa.supports(NodeInfo(attrs={"num_heads": 2, "kv_num_heads": 1, "k_quant_type": "PER_TENSOR"}, **base))
    assert not gqa.supports(NodeInfo(attrs={"num_heads": 2, "kv_num_heads": 1, "qk_output": 1}, **base))
    scaled = dict(base, inputs=tuple(NAMES) + ("k_scale",))
    assert not gqa.supports(NodeInfo(attrs={"num_heads": 2, "kv_num_heads": 1}, **scaled))



def _qk_norm_chain(case, one_node, eps):
    """The GQA of ``case`` after the Reshape -> SimplifiedLayerNormalization -> Reshape chain the
    builder writes for its CPU graph (what ORT fuses into inputs 14, 15); extra feeds
    ``<query|key>_shape3``, ``_shape2``, ``_w``."""
    from onnx import helper

    graph = one_node.model("GroupQueryAttention", case.inputs(case.kv), case.outputs(), "com.microsoft",
                           **case.attrs).graph
    nodes = []
    for name in ("query", "key"):
        nodes += [helper.make_node("Reshape", [name, f"{name}_shape3"], [f"{name}_heads"]),
                  helper.make_node("SimplifiedLayerNormalization", [f"{name}_heads", f"{name}_w"],
                                   [f"{name}_normed"], epsilon=eps, axis=-1, stash_type=1),
                  helper.make_node("Reshape", [f"{name}_normed", f"{name}_shape2"], [f"{name}_flat"])]
        graph.input.extend([helper.make_tensor_value_info(f"{name}_{x}", t, None)
                            for x, t in (("shape3", 7), ("shape2", 7), ("w", 1 if case.dtype == np.float32 else 10))])
    graph.node[0].input[0], graph.node[0].input[1] = "query_flat", "key_flat"
    for i, n in enumerate(nodes):
        graph.node.insert(i, n)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("s,pasts", [(1, (5, 2, 9)), (6, (0, 0, 0))], ids=["decode", "prompt"])
def test_gqa_fused_qk_norm_is_bitwise_the_builder_cpu_chain(one_node, rng, dtype, s, pasts):
    """docs/ops.md 1.3.0: inputs 14/15 give the bits of Reshape -> SimplifiedLayerNormalization
    (over the head size, fp32, rounded to T) -> Reshape before GQA, with RoPE after the norm;
    a per-side epsilon (k_norm_epsilon) overrides qk_norm_epsilon."""
    case = Case(rng, b=3, s=s, pasts=pasts, rotary="half", dtype=dtype, cap=16)
    case.q, case.k = (case.q * 4).astype(dtype), (case.k * 3).astype(dtype)  # scales the norm must undo
    qw = (1 + 0.3 * rng.standard_normal(case.h)).astype(dtype)
    kw = (1 + 0.3 * rng.standard_normal(case.h)).astype(dtype)
    eps = 1e-6

    def fused(**extra):
        inputs = case.inputs([buf.copy() for buf in case.kv]) | {
            "k_scale": None, "v_scale": None, "q_norm_weight": qw, "k_norm_weight": kw}
        model = one_node.model("GroupQueryAttention", inputs, case.outputs(), "com.microsoft",
                               qk_norm_epsilon=eps, **case.attrs, **extra)
        return one_node.ref(model, inputs)

    got = fused()
    feeds = case.inputs([buf.copy() for buf in case.kv]) | {
        "query_shape3": np.array([0, -1, case.h]), "query_shape2": np.array([0, -1, case.nq * case.h]),
        "key_shape3": np.array([0, -1, case.h]), "key_shape2": np.array([0, -1, case.nkv * case.h]),
        "query_w": qw, "key_w": kw}
    want = one_node.ref(_qk_norm_chain(case, one_node, eps), feeds)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    plain, _ = case.run_ref(one_node)
    assert not np.allclose(got[0].astype(np.float32), plain[0].astype(np.float32), atol=1e-2), "the norm ran"
    assert not np.array_equal(fused(k_norm_epsilon=1e3)[0], got[0])


def test_gqa_qk_norm_weights_must_come_together():
    from core.protocol import NodeInfo
    from providers.cpu_reference.ops import group_query_attention as gqa
    names = tuple(NAMES) + ("", "")
    base = dict(name="n", op_type="GroupQueryAttention", domain="com.microsoft", outputs=("o", "pk", "pv"),
                attrs={"num_heads": 2, "kv_num_heads": 1})
    assert gqa.supports(NodeInfo(inputs=names + ("qw", "kw"), **base))
    assert not gqa.supports(NodeInfo(inputs=names + ("qw",), **base))
    assert "k_norm_weight" in gqa.support_reason(NodeInfo(inputs=names + ("", "kw"), **base))
    bad = dict(base, attrs={"num_heads": 2, "kv_num_heads": 1, "qk_norm_epsilon": 0.0})
    assert "qk_norm_epsilon" in gqa.support_reason(NodeInfo(inputs=names + ("qw", "kw"), **bad))

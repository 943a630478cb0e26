"""Fusion passes: the fused graph computes the unfused graph's bits."""

import attrs
import numpy as np

from core import fusion
from core.executor import Plan, node_infos
from core.models.model import load_model
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider


def no_mask_fusion(node):
    """cpu_reference's supports, refusing the ReduceSumSubCast pass (for counts of the others)."""
    return node.op_type != "ReduceSumSubCast" and CpuReferenceProvider().supports(node)


class NoFusion(CpuReferenceProvider):
    """cpu_reference that refuses every fused op, so the plan keeps the original nodes."""

    def supports(self, node):
        return node.domain != fusion.FUSED_DOMAIN and super().supports(node)


def test_silu_mul_pass_replaces_three_nodes_per_layer(tmp_path):
    model = load_model(make_tiny_model(tmp_path / "m"))
    nodes = node_infos(model.graph)
    fused = fusion.apply(nodes, {o.name for o in model.graph.output}, no_mask_fusion)
    n_sig = sum(n.op_type == "Sigmoid" for n in nodes)
    assert n_sig > 0
    assert sum(n.op_type == "SiluMul" for n in fused) == n_sig
    assert len(nodes) - len(fused) == 2 * n_sig
    assert not any(n.op_type == "Sigmoid" for n in fused)


def test_pass_does_not_fire_when_the_provider_refuses(tmp_path):
    model = load_model(make_tiny_model(tmp_path / "m"))
    plan = Plan(model.graph, model.initializers, NoFusion())
    assert not any(n.domain == fusion.FUSED_DOMAIN for n in plan.nodes)


def test_fused_plan_is_bitwise_the_unfused_plan(tmp_path):
    for dtype in ("float32", "float16"):
        model = load_model(make_tiny_model(tmp_path / dtype, dtype=dtype))
        rng = np.random.default_rng()
        cfg = model.config
        B, S = 2, 5
        feeds = {"input_ids": rng.integers(0, cfg.vocab_size, (B, S)).astype(np.int64),
                 "attention_mask": np.ones((B, S), np.int64)}
        outs = []
        for provider in (CpuReferenceProvider(), NoFusion()):
            plan = Plan(model.graph, model.initializers, provider)
            kv = {}
            for name in plan.input_names:
                if name.startswith("past_key_values"):
                    kv[name] = np.zeros((B, cfg.num_kv_heads, 16, cfg.head_size), model.io_dtype)
            outs.append(plan.run({**feeds, **kv})["logits"])
        assert np.array_equal(outs[0], outs[1]), dtype


def test_gated_pass_fuses_gate_up_and_silu_mul_per_layer(tmp_path):
    for quant, op in ((None, "SiluGatedMatMul"), ("int4", "SiluGatedMatMulNBits")):
        model = load_model(make_tiny_model(tmp_path / str(quant), dtype="float16", quant=quant))
        nodes = node_infos(model.graph)
        fused = fusion.apply(nodes, {o.name for o in model.graph.output}, no_mask_fusion, set(model.initializers))
        n_sig = sum(n.op_type == "Sigmoid" for n in nodes)
        assert sum(n.op_type == op for n in fused) == n_sig > 0
        assert not any(n.op_type == "SiluMul" for n in fused)
        # Sigmoid, Mul, Mul, and one projection; fp16: the tied lookup's Transpose (GatherColumns)
        assert len(nodes) - len(fused) == 4 * n_sig + (0 if quant else 1)
        # without the weights among the constants the pass leaves the projections alone
        kept = fusion.apply(nodes, {o.name for o in model.graph.output}, no_mask_fusion)
        assert sum(n.op_type == "SiluMul" for n in kept) == n_sig


def _prefill_and_step(plan, model, prompt):
    """(prefill logits, one decode step's logits) of ``plan`` for the 2 x 5 ``prompt``."""
    cfg = model.config
    kv = {name: np.zeros((2, cfg.num_kv_heads, 16, cfg.head_size), model.io_dtype)
          for name in plan.input_names if name.startswith("past_key_values")}
    first = plan.run({"input_ids": prompt, "attention_mask": np.ones((2, 5), np.int64), **kv})
    step = plan.run({"input_ids": prompt[:, :1], "attention_mask": np.ones((2, 6), np.int64), **kv})
    return first["logits"], step["logits"]


def test_gated_plan_is_bitwise_the_unfused_plan_in_prefill_and_decode(tmp_path):
    class SiluMulOnly(CpuReferenceProvider):
        def supports(self, node):
            return not node.op_type.startswith("SiluGated") and super().supports(node)

    for dtype, quant in (("float32", None), ("float16", None), ("float16", "int4")):
        model = load_model(make_tiny_model(tmp_path / f"{dtype}{quant}", dtype=dtype, quant=quant))
        rng = np.random.default_rng(5)
        cfg = model.config
        prompt = rng.integers(0, cfg.vocab_size, (2, 5)).astype(np.int64)
        outs = []
        for provider in (CpuReferenceProvider(), SiluMulOnly()):
            plan = Plan(model.graph, model.initializers, provider)
            fused = any(n.op_type.startswith("SiluGated") or str(n.attrs.get("consumer", "")).startswith("SiluGated")
                        for n in plan.nodes)
            assert fused == (not isinstance(provider, SiluMulOnly))
            outs.append(_prefill_and_step(plan, model, prompt))
        assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1]), (dtype, quant)


def test_tied_gather_pass_reads_the_lm_head_weight_and_folds_no_transposed_copy(tmp_path):
    model = load_model(make_tiny_model(tmp_path / "m", dtype="float16"))
    nodes = node_infos(model.graph)
    inits = set(model.initializers)
    fused = fusion.apply(nodes, {o.name for o in model.graph.output}, CpuReferenceProvider().supports, inits)
    (lookup,) = [n for n in fused if n.op_type == "GatherColumns"]
    assert lookup.domain == fusion.FUSED_DOMAIN and lookup.inputs == ("lm_head.MatMul.weight", "input_ids")
    assert not any(n.op_type == "Transpose" for n in fused)
    # one weight, two readers
    assert [n for n in fused if n.op_type == "MatMul" and "lm_head.MatMul.weight" in n.inputs]
    plan = Plan(model.graph, model.initializers, CpuReferenceProvider())
    shape = model.initializers["lm_head.MatMul.weight"].shape
    assert not [k for k, v in plan.constants.items() if v.shape == shape[::-1]]  # no [V, K] table folded
    # not fused: a weight that is not a constant, a perm other than [1, 0], a transposed value read twice
    tr = fusion.NodeInfo(name="t", op_type="Transpose", domain="", attrs={"perm": [1, 0]}, inputs=("w",),
                         outputs=("wt",), input_dtypes=(None,))
    ga = fusion.NodeInfo(name="g", op_type="Gather", domain="", attrs={}, inputs=("wt", "ids"), outputs=("y",),
                         input_dtypes=(None, None))
    ok = CpuReferenceProvider().supports
    assert [n.op_type for n in fusion.fuse_tied_gather([tr, ga], set(), ok, {"w"})] == ["GatherColumns"]
    assert [n.op_type for n in fusion.fuse_tied_gather([tr, ga], set(), ok, set())] == ["Transpose", "Gather"]
    flipped = attrs.evolve(tr, attrs={"perm": [0, 1]})
    assert [n.op_type for n in fusion.fuse_tied_gather([flipped, ga], set(), ok, {"w"})] == ["Transpose", "Gather"]
    twice = [tr, ga, fusion.NodeInfo(name="g2", op_type="Gather", domain="", attrs={}, inputs=("wt", "ids"),
                                     outputs=("y2",), input_dtypes=(None, None))]
    assert [n.op_type for n in fusion.fuse_tied_gather(twice, set(), ok, {"w"})] == ["Transpose", "Gather", "Gather"]
    assert [n.op_type for n in fusion.fuse_tied_gather([tr, ga], {"wt"}, ok, {"w"})] == ["Transpose", "Gather"]


def _mask_graph(extra_reader: bool = False, constant_nodes: bool = True, axes=(1,), b=(1,), keepdims=0):
    """attention_mask -> ReduceSum -> Sub -> Cast int32, as the builder writes it: the axes and
    the 1 come from Constant nodes (or from initializers)."""
    from onnx import TensorProto, helper, numpy_helper

    one = numpy_helper.from_array(np.array(b, np.int64), "one")
    ax = numpy_helper.from_array(np.array(axes, np.int64).reshape(-1), "axes")
    nodes = [helper.make_node("Constant", [], ["one"], value=one),
             helper.make_node("Constant", [], ["axes"], value=ax)] if constant_nodes else []
    nodes += [helper.make_node("ReduceSum", ["attention_mask", "axes"], ["sum"], keepdims=keepdims),
              helper.make_node("Sub", ["sum", "one"], ["diff"]),
              helper.make_node("Cast", ["diff"], ["seqlens_k"], to=TensorProto.INT32)]
    outputs = [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, None)]
    if extra_reader:  # the sum read elsewhere too: the pass must leave the chain alone
        nodes.append(helper.make_node("Cast", ["sum"], ["sum_copy"], to=TensorProto.INT32))
        outputs.append(helper.make_tensor_value_info("sum_copy", TensorProto.INT32, None))
    graph = helper.make_graph(nodes, "mask", [helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                                                            ["B", "T"])], outputs,
                              initializer=[] if constant_nodes else [one, ax])
    return graph, ({} if constant_nodes else {"one": np.array(b, np.int64), "axes": np.array(axes, np.int64)})


def test_mask_pass_fuses_the_seqlens_chain_and_keeps_its_bits():
    mask = (np.arange(40)[None, :] < np.array([[3], [40], [1]])).astype(np.int64)
    for constant_nodes in (True, False):
        graph, inits = _mask_graph(constant_nodes=constant_nodes)
        fused = Plan(graph, inits, CpuReferenceProvider())
        assert [n.op_type for n in fused.nodes if n.op_type != "Constant"] == ["ReduceSumSubCast"]
        plain = Plan(graph, inits, NoFusion())
        assert [n.op_type for n in plain.nodes if n.op_type != "Constant"] == ["ReduceSum", "Sub", "Cast"]
        got, want = fused.run({"attention_mask": mask})["seqlens_k"], plain.run({"attention_mask": mask})["seqlens_k"]
        assert got.dtype == want.dtype == np.int32 and np.array_equal(got, want) and got.tolist() == [2, 39, 0]


def test_mask_pass_leaves_a_sum_with_another_reader():
    graph, inits = _mask_graph(extra_reader=True)
    plan = Plan(graph, inits, CpuReferenceProvider())
    assert not any(n.op_type == "ReduceSumSubCast" for n in plan.nodes)


def test_the_tiny_model_runs_its_seqlens_in_one_node(tmp_path):
    model = load_model(make_tiny_model(tmp_path / "m"))
    plan = Plan(model.graph, model.initializers, CpuReferenceProvider())
    assert sum(n.op_type == "ReduceSumSubCast" for n in plan.nodes) == 1
    assert not any(n.op_type == "ReduceSum" for n in plan.nodes)


def test_mask_pass_keeps_reducesum_semantics_at_the_edges():
    """Empty axes sum every axis (ONNX ReduceSum), a two-dimensional b widens the output, keepdims
    keeps the summed axis, a negative axis counts from the end: fused == unfused, values and shape."""
    mask = (np.arange(9)[None, :] < np.array([[2], [9]])).astype(np.int64)
    for axes, b, keepdims in (((), (1,), 0), ((1,), [[1]], 0), ((-1,), (3,), 1), ((0,), (1,), 0)):
        graph, inits = _mask_graph(axes=axes, b=b, keepdims=keepdims)
        fused = Plan(graph, inits, CpuReferenceProvider())
        assert any(n.op_type == "ReduceSumSubCast" for n in fused.nodes)
        got = fused.run({"attention_mask": mask})["seqlens_k"]
        want = Plan(graph, inits, NoFusion()).run({"attention_mask": mask})["seqlens_k"]
        assert got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want), (axes, b, keepdims)


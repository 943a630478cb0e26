"""Plan-time weight preparation (the op modules' ``prepare`` hook) and the per-step weight
reads a residency planner sees (Plan.weight_reads)."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from core.executor import GATHER_OPS, Plan, WeightRead
from core.models.model import load_model
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.ops import matmul, silu_gated_matmul
from providers.cpu_reference.provider import CpuReferenceProvider


def _transpose_hook(ctx, a, w):
    """MatMul: keep W as W^T [N, K] (a stand-in for a kernel layout)."""
    if w is None:
        return None
    ctx.cache["transposed"] = True
    return {1: np.ascontiguousarray(w.T)}


def _transposed_matmul(ctx, a, w):
    if ctx.cache.get("transposed"):
        w = np.ascontiguousarray(w.T)
    return matmul.run(ctx, a, w)


def _concat_hook(ctx, x, w_gate, w_up):
    """SiluGatedMatMul: gate and up as one [K, 2N] weight in input 1; input 2 dropped."""
    ctx.cache["concat"] = True
    return {1: np.concatenate([w_gate, w_up], axis=1), 2: None}


def _concat_gated(ctx, x, w, w_up):
    if ctx.cache.get("concat"):
        assert w_up is None
        w, w_up = (np.ascontiguousarray(p) for p in np.split(w, 2, axis=1))
    return silu_gated_matmul.run(ctx, x, w, w_up)


class Preparing(CpuReferenceProvider):
    """cpu_reference whose MatMul and SiluGatedMatMul read prepared weights (``only``: the
    names of the nodes to prepare, None for all)."""

    def __init__(self, only=None):
        super().__init__()
        self.only = only

    def prepare(self, node):
        if self.only is not None and node.name not in self.only:
            return None
        return {"MatMul": _transpose_hook, "SiluGatedMatMul": _concat_hook}.get(node.op_type)

    def kernel(self, node):
        return {"MatMul": _transposed_matmul, "SiluGatedMatMul": _concat_gated}.get(node.op_type) or \
            super().kernel(node)


def _tiny(tmp_path, dtype="float32", quant=None):
    model = load_model(make_tiny_model(tmp_path / f"{dtype}{quant}", dtype=dtype, quant=quant))
    cfg = model.config
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 5)).astype(np.int64)

    def feeds(plan):
        kv = {n: np.zeros((2, cfg.num_kv_heads, 16, cfg.head_size), model.io_dtype)
              for n in plan.input_names if n.startswith("past_key_values")}
        return {"input_ids": prompt, "attention_mask": np.ones((2, 5), np.int64), **kv}

    return model, feeds


def test_prepared_plan_is_bitwise_the_plain_plan_and_holds_only_the_prepared_weights(tmp_path):
    model, feeds = _tiny(tmp_path)
    plain = Plan(model.graph, model.initializers, CpuReferenceProvider())
    plan = Plan(model.graph, model.initializers, Preparing())
    assert np.array_equal(plan.run(feeds(plan))["logits"], plain.run(feeds(plain))["logits"])
    prepared = [plan.nodes[i] for i in plan.steps if plan.nodes[i].op_type in ("MatMul", "SiluGatedMatMul")]
    assert prepared and plan.prepared
    for node in prepared:
        assert node.inputs[1] == f"{node.name}:prepared:1" and node.inputs[1] in plan.constants
        assert plan.contexts[plan.nodes.index(node)].node is node
    gated = [n for n in prepared if n.op_type == "SiluGatedMatMul"]
    assert gated and all(n.inputs[2] == "" for n in gated)
    originals = {x for i in plain.steps for x in plain.nodes[i].inputs[1:] if x in plain.constants} - \
                {x for i in plan.steps for x in plan.nodes[i].inputs}
    replaced = originals - {"lm_head.MatMul.weight"}
    assert replaced and not replaced & set(plan.constants)
    # replaced weights are dropped; the tied lm_head weight stays raw for the embedding lookup
    # (lockstep.GatherColumns, which this test provider does not prepare) beside its
    # transposed form: one layout more than the plain plan (the cuda hooks share one form)
    tied = model.initializers["lm_head.MatMul.weight"].nbytes
    assert "lm_head.MatMul.weight" in plan.constants
    assert plan.weight_bytes() == sum(v.nbytes for v in plan.constants.values()) == plain.weight_bytes() + tied
    assert plan.step_weight_bytes() == plain.step_weight_bytes()  # the raw table is gathered only


def _shared_weight_graph():
    """y1 = x @ W (node mm1), y2 = x @ W (node mm2), x float32 [2, 4], W [4, 3]."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y1"], name="mm1"),
             helper.make_node("MatMul", ["x", "W"], ["y2"], name="mm2")]
    return helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                             [helper.make_tensor_value_info(y, TensorProto.FLOAT, [2, 3]) for y in ("y1", "y2")])


def test_a_replaced_weight_another_step_still_reads_stays():
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    x = np.ones((2, 4), np.float32)
    both = Plan(_shared_weight_graph(), {"W": w}, Preparing())
    one = Plan(_shared_weight_graph(), {"W": w}, Preparing(only={"mm1"}))
    assert "W" not in both.constants and "W" in one.constants
    assert set(one.constants) == {"W", "mm1:prepared:1"}
    for plan in (both, one):
        out = plan.run({"x": x})
        assert np.array_equal(out["y1"], x @ w) and np.array_equal(out["y2"], x @ w)


def test_a_hook_that_replaces_a_fed_input_is_refused():
    class Bad(Preparing):
        def prepare(self, node):
            return lambda ctx, a, w: {0: np.zeros(1)}

    with pytest.raises(ValueError, match="replaced input 0, which is not a constant"):
        Plan(_shared_weight_graph(), {"W": np.ones((4, 3), np.float32)}, Bad())


@pytest.mark.parametrize("quant", [None, "int4"])
def test_weight_reads_list_each_constant_once_at_its_first_reader(tmp_path, quant):
    model, _ = _tiny(tmp_path, "float16" if quant else "float32", quant)
    plan = Plan(model.graph, model.initializers, CpuReferenceProvider())
    reads = plan.weight_reads()
    assert all(isinstance(r, WeightRead) for r in reads)
    assert [r.step for r in reads] == sorted(r.step for r in reads)
    names = [x for r in reads for x in (r.constant, *r.aliases)]
    assert len(set(names)) == len(names)
    wanted = {}
    for pos, i in enumerate(plan.steps):
        for x in plan.nodes[i].inputs:
            if x in plan.constants:
                wanted.setdefault(x, (pos, plan.nodes[i].name))
    assert {r.constant: (r.step, r.node) for r in reads} == {x: wanted[x] for x in wanted if x not in
                                                            {a for r in reads for a in r.aliases}}
    for r in reads:
        assert r.nbytes == plan.constants[r.constant].nbytes
        uses = [(plan.nodes[i].op_type, j) for i in plan.steps for j, x in enumerate(plan.nodes[i].inputs)
                if x in (r.constant, *r.aliases)]
        assert r.gathered == all(op in GATHER_OPS and j != 1 for op, j in uses)  # every reader gathers
    # fp32: the tied table is one constant read by GatherColumns and the lm_head MatMul, so it is
    # read in full (not gathered); int4: cpu_reference's folded Reshape copies the codes (the
    # lookup's own table, gathered), the scales are shared
    gathered = [r for r in reads if r.gathered]
    assert [plan.nodes[plan.steps[r.step]].op_type for r in gathered] == (["GatherBlockQuantized"] if quant else [])
    aliases = {a for r in reads for a in r.aliases}
    assert not aliases  # no constant of cpu_reference is a view of another
    if not quant:
        lookup = [r for r in reads if plan.nodes[plan.steps[r.step]].op_type == "GatherColumns"]
        assert [r.constant for r in lookup] == ["lm_head.MatMul.weight"]
    assert sum(r.nbytes for r in reads if not r.gathered) == plan.step_weight_bytes()
    assert plan.step_weight_bytes() <= plan.weight_bytes()
    assert plan.weight_bytes() == sum(v.nbytes for v in plan.constants.values())


def test_weight_reads_name_prepared_weights(tmp_path):
    model, _ = _tiny(tmp_path)
    plan = Plan(model.graph, model.initializers, Preparing())
    names = {r.constant for r in plan.weight_reads()}
    assert set(plan.prepared) <= names and not names - set(plan.constants)


class ViewingReshape(CpuReferenceProvider):
    """cpu_reference whose Reshape returns a view of its input, as a device provider's does."""

    def kernel(self, node):
        if node.op_type == "Reshape":
            return lambda ctx, data, shape: (data.reshape([int(d) for d in shape]),)
        return super().kernel(node)


def test_a_constant_viewing_another_is_one_weight_counted_once_and_never_streamed(tmp_path):
    from core.runtime import residency

    model, feeds = _tiny(tmp_path, "float16", "int4")
    plan = Plan(model.graph, model.initializers, ViewingReshape())
    codes, view = "lm_head.MatMul.weight_Q4", "/model/embed_tokens/Reshape/output_0"
    assert plan.constants[view].base is plan.constants[codes] or \
        plan.constants[view].base is plan.constants[codes].base  # the folded Reshape is a view
    (entry,) = [r for r in plan.weight_reads() if codes in (r.constant, *r.aliases)]
    assert (entry.constant, entry.aliases, entry.gathered) == (view, (codes,), False)  # the lm_head reads it all
    assert entry.nbytes == model.initializers[codes].nbytes
    assert plan.weight_bytes() == sum(v.nbytes for k, v in plan.constants.items() if k != view)  # the view: 0
    weights = residency.weights_of(plan)
    (w,) = [w for w in weights if w.name == view]
    assert w.aliases == (codes,) and w.readers == 2
    budget = residency.budget_for(weights, 0.9, mappable=True)  # stream as much as the policy lets
    assert view not in residency.plan_residency(weights, budget).streamed


class SeeingStorageNames(ViewingReshape):
    """ViewingReshape with a prepare hook on every node that records the pass's storage names."""

    seen: dict = {}

    def prepare(self, node):
        def hook(ctx, *inputs):
            from core.ops import PREPARE_SHARED, STORAGE_NAMES, storage_name

            names = ctx.cache[PREPARE_SHARED][STORAGE_NAMES]
            SeeingStorageNames.seen.update({x: storage_name(ctx, x) for x in node.inputs if x in names})
            return None

        return hook


def test_prepare_hooks_see_a_view_named_by_the_constant_it_views(tmp_path):
    """The builder's tied int4 table: the lookup reads a folded Reshape of the lm_head's codes.
    During the prepare pass both names lead to the codes' name (core.ops.STORAGE_NAMES), so hooks
    can share one prepared form by name; every other constant names itself."""
    model, _ = _tiny(tmp_path, "float16", "int4")
    SeeingStorageNames.seen = {}
    Plan(model.graph, model.initializers, SeeingStorageNames())
    seen = SeeingStorageNames.seen
    codes, view = "lm_head.MatMul.weight_Q4", "/model/embed_tokens/Reshape/output_0"
    assert seen[view] == seen[codes] == min(codes, view)
    assert all(root == name for name, root in seen.items() if name not in (codes, view))
    assert len(seen) > 2  # weights still on the host (uploaded at their hook) are not views


class MemoizingReshape(ViewingReshape):
    """ViewingReshape whose Reshape also keeps its input in its context and writes a buffer, as
    the cuda provider's eager replay memo (``ctx.cache[core.ops.RUN_MEMO]``) and ``ctx.output`` do."""

    def kernel(self, node):
        view = super().kernel(node)
        if node.op_type != "Reshape":
            return view

        def memo(ctx, data, shape):
            ctx.cache["_memo"] = (data,)
            ctx.output("scratch", (4,), np.float32)
            return view(ctx, data, shape)

        return memo


def test_a_folded_node_keeps_nothing_of_its_inputs(tmp_path):
    """A folded node never runs again, so its context is emptied after the fold: a memo of its
    inputs (the tied int4 table's raw codes, on cuda) must not outlive the prepare hooks that
    replace them."""
    model, _ = _tiny(tmp_path, "float16", "int4")
    plan = Plan(model.graph, model.initializers, MemoizingReshape())
    folded = [i for i, n in enumerate(plan.nodes) if n.op_type == "Reshape" and i not in plan.steps]
    assert folded  # the tied table's Reshape was folded
    for i in folded:
        assert plan.contexts[i].cache == {} and plan.contexts[i].buffer_bytes() == 0


def test_storage_names_join_whole_contiguous_views_only():
    """Two constants get one storage name only when they show the same bytes in the same order:
    a reshape of a whole weight does; a slice or a transposed view of it does not."""
    from core.executor.weights import bytes_key as _bytes_key

    w = np.arange(48, dtype=np.float16).reshape(6, 8)
    assert _bytes_key(w.reshape(12, 4)) == _bytes_key(w) == _bytes_key(w.reshape(-1))
    assert _bytes_key(w[:3]) != _bytes_key(w) and _bytes_key(w[3:]) != _bytes_key(w[:3])
    assert _bytes_key(w.T) != _bytes_key(w) and _bytes_key(w.copy()) != _bytes_key(w)

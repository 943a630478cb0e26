"""Fusion passes: the fused graph computes the unfused graph's bits."""

import numpy as np

from core import fusion
from core.executor import Plan, node_infos
from core.model import load_model
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider


class NoFusion(CpuReferenceProvider):
    """cpu_reference that refuses every fused op, so the plan keeps the original nodes."""

    def supports(self, node):
        return node.domain != fusion.FUSED_DOMAIN and super().supports(node)


def test_silu_mul_pass_replaces_three_nodes_per_layer(tmp_path):
    model = load_model(make_tiny_model(tmp_path / "m"))
    nodes = node_infos(model.graph)
    fused = fusion.apply(nodes, {o.name for o in model.graph.output}, CpuReferenceProvider().supports)
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

"""``support_reason(node) -> str | None``: the optional provider member that says why
``supports`` rejects a node (core.ops.OpTable, core.provider.ProviderBase, the built-in
providers, the numpy64 example), and the parity kit's use of it when it skips a case."""

from __future__ import annotations

import types

import numpy as np
import pytest

from core import fusion
from core.executor import Plan
from core.models.model import load_model
from core.ops import OpTable
from core.protocol import NodeInfo
from core.provider import ProviderBase
from core.testing.kit import support_message
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference import ops
from providers.cpu_reference.provider import CpuReferenceProvider


def _node(op_type, domain="", attrs=None, inputs=("a", "b"), dtypes=(np.float32, None)):
    return NodeInfo(name="n", op_type=op_type, domain=domain, attrs=attrs or {}, inputs=inputs, outputs=("y",),
                    input_dtypes=dtypes)


NBITS_BAD = _node("MatMulNBits", "com.microsoft", {"K": 64, "N": 8, "bits": 3, "block_size": 32},
                  ("a", "b", "s"), (np.float32, np.uint8, np.float32))


def test_op_table_reason_is_none_for_a_supported_node():
    table = OpTable(ops)
    node = _node("MatMul")
    assert table.supports(node) and table.support_reason(node) is None


def test_op_table_names_a_missing_op_module():
    table = OpTable(ops)
    assert table.support_reason(_node("NoSuchOp")) == "no op module for ai.onnx.NoSuchOp"
    assert table.support_reason(_node("NoSuchOp", "com.microsoft")) == "no op module for com.microsoft.NoSuchOp"


def test_op_table_without_a_module_reason_names_the_module_dtypes_and_attributes():
    table = OpTable(ops)
    assert not table.supports(NBITS_BAD)
    assert table.support_reason(NBITS_BAD) == (
        "providers.cpu_reference.ops.matmul_nbits.supports() returned False for dtypes "
        "[float32, uint8, float32] attrs {K=64, N=8, bits=3, block_size=32}")


def test_op_table_uses_the_op_modules_own_reason():
    table = OpTable(ops)
    said = types.SimpleNamespace(__name__="fake.said", OP_TYPE="Said", supports=lambda node: False,
                                 support_reason=lambda node: f"no {node.op_type} for rank 5", run=None)
    silent = types.SimpleNamespace(__name__="fake.silent", OP_TYPE="Silent", supports=lambda node: False,
                                   support_reason=lambda node: None, run=None)
    table.modules[("", "Said")], table.modules[("", "Silent")] = said, silent
    assert table.support_reason(_node("Said")) == "no Said for rank 5"
    assert table.support_reason(_node("Silent")).startswith("fake.silent.supports() returned False for dtypes")


def test_provider_base_default_is_none():
    assert ProviderBase().support_reason(NBITS_BAD) is None


def test_built_in_providers_delegate_to_their_op_table():
    cpu = CpuReferenceProvider()
    assert cpu.support_reason(_node("MatMul")) is None
    assert cpu.support_reason(NBITS_BAD) == OpTable(ops).support_reason(NBITS_BAD)
    from providers.cuda.provider import CudaProvider  # importable without CuPy (tests/unit/test_no_cupy.py)

    stand_in = types.SimpleNamespace(ops=OpTable(ops))  # no GPU here: the method over another table
    assert CudaProvider.support_reason(stand_in, NBITS_BAD) == OpTable(ops).support_reason(NBITS_BAD)
    assert CudaProvider.prepare is ProviderBase.prepare  # the cuda provider answers from its op table


def test_the_kit_message_carries_the_providers_reason():
    message = support_message(CpuReferenceProvider(), NBITS_BAD)
    assert message is not None and "com.microsoft.MatMulNBits" in message
    assert message.endswith("matmul_nbits.supports() returned False for dtypes [float32, uint8, float32] "
                            "attrs {K=64, N=8, bits=3, block_size=32}")


def _numpy64():
    pytest.importorskip("lockstep_numpy64", reason="example plugin not installed: pip install --no-deps "
                                                   "--no-build-isolation -e examples/lockstep-numpy64")
    from lockstep_numpy64.provider import Numpy64Provider

    return Numpy64Provider()


@pytest.mark.parametrize("op", ["SiluGatedMatMul", "SiluGatedMatMulNBits"])
def test_numpy64_declines_the_fused_gated_projections_and_says_why(op):
    provider = _numpy64()
    node = _node(op, fusion.FUSED_DOMAIN)
    assert not provider.supports(node)
    assert f"numpy64 declines lockstep.{op}" in provider.support_reason(node)
    assert provider.supports(_node("SiluMul", fusion.FUSED_DOMAIN))  # elementwise: cpu_reference's bits
    assert provider.support_reason(_node("MatMul")) is None
    assert provider.support_reason(_node("NoSuchOp")) == "no op module for ai.onnx.NoSuchOp"


@pytest.mark.parametrize("quant", [None, "int4"])
def test_numpy64_plans_keep_the_projections_unfused(tmp_path, quant):
    """The fusion pass asks supports(): numpy64's plan keeps the MatMul / MatMulNBits projections
    (run by its float64 kernels) and fuses only SiluMul, where cpu_reference fuses the gated op."""
    provider = _numpy64()
    model = load_model(make_tiny_model(tmp_path / "m", dtype="float16", quant=quant))
    ops_of = [n.op_type for n in Plan(model.graph, model.initializers, provider).nodes]
    reference = [n.op_type for n in Plan(model.graph, model.initializers, CpuReferenceProvider()).nodes]
    assert not any(op.startswith("SiluGated") for op in ops_of) and "SiluMul" in ops_of
    assert any(op.startswith("SiluGated") for op in reference)


def test_gqa_fused_qk_norm_is_supported_and_its_bad_forms_are_named():
    """Inputs 14, 15 (docs/ops.md 1.3.0) run on both built-in providers; one without the other, a
    non-positive epsilon, and on cuda a weight dtype other than the query's are each named."""
    from providers.cpu_reference.ops import group_query_attention as ref
    from providers.cuda.ops import group_query_attention as cuda

    names = ("q", "k", "v", "pk", "pv", "sk", "t", "cos", "sin", "", "", "", "", "")
    attrs = {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1}

    def gqa(inputs, dtypes=None, **extra):
        return NodeInfo(name="attn", op_type="GroupQueryAttention", domain="com.microsoft", attrs=attrs | extra,
                        inputs=inputs, outputs=("o", "pk2", "pv2"),
                        input_dtypes=dtypes or (np.float16,) * len(inputs))

    both = gqa(names + ("qw", "kw"))
    assert ref.supports(both) and cuda.supports(both) and cuda.support_reason(both) is None
    for kernel in (ref, cuda):
        assert "q_norm_weight without k_norm_weight" in kernel.support_reason(gqa(names + ("qw",)))
        assert "qk_norm_epsilon=-1.0" in kernel.support_reason(gqa(names + ("qw", "kw"), qk_norm_epsilon=-1.0))
    mixed = gqa(names + ("qw", "kw"), (np.float16,) * 14 + (np.float32, np.float16))
    assert ref.supports(mixed)  # it reads the weights as fp32 whatever their dtype
    assert cuda.support_reason(mixed) == "q_norm_weight dtype float32 (the kernel needs the query's, float16)"
    quant = gqa(names[:12] + ("ks", "vs"))
    assert "input k_scale" in cuda.support_reason(quant) and "input k_scale" in ref.support_reason(quant)


def test_gqa_sliding_window_cache_runs_on_the_built_in_providers_and_elsewhere_is_refused_with_what_to_do():
    """sliding_window_cache=1 (a ring, docs/kv-geometry.md) runs on cpu_reference and cuda; a
    ring without a window or with an attention bias is named; a provider whose kernels take no
    ring (gqa_unsupported without ring=True) names the node's cache and how to get a folder it runs."""
    from core.opdefs import gqa_unsupported
    from providers.cpu_reference.ops import group_query_attention as ref
    from providers.cuda.ops import group_query_attention as cuda

    names = ("q", "", "", "pk", "pv", "sk", "t", "cos", "sin")

    def gqa(inputs=names, **extra):
        attrs = {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1, "sliding_window_cache": 1} | extra
        return NodeInfo(name="attn", op_type="GroupQueryAttention", domain="com.microsoft", attrs=attrs,
                        inputs=inputs, outputs=("o", "pk2", "pv2"), input_dtypes=(np.float16,) * len(inputs))

    ring = gqa(local_window_size=24)
    assert ref.supports(ring) and cuda.supports(ring)
    assert "a ring needs a window > 0" in ref.support_reason(gqa(local_window_size=-1))
    biased = gqa(names + ("", "bias"), local_window_size=24)
    assert "attention_bias" in ref.support_reason(biased)
    (reason,) = gqa_unsupported(ring)
    assert "sliding_window_cache=1" in reason and "windowed_kv_cache=false" in reason and "cpu_reference" in reason


def test_an_op_module_with_only_a_reason_supports_what_it_gives_no_reason_for():
    table = OpTable(ops)
    table.modules[("", "Picky")] = types.SimpleNamespace(
        __name__="fake.picky", OP_TYPE="Picky", run=None,
        support_reason=lambda node: None if node.input_dtypes[0] == np.float32 else "float32 only")
    assert table.supports(_node("Picky")) and table.support_reason(_node("Picky")) is None
    half = _node("Picky", dtypes=(np.float16, None))
    assert not table.supports(half) and table.support_reason(half) == "float32 only"

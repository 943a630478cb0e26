"""The cuda MoE / QMoE op modules' host-side answers (no GPU): which nodes they take, why they
refuse the others, and the plan-time repack of the builder's CUDA expert layout (docs/moe.md,
"On cuda"). The kernels themselves run in tests/cuda (test_ops.py -k MoE, test_moe_cuda.py)."""

import numpy as np
import pytest

from core.protocol import NodeInfo
from providers.cuda.ops import moe, qmoe

SWIGLU = {"activation_type": "swiglu", "swiglu_fusion": 1, "k": 2, "normalize_routing_weights": 1}
F16, U8 = np.dtype(np.float16), np.dtype(np.uint8)


def _node(op, attrs, dtypes):
    names = tuple(f"i{j}" for j in range(len(dtypes)))
    return NodeInfo(name="moe", op_type=op, domain="com.microsoft", attrs=attrs, inputs=names,
                    outputs=("y",), input_dtypes=tuple(dtypes))


def test_the_builders_moe_and_block_wise_qmoe_nodes_are_taken():
    assert moe.supports(_node("MoE", SWIGLU, [F16] * 6))
    q = _node("QMoE", SWIGLU | {"expert_weight_bits": 4, "block_size": 32}, [F16, F16, U8, F16, F16, U8, F16, F16])
    assert qmoe.supports(q) and qmoe.support_reason(q) is None


@pytest.mark.parametrize("op,attrs,dtypes,reason", [
    ("MoE", SWIGLU | {"use_sparse_mixer": 1}, [F16] * 6, "use_sparse_mixer"),
    ("MoE", SWIGLU, [F16, np.dtype(np.float32)] + [F16] * 4, "input dtypes"),
    ("MoE", SWIGLU, [np.dtype(np.float64)] * 6, "input dtypes"),
    ("QMoE", SWIGLU, [F16, F16, U8, F16, F16, U8, F16, F16], "without block_size"),
    ("QMoE", SWIGLU | {"block_size": 32, "weights_prepacked": 2}, [F16, F16, U8, F16], "weights_prepacked"),
])
def test_other_nodes_are_refused_with_their_reason(op, attrs, dtypes, reason):
    module = moe if op == "MoE" else qmoe
    node = _node(op, attrs, dtypes)
    assert not module.supports(node) and reason in module.support_reason(node)


class _Ctx:
    def __init__(self, attrs):
        self.node = _node("QMoE", attrs, [])


def test_the_cuda_builds_expert_layout_is_repacked_at_plan_time():
    """E=8, H=64, I=64: the raw fc1 is [8, 128, 32]; the CUDA build's is [8, 64, 64] (core.qmoe_layout)."""
    from core import qmoe_layout

    ctx = _Ctx(SWIGLU | {"expert_weight_bits": 4, "block_size": 32})
    rng = np.random.default_rng(0)
    raw1, raw2 = (rng.integers(0, 256, s, dtype=np.uint8) for s in ((8, 128, 32), (8, 64, 32)))
    s1, s2 = np.ones((8, 128, 2), np.float16), np.ones((8, 64, 2), np.float16)
    assert qmoe.prepare(ctx, None, None, raw1, s1, None, raw2, s2) is None
    got = qmoe.prepare(ctx, None, None, qmoe_layout.to_cutlass(raw1, 4), s1, None, qmoe_layout.to_cutlass(raw2, 4), s2)
    assert sorted(got) == [2, 5] and np.array_equal(got[2], raw1) and np.array_equal(got[5], raw2)
    with pytest.raises(ValueError, match="fit neither"):
        qmoe.prepare(ctx, None, None, np.zeros((8, 60, 30), np.uint8), s1, None, raw2, s2)

"""Small mechanisms checked without a GPU: the GLU row layout of the cuda kernels, the
cpu_reference fp16 weight cache, frozen plan constants, the parity kit's decisive top-1, and
the ReduceSum axes rule both providers share (core.opdefs)."""

import numpy as np
import pytest

from core import opdefs
from core.executor import Plan
from core.models.model import load_model
from core.testing import parity
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.ops._util import as_compute
from providers.cpu_reference.provider import CpuReferenceProvider
from providers.cuda.ops import _mma_layout


@pytest.mark.parametrize("n", [1, 8, 12, 52, 1536])
def test_glu_interleave_puts_gate_and_up_of_a_feature_in_one_16_row_tile(n):
    gate = np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 1
    up = -gate
    both = _mma_layout.glu_interleave(np, gate, up)
    assert both.shape == (_mma_layout.glu_width(n), 3) and _mma_layout.glu_width(n) % 16 == 0
    for i, row in enumerate(both):
        feature = (i // 16) * 8 + i % 8  # what finish<GLU> writes for this row
        want = (gate if i % 16 < 8 else up)[feature] if feature < n else np.zeros(3)
        assert np.array_equal(row, want), i


class Ctx:
    def __init__(self):
        self.cache = {}


def test_fp16_constants_are_converted_once_and_writable_arrays_never_cached():
    ctx = Ctx()
    w = np.ones((4, 4), np.float16)
    w.flags.writeable = False
    first = as_compute(ctx, w, "b")
    assert first.dtype == np.float32 and as_compute(ctx, w, "b") is first
    live = np.ones((4, 4), np.float16)  # an activation: may change between calls
    as_compute(ctx, live, "a")
    live[...] = 2
    assert float(as_compute(ctx, live, "a")[0, 0]) == 2.0


def test_plan_constants_are_read_only(tmp_path):
    model = load_model(make_tiny_model(tmp_path / "m", dtype="float16"))
    plan = Plan(model.graph, model.initializers, CpuReferenceProvider())
    arrays = [v for v in plan.constants.values() if isinstance(v, np.ndarray)]
    assert arrays and not any(v.flags.writeable for v in arrays)


def _run(tokens, logits):
    return parity._Run(np.array(tokens), None, [np.array(step, np.float32) for step in logits])


def test_decisive_top1_leaves_out_steps_where_the_reference_is_a_near_tie():
    # reference: step 0 decisive (margin 5), step 1 a near tie (margin 0.01 < 0.03 * 10)
    ref = _run([[0], [1]], [[[10.0, 5.0, 0.0]], [[10.0, 9.99, 0.0]]])
    ref.tokens[1, 0] = 0  # the reference picked token 0 at the near tie
    test = _run([[0], [1]], [[[10.0, 5.0, 0.0]], [[9.99, 10.0, 0.0]]])  # flips the near tie
    report = parity.ParityReport("m", "p", "r", "float16", [1], 1)
    parity._logits_gate(report, {1: test}, [test], [ref], rtol=0.03)
    metrics = report.gate("logits").metrics
    assert metrics["top1_agreement"] == 0.5
    assert metrics["top1_decisive"] == 1.0 and metrics["decisive_steps"] == 1


@pytest.mark.parametrize("attrs,axes,want", [
    ({}, np.array([1], np.int64), (1,)),
    ({}, np.array([-1, 0, 2], np.int64), (0, 2)),          # negative, repeated: sorted set
    ({"axes": [-2]}, None, (1,)),                           # the attribute (opset < 13)
    ({}, None, (0, 1, 2)),                                  # absent: every axis
    ({}, np.array([], np.int64), (0, 1, 2)),                # empty: every axis
    ({"noop_with_empty_axes": 1}, None, None),              # empty and noop: the input itself
    ({"noop_with_empty_axes": 1}, np.array([0], np.int64), (0,)),
])
def test_reduce_axes(attrs, axes, want):
    node = type("Node", (), {"attrs": attrs})()
    assert opdefs.reduce_axes(node, axes, 3) == want


def test_reduce_axes_out_of_range():
    node = type("Node", (), {"attrs": {}})()
    with pytest.raises(ValueError, match="out of range"):
        opdefs.reduce_axes(node, np.array([3], np.int64), 3)

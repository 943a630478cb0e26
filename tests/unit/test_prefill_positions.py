"""Prefill computes only what is read: each row's last position's logits, and no padding
when rows of very different lengths are grouped (core.runtime.prompts); bitwise the same as
the padded run, the every-position run and one-row runs on cpu_reference."""

import numpy as np
import pytest

from core.executor import Plan
from core.fusion import LAST_INDEX
from core.generation.loop import decode
from core.kernel_profile import NodeObserver
from core.runtime import kv as kvgeo
from core.runtime.prompts import plan_groups
from core.runtime.runner import Runner
from core.session import RequestError, Session
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider

MIXED = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]


@pytest.fixture(scope="module", params=[("float32", None), ("float16", None), ("float16", "int4")],
                ids=["fp32", "fp16", "int4"])
def runner(request, tmp_path_factory):
    dtype, quant = request.param
    return Runner(make_tiny_model(tmp_path_factory.mktemp("tiny"), dtype=dtype, quant=quant), CpuReferenceProvider())


def _run(runner, rows, steps=6, **kw):
    s = Session(runner, batch=len(rows), capacity=kw.pop("capacity", 96), **kw)
    trace = decode(s, rows, steps, keep_logits=True)
    return trace, s


def test_prefill_logits_are_last_positions_only_and_bitwise_every_position(runner):
    assert runner.plan.last_position_steps is not None
    last, s = _run(runner, MIXED, steps=0)
    assert s.state.logits.shape == (3, 1, runner.model.config.vocab_size), "the last-position path did not run"
    full, f = _run(runner, MIXED, steps=0, all_logits=True)
    every = f.prompt_logits()
    assert every.shape == (3, 7, runner.model.config.vocab_size)
    for b, row in enumerate(MIXED):
        assert np.array_equal(last.logits[0, b], every[b, len(row) - 1])
    assert np.array_equal(last.tokens, full.tokens)
    with pytest.raises(RequestError, match="all_logits"):
        s.prompt_logits()


def test_decode_after_a_last_position_prefill_is_bitwise_the_all_positions_run(runner):
    a, s = _run(runner, MIXED)
    b, _ = _run(runner, MIXED, all_logits=True)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.logits, b.logits)
    assert s.state.logits.shape[1] == 1  # decode logits [B, 1, V]


def test_prompt_logits_refused_after_a_step(runner):
    _, s = _run(runner, MIXED, steps=1, all_logits=True)
    with pytest.raises(RequestError, match="before step"):
        s.prompt_logits()


class NoReshape(CpuReferenceProvider):
    """cpu_reference refusing Reshape: the plan keeps every position's logits."""

    def supports(self, node):
        return node.op_type != "Reshape" and super().supports(node)


def test_a_provider_refusing_the_gather_ops_gets_every_position(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m")
    runner = Runner(model_dir, NoReshape())
    assert runner.plan.last_position_steps is None
    t, s = _run(runner, MIXED, steps=3)
    assert s.counters.prefill_runs == 1
    ref, _ = _run(Runner(model_dir, CpuReferenceProvider()), MIXED, steps=3)
    assert np.array_equal(t.tokens, ref.tokens) and np.array_equal(t.logits, ref.logits)


def test_plan_without_the_index_feed_runs_the_plain_program(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m")
    runner = Runner(model_dir, CpuReferenceProvider())
    plan: Plan = runner.plan
    cfg = runner.model.config
    feeds = {"input_ids": np.array([[3, 4, 5], [6, 7, 8]], np.int64), "attention_mask": np.ones((2, 3), np.int64)}
    for name in plan.input_names:
        if name.startswith("past_key_values"):
            feeds[name] = np.zeros((2, cfg.num_kv_heads, 8, cfg.head_size), runner.model.io_dtype)
    full = plan.run(dict(feeds))["logits"]
    assert full.shape == (2, 3, cfg.vocab_size)
    last = plan.run({**feeds, LAST_INDEX: np.array([2, 4], np.int64)})["logits"]
    assert last.shape == (2, 1, cfg.vocab_size)
    assert np.array_equal(last[:, 0], full[[0, 1], [2, 1]])


@pytest.mark.parametrize("lengths, auto, always", [
    ([40, 3, 3], [[0], [1, 2]], [[0], [1, 2]]),
    ([5, 5, 5], None, [[0, 1, 2]]),                          # equal lengths: one padded run
    ([10, 6, 4, 2], None, [[0, 1], [2], [3]]),               # the groups save too little
    ([1, 300, 2], [[1], [2], [0]], [[1], [2], [0]]),
    ([64, 33, 32, 1], None, [[0, 1], [2], [3]]),             # > L/2 joins; L/2 exactly does not
    ([64, 33, 32, 1, 1, 1, 1], [[0, 1], [2], [3, 4, 5, 6]], [[0, 1], [2], [3, 4, 5, 6]]),
])
def test_grouping_rule(lengths, auto, always):
    assert plan_groups(lengths) == auto
    assert plan_groups(lengths, "always") == always
    assert plan_groups(lengths, "off") is None


def test_grouping_rule_refuses_unknown_policy():
    with pytest.raises(ValueError, match="grouping"):
        plan_groups([3], "sometimes")
    with pytest.raises(RequestError, match="prefill_groups"):
        Session("no-such-model", prefill_groups="sometimes")


LONG_SHORT = [list(range(3, 63)), [7, 8, 9], [10, 11, 12]]  # 60, 3, 3 tokens


@pytest.mark.parametrize("layout", ["head_major", "seq_major"])
def test_pad_positions_cost_nothing_and_rows_are_bitwise_the_padded_run(runner, layout):
    r = runner if layout == "head_major" else runner.with_layout(layout)
    first_matmul = next(r.plan.nodes[i].name for i in r.plan.steps if r.plan.nodes[i].op_type.endswith("MatMul")
                        or r.plan.nodes[i].op_type == "MatMulNBits")
    counts = {}
    for grouping in ("auto", "off"):
        obs = r.plan.observer = NodeObserver(r.plan)
        try:
            s = Session(r, batch=3, capacity=96, kv_layout=layout, kv_policy="fixed", prefill_groups=grouping)
            s.prefill(LONG_SHORT)
        finally:
            r.plan.observer = None
        counts[grouping] = (obs.stats[first_matmul].positions, s.counters.prefill_positions, s.counters.prefill_runs)
    real = sum(map(len, LONG_SHORT))
    assert counts["auto"] == (real, real, 2), "the grouped prefill computed pad positions"
    assert counts["off"] == (3 * 60, 3 * 60, 1)
    grouped, _ = _run(r, LONG_SHORT, steps=8, kv_layout=layout, kv_policy="fixed")
    padded, _ = _run(r, LONG_SHORT, steps=8, kv_layout=layout, kv_policy="fixed", prefill_groups="off")
    assert np.array_equal(grouped.tokens, padded.tokens) and np.array_equal(grouped.logits, padded.logits)
    for b, row in enumerate(LONG_SHORT):
        alone, _ = _run(r, [row], steps=8, kv_layout=layout, kv_policy="fixed")
        assert np.array_equal(alone.tokens[:, 0], grouped.tokens[:, b])
        assert np.array_equal(alone.logits[:, 0], grouped.logits[:, b])


def test_always_grouping_matches_with_a_growing_cache(runner):
    rows = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6], [7, 8, 9, 10]]
    grouped, s = _run(runner, rows, steps=20, capacity=16, kv_policy="growing", prefill_groups="always")
    assert s.counters.prefill_runs == 3 and s.counters.growth_events >= 1
    padded, _ = _run(runner, rows, steps=20, capacity=16, kv_policy="growing", prefill_groups="off")
    assert np.array_equal(grouped.tokens, padded.tokens) and np.array_equal(grouped.logits, padded.logits)


@pytest.mark.parametrize("layout", ["head_major", "seq_major"])
def test_row_copies_move_live_prefixes_between_geometries(layout):
    rng = np.random.default_rng(0)
    src = kvgeo.KVGeometry(layout, 2, 3, 5, 4, 4)
    dst = kvgeo.KVGeometry(layout, 4, 3, 9, 4, 4)
    a = rng.standard_normal(src.shape).astype(np.float32)
    b = np.zeros(dst.shape, np.float32)
    rows = [(0, 3, 5), (1, 1, 2)]
    for so, do, n in kvgeo.row_copies(src, dst, rows):
        b.reshape(-1).view(np.uint8)[do:do + n] = a.reshape(-1).view(np.uint8)[so:so + n]
    want = np.zeros_like(b)
    for s, d, n in rows:
        if layout == "head_major":
            want[d, :, :n] = a[s, :, :n]
        else:
            want[d, :n] = a[s, :n]
    assert np.array_equal(b, want)
    with pytest.raises(kvgeo.KVLayoutError):
        kvgeo.row_copies(src, dst, [(0, 4, 1)])
    with pytest.raises(kvgeo.KVLayoutError):
        kvgeo.row_copies(src, attrs_evolve(dst, kv_heads=2), rows)


def attrs_evolve(geo, **kw):
    import attrs

    return attrs.evolve(geo, **kw)


def test_grouped_prefill_with_streamed_weights_is_bitwise_the_resident_run(tmp_path, monkeypatch):
    """Every group's plan run streams the weights through the staging ring (the static schedule
    runs per plan run, the last-position program included), and the bits do not change."""
    from core.runtime import residency

    monkeypatch.setattr(residency, "SMALL_BYTES", 512)  # the tiny matrices are a few KiB: let them stream
    model_dir = make_tiny_model(tmp_path / "m")
    resident_runner = Runner(model_dir, CpuReferenceProvider())
    resident, _ = _run(resident_runner, LONG_SHORT, steps=6)
    budget = residency.budget_for(residency.weights_of(resident_runner.plan), 0.5, slots=2, mappable=True)
    streamed_runner = Runner(model_dir, CpuReferenceProvider(), weight_budget=budget, staging_slots=2)
    per_run = streamed_runner.residency.weight_bytes_streamed_per_step
    assert per_run > 0
    streamed, s = _run(streamed_runner, LONG_SHORT, steps=6)
    assert s.counters.prefill_runs == 2 and s.counters.htod_bytes == (2 + 6) * per_run
    assert np.array_equal(resident.tokens, streamed.tokens) and np.array_equal(resident.logits, streamed.logits)


def test_no_grouping_under_a_device_budget(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m")
    runner = Runner(model_dir, CpuReferenceProvider(), device_budget="1GiB")
    _, s = _run(runner, LONG_SHORT, steps=1)
    assert s.counters.prefill_runs == 1 and s.counters.prefill_positions == 3 * 60

"""Prefill on cuda computes only what is read: last-position logits and pad-free length groups,
bitwise the padded and every-position runs on the same provider, with capture and VMM growth
after it; and ``lockstep profile --kernels`` times every node with CUDA events (GPU only)."""

import argparse

import numpy as np
import pytest
from _gpu import require_gpu

require_gpu()

from core.generation.loop import decode  # noqa: E402
from core.kernel_profile import profile_kernels  # noqa: E402
from core.runtime.runner import Runner  # noqa: E402
from core.session import Session  # noqa: E402

LONG_SHORT = [list(range(3, 63)), [7, 8, 9], [10, 11], list(range(20, 50))]  # 60, 3, 2, 30 tokens


@pytest.fixture(scope="module")
def runner(model_dir, gpu):
    return Runner(model_dir, gpu)


def _run(runner, rows, steps=12, **kw):
    kw.setdefault("capacity", 96)
    s = Session(runner, batch=len(rows), kv_layout=runner.kv_layout, **kw)
    t = decode(s, rows, steps, keep_logits=True)
    return t, s


def test_prefill_logits_are_last_positions_and_bitwise_every_position(runner):
    assert runner.plan.last_position_steps is not None
    last, s = _run(runner, LONG_SHORT, steps=0, prefill_groups="off")
    assert s.state.logits.shape == (4, 1, runner.model.config.vocab_size)
    full, f = _run(runner, LONG_SHORT, steps=0, all_logits=True)
    every = f.prompt_logits()
    for b, row in enumerate(LONG_SHORT):
        assert np.array_equal(last.logits[0, b], every[b, len(row) - 1]), b


@pytest.mark.parametrize("layout", ["head_major", "seq_major"])
def test_grouped_prefill_is_bitwise_the_padded_run_and_computes_no_padding(runner, layout):
    r = runner if layout == "head_major" else runner.with_layout(layout)
    grouped, s = _run(r, LONG_SHORT, kv_policy="fixed")
    assert s.counters.prefill_runs == 3 and s.counters.prefill_positions == 60 + 30 + 2 * 3
    padded, p = _run(r, LONG_SHORT, kv_policy="fixed", prefill_groups="off")
    assert p.counters.prefill_positions == 4 * 60
    assert np.array_equal(grouped.tokens, padded.tokens) and np.array_equal(grouped.logits, padded.logits)
    for b in (0, 1):
        alone, _ = _run(r, [LONG_SHORT[b]], kv_policy="fixed")
        assert np.array_equal(alone.tokens[:, 0], grouped.tokens[:, b])
        assert np.array_equal(alone.logits[:, 0], grouped.logits[:, b])


def test_capture_and_vmm_growth_after_a_grouped_prefill(runner, gpu):
    eager, _ = _run(runner, LONG_SHORT, steps=40, capacity=64, kv_policy="growing", capture=False)
    graph, s = _run(runner, LONG_SHORT, steps=40, capacity=64, kv_policy="growing", capture=True)
    assert s.counters.prefill_runs == 3 and s.counters.growth_events >= 1 and s.counters.captures >= 1
    assert np.array_equal(eager.tokens, graph.tokens) and np.array_equal(eager.logits, graph.logits)
    padded, _ = _run(runner, LONG_SHORT, steps=40, capacity=64, kv_policy="growing", prefill_groups="off")
    assert np.array_equal(padded.tokens, graph.tokens) and np.array_equal(padded.logits, graph.logits)


def test_kernel_profile_times_every_node_with_cuda_events(model_dir, gpu):
    args = argparse.Namespace(prompt_len=[32], context=128, warmup=2, tokens=4, layout="head_major",
                              tensor_tflops=989.0)
    for r in profile_kernels(model_dir, gpu, [1, 8], args):
        rows = {k["node"]: k for k in r["kernels"]}
        assert r["bandwidth"] and all(k["us"] > 0 for k in r["kernels"])
        lm = next(k for n, k in rows.items() if "lm_head" in n)
        assert lm["floor_us"] > 0 and lm["pct_of_floor"] > 0
        assert r["total"]["us"] == pytest.approx(sum(k["us"] for k in r["kernels"]))
        assert r["prefill"]["positions"] == 32 * r["batch"] and r["prefill"]["total"]["us"] > 0
        print(r["batch"], f"{r['total']['us']:.1f} us of GPU time per step, step {r['step_ms']:.3f} ms wall")

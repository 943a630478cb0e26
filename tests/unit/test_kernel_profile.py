"""``lockstep profile --kernels``: every node of a decode step and of a prefill timed and counted on
cpu_reference."""

import argparse
import json

import numpy as np
import pytest

from core.cli import main
from core.kernel_profile import profile_kernels, role
from core.runtime.runner import Runner
from core.session import RequestError
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def layer_count(plan):
    """Layers of the plan (its attention nodes): a role row sums the layers' instances."""
    return sum(plan.nodes[i].op_type == "GroupQueryAttention" for i in plan.steps)


def _args(**kw):
    base = dict(prompt_len=[5], context=32, warmup=1, tokens=3, layout="head_major", tensor_tflops=None)
    return argparse.Namespace(**{**base, **kw})


def test_every_node_of_a_step_is_in_the_table_with_its_calls_and_bytes(model_dir):
    results = profile_kernels(model_dir, "cpu_reference", [1, 3], _args())
    assert [(r["prompt_len"], r["batch"]) for r in results] == [(5, 1), (5, 3)]
    plan = Runner(model_dir, CpuReferenceProvider()).plan
    per_role: dict[str, int] = {}
    for i in plan.steps:
        per_role[role(plan.nodes[i].name)] = per_role.get(role(plan.nodes[i].name), 0) + 1
    for r in results:
        rows = {k["node"]: k for k in r["kernels"]}
        assert {n: rows[n]["calls"] for n in per_role} == per_role
        assert rows["(device_argmax)"]["calls"] == 1 and rows["(decode_advance)"]["calls"] == 1
        assert all(k["us"] > 0 for k in r["kernels"])
        assert [k["us"] for k in r["kernels"]] == sorted((k["us"] for k in r["kernels"]), reverse=True)
        total = r["total"]
        assert total["us"] == pytest.approx(sum(k["us"] for k in r["kernels"]))
        assert total["calls"] == len(plan.steps) + 2
        # the lm_head reads its whole weight once per step, plus its input rows
        weight = plan.constants["lm_head.MatMul.weight"].nbytes
        lm = rows["/lm_head/MatMul"]
        assert lm["bytes"] == weight + r["batch"] * (64 + 256) * 4  # fp32 input rows [B, 1, 64], logits
        assert lm["flops"] == 2 * r["batch"] * 64 * 256  # tiny model: hidden 64, vocab 256
        assert lm["floor_us"] is None and total["floor_us"] is None  # cpu_reference measures no bandwidth
        # the fused gated MLP counts both of its projections' FLOPs (two [64 x 128] per row a layer)
        gated = {role(plan.nodes[i].name) for i in plan.steps if plan.nodes[i].op_type == "SiluGatedMatMul"}
        assert len(gated) == 1
        assert rows[gated.pop()]["flops"] == 2 * r["batch"] * 64 * 128 * 2 * layer_count(plan)
    b1, b3 = results
    gqa = "/model/layers.*/attn/GroupQueryAttention"
    g1 = next(k for k in b1["kernels"] if k["node"] == gqa)
    g3 = next(k for k in b3["kernels"] if k["node"] == gqa)
    assert g3["bytes"] > g1["bytes"]  # three rows' KV and activations


def test_a_stated_tensor_rate_gives_a_floor(model_dir):
    r = profile_kernels(model_dir, "cpu_reference", [2], _args(tensor_tflops=1e-6))[0]
    lm = next(k for k in r["kernels"] if k["node"] == "/lm_head/MatMul")
    assert lm["floor_us"] == pytest.approx(lm["flops"] / 1e6 * 1e6)
    assert lm["pct_of_floor"] == pytest.approx(100 * lm["floor_us"] / lm["us"])


class Untimed(CpuReferenceProvider):
    def node_timer(self):
        return None


def test_a_provider_that_cannot_time_its_nodes_gets_a_clear_error(model_dir):
    with pytest.raises(RequestError, match="cannot time its nodes"):
        profile_kernels(model_dir, Untimed(), [1], _args())


def test_cli_kernels_prints_the_table_and_writes_json(model_dir, tmp_path, capsys):
    out = tmp_path / "k.json"
    code = main(["profile", str(model_dir), "--kernels", "--batch-sweep", "2", "--tokens", "2", "--warmup", "1",
                 "--context", "32", "--prompt-len", "4", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "/lm_head/MatMul" in text and "total" in text and "us/step" in text
    assert "prefill of 8 positions" in " ".join(text.split()) and "GFLOP" in text
    data = json.loads(out.read_text())
    assert data["results"][0]["batch"] == 2 and np.isfinite(data["results"][0]["total"]["us"])
    assert data["results"][0]["prefill"]["positions"] == 8 and np.isfinite(data["results"][0]["prefill"]["total"]["us"])
    code = main(["profile", str(model_dir), "--kernels", "--tensor-tflops", "-1"])
    assert code == 2 and "tensor-tflops" in capsys.readouterr().err


def test_profiles_say_which_provider_settings_they_measured(model_dir, tmp_path, capsys, monkeypatch):
    assert CpuReferenceProvider().settings() == {}  # no switches: nothing added to the titles
    monkeypatch.setattr(CpuReferenceProvider, "settings", lambda self: {"gemm_pipeline": "on", "pdl": "off"})
    out = tmp_path / "p.json"
    code = main(["profile", str(model_dir), "--batch-sweep", "1", "--tokens", "2", "--warmup", "1",
                 "--context", "32", "--json", str(out)])
    assert code == 0 and "gemm_pipeline=on, pdl=off" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["title"].endswith("; gemm_pipeline=on, pdl=off")
    assert data["rows"][0]["settings"] == {"gemm_pipeline": "on", "pdl": "off"}
    code = main(["profile", str(model_dir), "--kernels", "--batch-sweep", "1", "--tokens", "2", "--warmup", "1",
                 "--context", "32", "--prompt-len", "4", "--json", str(out)])
    assert code == 0 and "gemm_pipeline=on, pdl=off" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"][0]["settings"] == {"gemm_pipeline": "on", "pdl": "off"}


class RecordingTimer:
    """A node timer that records its calls (``hold``, ``mark``) in order; a mark's time is its
    index in microseconds."""

    def __init__(self):
        self.calls: list[str] = []

    def hold(self):
        self.calls.append("hold")

    def mark(self):
        self.calls.append("mark")
        return len(self.calls)

    def seconds(self, a, b):
        return 1e-6 * (b - a)


def test_the_launches_around_the_plan_are_timed_behind_a_gpu_hold(model_dir):
    """device_argmax and decode_advance are timed once each after the steps; a timer that can
    hold the GPU is asked to before the first mark, so those two rows count GPU work, not the
    host's launch gaps between the events."""
    from core.kernel_profile import _loop_stats
    from core.session import Session

    timer = RecordingTimer()
    calls = timer.calls
    session = Session(Runner(model_dir, CpuReferenceProvider()), batch=2, capacity=16)
    session.prefill([[5, 6, 7], [8]])
    stats = _loop_stats(session.runner.provider, timer, session.state, 4)
    assert calls == ["hold", "mark", "mark", "mark"]
    assert [st.name for st in stats] == ["(device_argmax)", "(decode_advance)"] and all(st.calls == 4 for st in stats)


def test_the_prefill_section_counts_batch_times_prompt_positions_per_projection(model_dir):
    """One prefill of 3 rows x 5 tokens, node by node: the layers' projections each compute 15
    positions (5 times a decode step's FLOPs at the same batch), the lm_head only the 3 last
    positions (the last-position gather before it), and every node of the prefill's program is timed."""
    r = profile_kernels(model_dir, "cpu_reference", [3], _args(prompt_len=[5]))[0]
    pre = r["prefill"]
    assert pre["positions"] == 15 and pre["prefill_ms"] > 0
    assert pre["tokens_per_s"] == pytest.approx(15 / (pre["prefill_ms"] / 1e3))
    rows = {k["node"]: k for k in pre["kernels"]}
    decode = {k["node"]: k for k in r["kernels"]}
    projections = [n for n, k in rows.items() if k["op"] in ("MatMul", "SiluGatedMatMul") and "layers.*" in n]
    assert len(projections) >= 3  # qkv, o, gated MLP, down
    for n in projections:
        assert rows[n]["positions"] == 15 and decode[n]["positions"] == 3
        assert rows[n]["flops"] == pytest.approx(5 * decode[n]["flops"])
    assert rows["/lm_head/MatMul"]["positions"] == 3
    plan = Runner(model_dir, CpuReferenceProvider()).plan
    assert sum(k["calls"] for k in pre["kernels"]) == len(plan.last_position_steps)
    assert all(k["us"] > 0 for k in pre["kernels"]) and "(device_argmax)" not in rows
    assert pre["total"]["us"] == pytest.approx(sum(k["us"] for k in pre["kernels"]))


def test_the_observed_prefill_comes_after_a_warm_up_of_its_shape(model_dir, monkeypatch):
    from core.runtime import step as steps

    real, seen = steps.prefill, []

    def prefill(state, input_ids, *a, **kw):
        seen.append((len(input_ids), len(input_ids[0]), state.runner.plan.observer is not None))
        return real(state, input_ids, *a, **kw)

    monkeypatch.setattr(steps, "prefill", prefill)
    profile_kernels(model_dir, "cpu_reference", [2], _args(prompt_len=[4]))
    # decode's prefill (the warm-up), the wall-timed one, then the one timed node by node
    assert seen == [(2, 4, False), (2, 4, False), (2, 4, True)]


def test_the_prefill_holds_the_gpu_once_before_its_first_node(model_dir):
    from core.kernel_profile import profile_prefill
    from core.session import Session

    timer = RecordingTimer()
    calls = timer.calls
    session = Session(Runner(model_dir, CpuReferenceProvider()), batch=2, capacity=16)
    session.prefill([[5, 6, 7], [8, 9, 10]])
    pre = profile_prefill(session, [[5, 6, 7], [8, 9, 10]], timer, None, None)
    assert calls[0] == "hold" and calls.count("hold") == 1
    assert calls.count("mark") == 2 * sum(k["calls"] for k in pre["kernels"])
    assert pre["positions"] == 6 and session.plan.observer is None

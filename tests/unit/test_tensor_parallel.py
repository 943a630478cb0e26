"""Tensor parallelism on cpu_reference with simulated ranks (docs/parallel.md).

The sharding plan is checked without processes (shapes, the all-reduce points, shards that
reassemble the weights); then R = 2 and R = 3 rank processes run the tiny model against the
unsharded run (the tolerance of docs/parallel.md), run to run and across batch sizes
(bitwise), and a killed or stopped rank ends the request with a RankError and leaves no
process behind.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

import core
from core.cli import main as cli_main
from core.models.model import ModelError, load_model
from core.parallel import RankError, TensorParallelSession, plan_shards
from core.parallel.comm import HostCommunicator
from core.session import RequestError, Session
from core.testing.tiny_model import TinyConfig, make_tiny_model, write_byte_tokenizer

#: fp32 tolerance of a sharded run against the unsharded one, relative to the largest |logit|
#: (docs/parallel.md): partial sums over ranks round differently, nothing else changes.
RTOL_FP32 = 1e-5
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [3, 4, 200, 17]]
STEPS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The default tiny model: 4 query heads, 2 KV heads (R = 2 divides it, R = 3 does not)."""
    return make_tiny_model(tmp_path_factory.mktemp("tp2"))


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    """A tiny model with 6 query heads and 3 KV heads, for R = 3 (the MLP and vocab split unevenly)."""
    return make_tiny_model(tmp_path_factory.mktemp("tp3"), config=TinyConfig(heads=6, kv_heads=3), seed=3)


def decode(session, prompts, steps=STEPS, force=None):
    """Tokens [steps + 1, B] and fp32 logits [steps + 1, B, V]; ``force``: tokens fed at each
    step (teacher forcing) instead of the session's own choices."""
    out = session.prefill(prompts)
    tokens, logits = [out.tokens.copy()], [session.last_logits()]
    for i in range(steps):
        out = session.step(force_tokens=None if force is None else force[i])
        tokens.append(out.tokens.copy())
        logits.append(session.last_logits())
    return np.array(tokens), np.array(logits)


def _tp_pids() -> list[int]:
    return sorted(p.pid for p in multiprocessing.active_children() if p.name.startswith("lockstep-tp-rank"))


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"  # a zombie would be a rank nobody joined
    except FileNotFoundError:
        return True


# -- the plan, no processes ------------------------------------------------------------------------
def test_shards_reassemble_the_weights_and_mark_the_all_reduce_points(tiny):
    model = load_model(tiny)
    plan = plan_shards(model, 2)
    shards = [plan.shard(model, r) for r in range(2)]
    assert [s.config.num_kv_heads for s in shards] == [1, 1] and [s.config.num_heads for s in shards] == [2, 2]
    for s in shards:
        reduces = [n for n in s.graph.node if (n.domain, n.op_type) == ("lockstep", "AllReduce")]
        assert len(reduces) == plan.all_reduces_per_run() == 1 + 2 * model.config.num_layers
        gqa = [n for n in s.graph.node if n.op_type == "GroupQueryAttention"]
        assert {(a.name, a.i) for n in gqa for a in n.attribute if a.name.endswith("num_heads")} == {
            ("num_heads", 2), ("kv_num_heads", 1)}
    w = model.initializers
    hd = model.config.head_size
    # lm_head (tied with the embedding) by vocab, gate/up by columns, o_proj/down by rows
    lm = "lm_head.MatMul.weight"
    assert np.array_equal(np.concatenate([s.initializers[lm] for s in shards], axis=1), w[lm])
    for name, axis in (("model.layers.0.mlp.gate_proj.MatMul.weight", 1),
                       ("model.layers.1.mlp.down_proj.MatMul.weight", 0),
                       ("model.layers.0.attn.o_proj.MatMul.weight", 0)):
        assert np.array_equal(np.concatenate([s.initializers[name] for s in shards], axis=axis), w[name])
    qkv = "model.layers.1.attn.qkv_proj.MatMul.weight"
    q, k, v = np.split(w[qkv], [4 * hd, 6 * hd], axis=1)
    for r, s in enumerate(shards):  # rank r: query heads 2r, 2r+1 and KV head r, in q|k|v order
        expect = np.concatenate([q[:, 2 * r * hd:(2 * r + 2) * hd], k[:, r * hd:(r + 1) * hd],
                                 v[:, r * hd:(r + 1) * hd]], axis=1)
        assert np.array_equal(s.initializers[qkv], expect)
    assert [plan.vocab_range(r) for r in range(2)] == [(0, 128), (128, 256)]
    assert [plan_shards(model, 1).vocab_range(0)] == [(0, 256)]


def test_kv_heads_not_divisible_is_a_model_error_before_any_process(tiny):
    with pytest.raises(ModelError, match="2 KV heads, which 3 ranks cannot share evenly"):
        plan_shards(load_model(tiny), 3)
    before = _tp_pids()
    with pytest.raises(ModelError, match="cannot share evenly"):
        Session(tiny, batch=1, tensor_parallel=3)
    assert _tp_pids() == before
    with pytest.raises(RequestError, match="tensor_parallel must be a positive integer"):
        Session(tiny, batch=1, tensor_parallel=0)


def test_cli_refuses_an_indivisible_tensor_parallel(tiny, capsys):
    write_byte_tokenizer(tiny)
    before = _tp_pids()
    assert cli_main(["run", "--model", str(tiny), "--raw", "--prompt", "Hi", "--tensor-parallel", "3"]) == 2
    assert "cannot share evenly" in capsys.readouterr().err
    assert _tp_pids() == before


def test_core_run_refuses_sampling_before_any_rank_starts(tiny):
    before = _tp_pids()
    with pytest.raises(RequestError, match="greedily only"):
        core.run(str(tiny), input_ids=PROMPTS, max_new_tokens=2, tensor_parallel=2, do_sample=True, seed=1)
    assert _tp_pids() == before


def test_host_all_reduce_sums_in_rank_order():
    """One process, R = 1: the communicator is the identity; the argmax keeps the lowest id."""
    comm = HostCommunicator(0, 1, {}, 1.0)
    x = np.array([1.5, -2.0], np.float32)
    assert np.array_equal(comm.all_reduce(x), x)
    out = comm.argmax(np.array([3.0, np.nan], np.float32), np.array([7, 2]), np.array([False, True]))
    assert out.tolist() == [[7, 0], [-1, 1]]


# -- simulated ranks -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp2(tiny):
    s = Session(tiny, batch=len(PROMPTS), capacity=64, prefill_groups="off", tensor_parallel=2)
    yield s
    s.close()


@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_logits_within_tolerance_of_the_unsharded_run(ranks, tiny, tiny3, tp2):
    folder = tiny if ranks == 2 else tiny3
    tp = tp2 if ranks == 2 else Session(folder, batch=len(PROMPTS), capacity=64, prefill_groups="off",
                                        tensor_parallel=3)
    try:
        assert isinstance(tp, TensorParallelSession) and len(tp.alive_ranks()) == ranks
        tokens, logits = decode(tp, PROMPTS)
        counters = tp.counters.to_dict()
    finally:
        if tp is not tp2:
            tp.close()
    ref = Session(folder, batch=len(PROMPTS), capacity=64, prefill_groups="off")
    # the reference is fed the sharded run's tokens, so both see the same history at every step
    ref_tokens, ref_logits = decode(ref, PROMPTS, force=tokens[:-1])
    scale = np.abs(ref_logits).max()
    err = np.abs(logits - ref_logits).max()
    assert err <= RTOL_FP32 * scale, f"R={ranks}: max |dlogit| {err:.3g} over scale {scale:.3g}"
    top2 = np.sort(ref_logits, axis=-1)[..., -2:]
    decisive = (top2[..., 1] - top2[..., 0]) > 4 * RTOL_FP32 * scale
    assert decisive.mean() > 0.9  # the tiny model's choices are clear; the check below means something
    assert np.array_equal(tokens[decisive], ref_logits.argmax(-1)[decisive])
    assert np.array_equal(tokens[decisive], ref_tokens[decisive])
    # the plan's all-reduce points ran: one embedding + 2 per layer, per graph run
    assert counters["tensor_parallel"] == ranks
    assert counters["all_reduces"] == (STEPS + 1) * (1 + 2 * 2)


def test_run_to_run_bitwise_and_the_session_reused(tiny, tp2):
    first = decode(tp2, PROMPTS)
    again = decode(tp2, PROMPTS)  # the same ranks, a second request
    fresh = Session(tiny, batch=len(PROMPTS), capacity=64, prefill_groups="off", tensor_parallel=2)
    try:
        other = decode(fresh, PROMPTS)  # new rank processes
    finally:
        fresh.close()
    for run in (again, other):
        assert np.array_equal(run[0], first[0])
        assert run[1].tobytes() == first[1].tobytes()


def test_batch_invariance_within_a_tp_run_is_bitwise(tiny, tp2):
    tokens, logits = decode(tp2, PROMPTS)
    single = Session(tiny, batch=1, capacity=64, tensor_parallel=2)
    try:
        for b, prompt in enumerate(PROMPTS):
            t1, l1 = decode(single, [prompt])
            assert np.array_equal(t1[:, 0], tokens[:, b])
            assert l1[:, 0].tobytes() == logits[:, b].tobytes(), f"row {b}"
    finally:
        single.close()


def test_sampling_is_refused_and_the_session_stays_usable(tp2):
    with pytest.raises(RequestError, match="greedily only"):
        tp2.prefill(PROMPTS, sampling={"do_sample": True, "temperature": 0.7})
    with pytest.raises(RequestError, match="batch 3"):
        tp2.prefill(PROMPTS[:2])
    assert decode(tp2, PROMPTS, steps=1)[0].shape == (2, 3)
    with pytest.raises(RequestError, match="prompt logits"):
        tp2.prompt_logits()


def test_cli_tensor_parallel_runs_core_run_sharded_and_stops_its_ranks(tiny, tp2, capsys):
    write_byte_tokenizer(tiny)
    before = _tp_pids()  # tp2's ranks
    prompts = ["Hello", "Name a color."]
    args = ["run", "--model", str(tiny), "--raw", "--max-new-tokens", "6", "--json"]
    assert cli_main(args + [x for p in prompts for x in ("--prompt", p)] + ["--tensor-parallel", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = core.run(str(tiny), prompts=prompts, max_new_tokens=6, chat=False)
    assert [r["output_ids"] for r in out["rows"]] == [r.output_ids for r in ref.rows]
    c = out["counters"]
    assert c["tensor_parallel"] == 2 and c["all_reduces"] == (c["prefill_runs"] + c["decode_steps"]) * 5
    assert _tp_pids() == before  # core.run stopped the ranks it started


@pytest.mark.parametrize("how", ["killed", "exited", "stopped"])
def test_a_dead_or_hung_rank_ends_the_request_and_leaves_nothing(how, tiny, monkeypatch):
    """``killed``: the step races the kill; ``exited``: the rank has exited before the step, so
    the coordinator's send meets a closed pipe; both name the rank as died. ``stopped``: a
    silent rank is named by its peer's receive timeout."""
    monkeypatch.setenv("LOCKSTEP_RANK_TIMEOUT", "2")
    tp = Session(tiny, batch=2, capacity=64, tensor_parallel=2)
    pids = tp.rank_pids
    tp.prefill(PROMPTS[:2])
    os.kill(pids[1], signal.SIGSTOP if how == "stopped" else signal.SIGKILL)
    if how == "exited":
        deadline = time.monotonic() + 10
        while not _gone(pids[1]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _gone(pids[1])
    expect = "rank 1 sent nothing for 2 s" if how == "stopped" else r"rank 1 died \(exit code -9\)"
    with pytest.raises(RankError, match=expect):
        tp.step()
    assert tp.alive_ranks() == [] and all(_gone(p) for p in pids)
    assert not set(pids) & set(_tp_pids())
    with pytest.raises(RequestError, match="closed"):
        tp.step()


def test_int4_shards_keep_whole_blocks(tmp_path):
    """MatMulNBits: column shards cut N (codes and scales by output row), row shards cut K in
    whole quantization blocks; the GatherBlockQuantized table is cut with the tied lm_head."""
    model = load_model(make_tiny_model(tmp_path, quant="int4", config=TinyConfig(heads=6, kv_heads=3)))
    plan = plan_shards(model, 3)
    shards = [plan.shard(model, r) for r in range(3)]
    w = model.initializers
    down = "model.layers.0.mlp.down_proj.MatMul.weight_Q4"  # K = 128: 4 blocks of 32 over 3 ranks
    assert [s.initializers[down].shape[1] for s in shards] == [2, 1, 1]
    assert np.array_equal(np.concatenate([s.initializers[down] for s in shards], axis=1), w[down])
    gate = "model.layers.1.mlp.gate_proj.MatMul.weight_Q4"
    assert [s.initializers[gate].shape[0] for s in shards] == [64, 32, 32]  # the same ranges as down's K
    head = "lm_head.MatMul.weight_Q4"
    assert np.array_equal(np.concatenate([s.initializers[head] for s in shards], axis=0), w[head])
    for s in shards:
        ks = {a.i for n in s.graph.node if n.name == "/model/layers.0/mlp/down_proj/MatMul_Q4"
              for a in n.attribute if a.name == "K"}
        assert ks == {s.initializers[down].shape[1] * 32}

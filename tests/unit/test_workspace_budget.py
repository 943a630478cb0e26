"""The decode workspace under a device budget on cpu_reference (core.runtime.workspace): the
activation buffers, the provider's scratch and the decode state's own buffers are planned
before a state allocates them and reserved beside the KV cache, so the weights get what is
left; the refusal names the smallest working device budget with the workspace in it; that
budget decodes bitwise the resident run and one byte less is refused."""

import numpy as np
import pytest

from core.generation.loop import decode
from core.runtime import residency
from core.runtime.residency import BudgetError
from core.runtime.runner import Runner
from core.session import Session
from core.testing.tiny_model import TinyConfig, make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider

ROWS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3], [4, 4, 4, 4], [7, 8], [9], [1, 2, 3]]


@pytest.fixture(autouse=True)
def small_tensors_stream(monkeypatch):
    monkeypatch.setattr(residency, "SMALL_BYTES", 512)


@pytest.fixture(scope="module", params=[None, "int4"])
def model_dir(request, tmp_path_factory):
    config = TinyConfig(layers=4, vocab=256, context=128, tied=False)
    return make_tiny_model(tmp_path_factory.mktemp("work"), quant=request.param, config=config, external=True)


def _weights(model_dir) -> int:
    return sum(w.nbytes for w in residency.weights_of(Runner(model_dir, CpuReferenceProvider()).plan))


@pytest.mark.parametrize("batch", [1, 8])
def test_the_planned_workspace_covers_what_a_decode_state_allocates(model_dir, batch):
    free = Runner(model_dir, CpuReferenceProvider())
    Session(free, batch=batch, capacity=64).close()
    # half the weights beside this state's KV and workspace: the weights stream
    budget = _weights(model_dir) // 2 + free.kv_device_bytes + free.workspace_reserved
    runner = Runner(model_dir, CpuReferenceProvider(), device_budget=budget)
    s = Session(runner, batch=batch, capacity=64)
    decode(s, ROWS[:batch], 8)
    held = runner.memory(s.state)
    # a decode step's workspace, and a prefill's of every row's prompt at the capacity
    assert runner.workspace_reserved == runner.workspace_estimate(batch, max(64, s.max_capacity), (batch, 64)) > 0
    assert held.workspace <= runner.workspace_reserved and runner.residency.streams
    # what the runner holds, the workspace measured, is within the device budget
    assert held.total <= runner.device_budget
    assert runner.weight_bytes + runner.residency.staging_bytes + runner.kv_device_bytes \
        + runner.workspace_reserved <= runner.device_budget


def test_the_refusal_names_the_smallest_budget_with_the_workspace_and_it_decodes_bitwise(model_dir):
    batch, capacity = 8, 64
    want = decode(Session(Runner(model_dir, CpuReferenceProvider()), batch=batch, capacity=capacity),
                  ROWS, 8).tokens
    runner = Runner(model_dir, CpuReferenceProvider(), device_budget=_weights(model_dir) // 4)
    # a session's mask is as wide as its max_capacity (the context); its prompts at most the capacity
    work = runner.workspace_estimate(batch, 128, (batch, capacity))
    with pytest.raises(BudgetError, match=f"a workspace of {work:,} bytes") as info:
        Session(runner, batch=batch, capacity=capacity)
    smallest = int(str(info.value).split("device budget for this KV cache is ")[1].split()[0].replace(",", ""))
    assert runner.kv_device_bytes == 0 and runner.workspace_reserved == 0  # the refusal kept nothing
    kv = int(str(info.value).split("a KV cache of ")[1].split()[0].replace(",", ""))
    assert smallest == kv + work + runner._smallest_weight_budget()
    fits = Runner(model_dir, CpuReferenceProvider(), device_budget=smallest)
    s = Session(fits, batch=batch, capacity=capacity)
    got = decode(s, ROWS, 8).tokens
    assert np.array_equal(got, want) and fits.residency.streams
    assert fits.memory(s.state).total <= smallest
    with pytest.raises(BudgetError, match=f"a workspace of {work:,} bytes"):
        Session(Runner(model_dir, CpuReferenceProvider(), device_budget=smallest - 1), batch=batch,
                capacity=capacity)


def test_plan_shows_the_workspace_and_leaves_the_weights_the_rest(model_dir, capsys):
    from core import cli
    from core.plan import plan_model

    runner = Runner(model_dir, CpuReferenceProvider())
    device = _weights(model_dir) + 4 * 2**20
    rows = plan_model(model_dir, [1, 8], 64, CpuReferenceProvider(), device_budget=device)
    for p in rows:
        # a decode step's and, on top, a prefill's of every row's prompt at the context
        assert p.workspace_bytes == runner.workspace_estimate(p.batch, 64, (p.batch, 64)) \
            > runner.workspace_estimate(p.batch, 64) > 0
        assert p.residency is not None and p.residency.budget == device - p.kv_bytes - p.workspace_bytes
        assert p.row()["workspace_bytes"] == p.workspace_bytes
    assert cli.main(["plan", str(model_dir), "--provider", "cpu_reference", "--device-budget", str(device),
                     "--batch", "1,8", "--context", "64"]) == 0
    assert "workspace MiB" in capsys.readouterr().out


def test_cuda_declares_its_scratch_beside_the_activations(tmp_path):
    """cuda's declared workspace (no GPU needed: shapes only) is the activations plus the split-K
    workspace, one split-KV workspace per attention shape and the argmax partials."""
    from core.models.model import load_model
    from core.plan import header_of
    from core.runtime import workspace
    from providers.cuda.ops import _mma_schedule
    from providers.cuda.provider import CudaProvider

    config = TinyConfig(layers=2, vocab=256, context=512)
    model = load_model(make_tiny_model(tmp_path / "m", config=config))
    h = header_of(model, CpuReferenceProvider())
    batch, capacity = 8, 512
    shape_of = workspace.decode_shapes(model.graph, h.nodes, h.steps, h.constants, batch, capacity)
    base = CpuReferenceProvider().planned_workspace_bytes(h.nodes, h.steps, shape_of, batch, capacity)
    cuda = object.__new__(CudaProvider).planned_workspace_bytes(h.nodes, h.steps, shape_of, batch, capacity)
    chunks = capacity // 64 + 1  # a ring's chunk count, the larger of the two
    gqa = batch * (config.heads * chunks * (config.head_size + 2) * 4 + config.kv_heads * 4)
    split = _mma_schedule.SPLIT_BYTES + 4 * _mma_schedule.SPLIT_TICKETS
    assert cuda == base + split + gqa + batch * 1 * 12


def test_cuda_declares_a_windowed_layers_prompt_staging_at_a_prefill_only():
    """cuda's prompt on a sliding-window layer runs on a staging cache of its S positions (K and
    V, ``[B, Nkv, S, H]``): declared at a prefill's shapes, the largest layer's (the prefill frees
    each node's buffers after their last reader), and not at a decode step's."""
    from core.ops import Spec
    from core.protocol import NodeInfo
    from core.runtime import workspace
    from providers.cuda.ops.group_query_attention import prompt_staging_bytes
    from providers.cuda.provider import CudaProvider

    def gqa(name, window):
        return NodeInfo(name, "GroupQueryAttention", "com.microsoft",
                        {"num_heads": 4, "kv_num_heads": 2, "local_window_size": window},
                        (f"{name}/q", "", ""), (f"{name}/out", "", ""))

    nodes, steps = [gqa("full", -1), gqa("ring", 32), gqa("ring2", 32)], [0, 1, 2]
    cuda = object.__new__(CudaProvider)
    batch, capacity, h = 2, 128, 16

    def scratch(s):
        specs = {f"{n.name}/out": Spec((batch, s, 4 * h), np.float16) for n in nodes}
        return (cuda.planned_workspace_bytes(nodes, steps, specs.get, batch, capacity)
                - workspace.activation_bytes(nodes, steps, specs.get))

    assert scratch(40) - scratch(1) == 2 * batch * 2 * 40 * h * 2  # one layer's K and V, fp16
    assert prompt_staging_bytes(nodes[:1], [0], {"full/out": Spec((batch, 40, 4 * h), np.float16)}.get) == 0

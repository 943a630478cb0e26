"""The Runner / DecodeState split: weights uploaded once per runner, states and graphs reused
per batch, the KV cache's growth accounting, and the decode loop helper."""

import numpy as np
import pytest

from core.generation.loop import decode
from core.runtime.runner import Runner
from core.session import RequestError, Session
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider

ROWS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_a_second_session_on_a_runner_uploads_no_weight(model_dir):
    prov = CpuReferenceProvider()
    runner = Runner(model_dir, prov)
    assert runner.weight_upload_bytes >= runner.model.weight_bytes() > 0
    before = prov.uploaded_bytes
    a = Session(runner, batch=3, capacity=32)
    b = Session(runner, batch=2, capacity=32)
    assert prov.uploaded_bytes == before, "creating a session uploaded bytes"
    decode(a, ROWS, 4)
    decode(b, ROWS[:2], 4)
    # a request uploads its ids and masks, nothing of weight size
    assert prov.uploaded_bytes - before < runner.model.weight_bytes() / 100


def test_sessions_on_one_runner_give_the_tokens_of_separate_sessions(model_dir):
    runner = Runner(model_dir, CpuReferenceProvider())
    shared = [decode(Session(runner, batch=3, capacity=32), ROWS, 6).tokens for _ in range(3)]
    alone = decode(Session(model_dir, batch=3, capacity=32), ROWS, 6).tokens
    assert all(np.array_equal(t, alone) for t in shared)


def test_a_closed_session_returns_its_state_to_the_pool(model_dir):
    runner = Runner(model_dir, CpuReferenceProvider())
    first = Session(runner, batch=3, capacity=32)
    state = first.state
    live = Session(runner, batch=3, capacity=32)
    assert live.state is not state, "a live session's state was handed out twice"
    first.close()
    with pytest.raises(RequestError, match="closed"):
        first.prefill(ROWS)
    assert Session(runner, batch=3, capacity=32).state is state


def test_growth_counts_exactly_the_live_bytes_it_copies(model_dir):
    s = Session(model_dir, batch=3, capacity=8, kv_policy="growing", max_capacity=64)
    trace = decode(s, ROWS, 20)
    cfg = s.model.config
    itemsize = s.model.io_dtype.itemsize
    c = s.counters
    assert c.growth_events >= 2 and trace.steps == 20
    # every growth copies each row's live prefix of every (layer, K/V, kv head), nothing more
    lengths_at_growth = []
    lens = np.array([len(r) for r in ROWS])
    cap = 8
    for _ in range(20):
        need = int(lens.max()) + 1
        if need > cap:
            lengths_at_growth.append(lens.copy())
            cap = max(need, 2 * cap)
            cap = -(-cap // 16) * 16
        lens = lens + 1
    expected = sum(int(n.sum()) for n in lengths_at_growth) * cfg.num_kv_heads * cfg.head_size * itemsize
    assert c.kv_bytes_moved == 2 * cfg.num_layers * expected


def test_the_decode_loop_feeds_forced_tokens_and_stops_when_asked(model_dir):
    s = Session(model_dir, batch=1, capacity=32)
    seen = []
    trace = decode(s, [ROWS[0]], 10, force=[[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]],
                   observer=lambda t, out, _: seen.append(t) or t == 4)
    assert seen == [0, 1, 2, 3, 4] and trace.steps == 4 and s.lengths.tolist() == [7]
    with pytest.raises(RequestError, match="force needs"):
        decode(s, [ROWS[0]], 3, force=[[1]])


def test_a_runner_refuses_a_layout_it_was_not_planned_for(model_dir):
    runner = Runner(model_dir, CpuReferenceProvider())
    with pytest.raises(RequestError, match="planned for KV layout"):
        Session(runner, batch=1, kv_layout="seq_major")


def test_a_parity_run_makes_one_runner_per_provider_and_uploads_the_weights_once(model_dir, monkeypatch):
    """The parity kit plans the model once per provider (the seq_major gate reuses the same
    weights through Runner.with_layout), so each provider uploads the weights once."""
    from core.runtime import runner as runner_module
    from core.testing.parity import run_parity

    made = []
    real_init = runner_module.Runner.__init__

    def counting_init(self, *args, **kw):
        real_init(self, *args, **kw)
        made.append(self)

    monkeypatch.setattr(runner_module.Runner, "__init__", counting_init)
    prov, ref = CpuReferenceProvider(), CpuReferenceProvider()
    weights = Runner(model_dir, CpuReferenceProvider()).weight_upload_bytes
    made.clear()
    report = run_parity(model_dir, prov, batches=(1, 2), steps=3, reference=ref)
    assert report.passed, report.render()
    assert [r.provider for r in made].count(prov) == 1 and [r.provider for r in made].count(ref) == 1
    assert report.gate("layout").status == "pass"
    # every byte uploaded beyond the weights is request data (ids, masks): a small fraction
    assert weights <= prov.uploaded_bytes < weights * 1.05
    assert weights <= ref.uploaded_bytes < weights * 1.05

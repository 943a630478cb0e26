"""Activation memory of a prefill (core.executor "Activation memory"): a transient run frees each
node's buffers after their last reader, so its peak is the live activations, not one buffer per
node; the results are the same bits, decode steps keep their buffers, and a run that raised
keeps nothing either. Peaks are NumPy's allocations under tracemalloc (cpu_reference)."""

import tracemalloc

import numpy as np
import pytest

from core.executor import Plan
from core.generation.loop import decode
from core.protocol import KernelContext, NodeInfo
from core.runtime.runner import Runner
from core.session import Session
from core.testing.tiny_model import TinyConfig, make_tiny_model
from core.testing.transient import force_prefill_transient
from providers.cpu_reference.provider import CpuReferenceProvider

# eight layers, so a run that keeps one buffer per node holds several times its live set
CONFIG = TinyConfig(layers=8, hidden=128, intermediate=512, heads=4, kv_heads=2, head_size=32, context=256)
ROWS = [list(range(3, 3 + n)) for n in (200, 160, 180, 120)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("act"), config=CONFIG)


def _prefill_peak(model_dir, monkeypatch, transient):
    """(peak NumPy bytes over one prefill, the prompt logits, the decoded tokens, activation
    bytes held after the prefill) with Plan.run's ``transient`` forced."""
    real = Plan.run
    seen = force_prefill_transient(monkeypatch, transient)  # decode steps as by default (never)
    runner = Runner(model_dir, CpuReferenceProvider())
    session = Session(runner, batch=len(ROWS), capacity=256)
    session.prefill([ROWS[0][:4]] * len(ROWS))  # every program planned once, outside the measurement
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        session.prefill(ROWS)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    held = runner.plan.activation_bytes(), runner.plan.transient_peak_bytes
    logits = session.last_logits().copy()
    tokens = decode(Session(runner, batch=len(ROWS), capacity=256), ROWS, 4).tokens
    monkeypatch.setattr(Plan, "run", real)
    assert seen and all(t is transient for t in seen)
    return peak, logits, tokens, held


def test_a_transient_prefill_peaks_at_its_live_set_with_the_same_bits(model_dir, monkeypatch):
    kept_peak, kept_logits, kept_tokens, kept_held = _prefill_peak(model_dir, monkeypatch, False)
    freed_peak, freed_logits, freed_tokens, freed_held = _prefill_peak(model_dir, monkeypatch, True)
    assert np.array_equal(freed_logits, kept_logits)
    assert np.array_equal(freed_tokens, kept_tokens)
    # one [B * S, hidden] fp32 activation: the unit of both peaks
    unit = sum(len(r) for r in ROWS) * CONFIG.hidden * 4
    assert kept_peak > 8 * CONFIG.layers * unit / 2, (kept_peak, unit)  # sanity: it holds every layer's buffers
    assert freed_peak < kept_peak / 3, (freed_peak, kept_peak)
    assert freed_held[0] < kept_held[0] / 4, (freed_held, kept_held)
    # the executor's own count of the live node buffers: at least the widest activation, at most
    # what NumPy held over the run (which adds the kernels' temporaries)
    assert 4 * unit <= freed_held[1] <= freed_peak, (freed_held, freed_peak, unit)


def test_the_default_frees_prefill_buffers_and_keeps_decode_step_buffers(model_dir):
    runner = Runner(model_dir, CpuReferenceProvider())
    session = Session(runner, batch=2, capacity=256)
    session.prefill([[5, 6, 7], [8, 9]])
    session.step()
    after_step = runner.plan.activation_bytes()
    assert after_step > 0
    step_buffers = {id(b) for c in runner.plan.contexts for b in c._buffers.values()}
    session.step()  # a decode step reuses every buffer: no allocation
    assert {id(b) for c in runner.plan.contexts for b in c._buffers.values()} == step_buffers
    # one-token prompts: the prefill's last-position logits have the decode step's shape and take
    # its buffer, which the prefill must leave in place (the decode state reads it)
    session.prefill([[5], [6]])
    session.step()
    assert step_buffers <= {id(b) for c in runner.plan.contexts for b in c._buffers.values()}
    fresh = Session(Runner(model_dir, CpuReferenceProvider()), batch=2, capacity=256)
    fresh.prefill([[5], [6]])
    fresh.step()
    assert np.array_equal(session.last_logits(), fresh.last_logits())
    long = Session(runner, batch=2, capacity=256)
    long.prefill([list(range(3, 203)), list(range(3, 103))])  # a prefill frees all of its own
    assert runner.plan.activation_bytes() <= after_step


def test_a_transient_run_that_raises_keeps_no_buffer(model_dir):
    runner = Runner(model_dir, CpuReferenceProvider())
    plan = runner.plan
    session = Session(runner, batch=1, capacity=256)
    session.prefill([[5, 6, 7]])
    before = plan.activation_bytes()
    victim = next(i for i in plan.steps if plan.nodes[i].op_type == "GroupQueryAttention")
    real = plan.kernels[victim]

    def broken(ctx, *args):
        raise RuntimeError("kernel failed")

    plan.kernels[victim] = broken
    plan.reset_dispatch()
    with pytest.raises(RuntimeError, match="kernel failed"):
        Session(runner, batch=1, capacity=256).prefill([list(range(3, 120))])
    assert plan.activation_bytes() <= before
    assert not any(c.transient for c in plan.contexts)
    plan.kernels[victim] = real
    plan.reset_dispatch()
    again = Session(runner, batch=1, capacity=256)
    assert again.prefill([[5, 6, 7]]).tokens is not None  # the runner still serves


def _ctx():
    node = NodeInfo(name="n", op_type="Add", domain="", inputs=("a", "b"), outputs=("y",), attrs={},
                    input_dtypes=(np.dtype(np.float32),) * 2)
    return KernelContext(node, CpuReferenceProvider(), "head_major")


@pytest.mark.parametrize("captured", [True, False])
def test_release_transient_drops_only_what_the_run_allocated(captured):
    ctx = _ctx()
    decode_buf = ctx.output(0, (2, 8), np.float32)  # a decode step's buffer (eager or captured)
    if captured:
        ctx.frozen = True
        assert ctx.output(0, (2, 8), np.float32) is decode_buf
        ctx.frozen = False
    scratch = ctx.output("work", (4,), np.float32)  # a decode-only scratch slot
    ctx.transient = True
    prefill = ctx.output(0, (2, 64, 8), np.float32)
    same_shape = ctx.output(0, (2, 8), np.float32)  # a one-token prompt: the decode step's buffer
    assert same_shape is decode_buf
    ctx.transient = False
    assert ctx.release_transient() == prefill.nbytes
    assert ctx.output(0, (2, 8), np.float32) is decode_buf  # existed before the run: kept
    assert ctx.output("work", (4,), np.float32) is scratch  # not this run's: kept
    assert ctx.output(0, (2, 64, 8), np.float32) is not prefill  # dropped: allocated again
    assert ctx.release_transient() == 0  # nothing noted outside a transient run


def test_the_live_set_does_not_grow_with_the_layers(tmp_path):
    """Every layer's buffers die within it, attention's output too (its node also writes the
    present KV graph outputs, which the run returns): 8 layers peak as 2 do."""
    peaks = []
    for layers in (2, 8):
        cfg = TinyConfig(layers=layers, hidden=128, intermediate=512, heads=4, kv_heads=2, head_size=32,
                         context=256)
        runner = Runner(make_tiny_model(tmp_path / str(layers), config=cfg), CpuReferenceProvider())
        Session(runner, batch=4, capacity=256).prefill([list(range(3, 203))] * 4)
        peaks.append(runner.plan.transient_peak_bytes)
    unit = 4 * 200 * 128 * 4  # one [B * S, hidden] fp32 activation
    assert 4 * unit <= peaks[1] <= peaks[0], peaks


def test_a_frozen_plan_never_runs_transient(model_dir, monkeypatch):
    """While capturing (the plan frozen) a run asked to be transient keeps its buffers: the
    graph being recorded holds their pointers."""
    runner = Runner(model_dir, CpuReferenceProvider())
    force_prefill_transient(monkeypatch, False)
    Session(runner, batch=1, capacity=256).prefill([[5, 6, 7]])  # every buffer of this shape kept
    monkeypatch.undo()  # prefills transient by default again
    plan = runner.plan
    kept = {id(b) for c in plan.contexts for b in c._buffers.values()}
    plan.set_frozen(True)
    seen = []
    real = KernelContext.release_transient

    def spy(ctx):
        seen.append(ctx.transient)
        return real(ctx)

    monkeypatch.setattr(KernelContext, "release_transient", spy)
    try:
        Session(runner, batch=1, capacity=256).prefill([[8, 9, 10]])  # same shapes: no allocation
    finally:
        plan.set_frozen(False)
    assert not seen  # no release at all: the run was not transient
    assert kept <= {id(b) for c in plan.contexts for b in c._buffers.values()}

"""Nothing lost under faults (issue 39), on the tiny model and cpu_reference: a fault injected
at a kernel, an allocation, a copy, a write or a download during KV growth, prefill, a decode
step or a stream leaves the session and the Runner serving the next request bitwise as a
fresh run does; the KV accounting equals what is held."""

from __future__ import annotations

import numpy as np
import pytest

from core.runtime.residency import BudgetError
from core.runtime.runner import Runner
from core.session import RequestError, Session
from core.testing.faults import FaultyProvider, InjectedFault
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider

PROMPTS = [[5, 6, 7], [8, 9]]
ERRORS = [InjectedFault, MemoryError, KeyboardInterrupt, BudgetError("injected: the device budget is spent")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def clean(model_dir):
    """A Runner no fault ever touches: the reference runs."""
    return Runner(model_dir, CpuReferenceProvider())


@pytest.fixture
def faulty(model_dir):
    prov = FaultyProvider(CpuReferenceProvider())
    return prov, Runner(model_dir, prov)


def trace(session: Session, prompts, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``[steps + 1, B]`` and the last logits of a prefill and ``steps`` decode steps."""
    toks = [session.prefill(prompts).tokens]
    toks += [session.step().tokens for _ in range(steps)]
    return np.array(toks), session.last_logits()


def reference(clean: Runner, prompts=PROMPTS, steps: int = 24, **kw) -> tuple[np.ndarray, np.ndarray]:
    return trace(Session(clean, batch=len(prompts), **kw), prompts, steps)


def assert_same(got: tuple, want: tuple) -> None:
    assert np.array_equal(got[0], want[0])
    assert np.array_equal(got[1], want[1])  # bitwise


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: getattr(e, "__name__", type(e).__name__))
@pytest.mark.parametrize("site", ["copy", "allocate"])
def test_a_fault_during_kv_growth_changes_nothing(faulty, clean, site, error):
    prov, runner = faulty
    kw = dict(capacity=16, kv_policy="growing", max_capacity=64, capture=False, run_ahead=False)
    want = reference(clean, **kw)
    s = Session(runner, batch=2, **kw)
    toks = [s.prefill(PROMPTS).tokens]
    while s.lengths.max() < 16:  # fill the first bucket: the next step grows
        toks.append(s.step().tokens)
    held = runner.kv_device_bytes
    assert held == s.state.kv.device_bytes > 0
    prov.arm(site, error=error)
    with pytest.raises(type(error) if isinstance(error, BaseException) else error):
        s.step()
    assert prov.fired == 1
    assert s.capacity == 16 and runner.kv_device_bytes == held  # as before the step
    assert s.counters.growth_events == 0
    while len(toks) < 25:  # the same step again: it grows now, and the run goes on bitwise
        toks.append(s.step().tokens)
    assert s.counters.growth_events >= 1 and prov.calls["copy"] > 0
    assert_same((np.array(toks), s.last_logits()), want)
    s.close()  # the state goes back to the pool: the next session of the shape reuses it, right
    assert_same(trace(Session(runner, batch=2, **kw), PROMPTS, 24), want)


@pytest.mark.parametrize("error", [InjectedFault, KeyboardInterrupt])
def test_a_fault_in_a_prefill_kernel_leaves_the_session_serving_the_next_request(faulty, clean, error):
    prov, runner = faulty
    s = Session(runner, batch=2, capacity=32, capture=False)
    prov.arm("kernel", match="GroupQueryAttention", after=1, error=error)  # the second layer's
    with pytest.raises(error):
        s.prefill(PROMPTS)
    assert prov.fired == 1 and not s.started
    with pytest.raises(RequestError, match="prefill"):
        s.step()  # the failed prefill left no request to step
    assert_same(trace(s, PROMPTS, 24), reference(clean, capacity=32))


@pytest.mark.parametrize("site,match", [("kernel", None), ("kernel", "GroupQueryAttention"), ("write", None),
                                        ("download", None), ("read", None)])
@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_fault_in_a_decode_step_can_be_retried_and_the_run_is_bitwise_unchanged(faulty, clean, site, match,
                                                                                 run_ahead):
    prov, runner = faulty
    want = reference(clean, capacity=40)
    s = Session(runner, batch=2, capacity=40, capture=False, run_ahead=run_ahead)
    toks = [s.prefill(PROMPTS).tokens]
    pending = [s.step_async() for _ in range(2 if run_ahead else 1)]
    toks.append(pending[0].result().tokens)
    # a write: the forced tokens (those the run feeds anyway); a kernel: the step's second
    forced = want[0][len(pending)] if site == "write" else None
    prov.arm(site, match=match, after=1 if site == "kernel" else 0)
    with pytest.raises(InjectedFault):
        if site == "read":  # the wait for the oldest unread step's copy fails
            (pending[-1].result() if run_ahead else s.step())
        else:
            s.step_async(forced) if run_ahead else s.step(forced)
    assert prov.fired == 1
    # the unread step queued before the fault is dropped with it; the session is at its last read step
    assert pending[-1].discarded or pending[-1].read
    assert s.lengths.tolist() == [len(p) + 1 for p in PROMPTS]
    while len(toks) < 25:
        toks.append(s.step().tokens)
    assert_same((np.array(toks), s.last_logits()), want)


def test_a_fault_while_streaming_ends_the_stream_and_the_next_one_is_right(faulty, clean):
    prov, runner = faulty
    want = Session(clean, batch=2, capacity=48).stream(PROMPTS, max_new_tokens=[20, 17]).run()
    s = Session(runner, batch=2, capacity=48, capture=False)
    it = iter(s.stream(PROMPTS, max_new_tokens=[20, 17]))
    for _ in range(6):
        next(it)
    prov.arm("kernel", match="MatMul")
    with pytest.raises(InjectedFault):
        list(it)
    assert prov.fired == 1
    got = s.stream(PROMPTS, max_new_tokens=[20, 17]).run()
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert_same(trace(s, PROMPTS, 24), reference(clean, capacity=48))


def test_a_failed_session_leaves_the_kv_accounting_as_it_was(faulty, clean):
    prov, runner = faulty
    kept = Session(runner, batch=2, capacity=32)
    held = runner.kv_device_bytes
    for after in range(3):  # the K buffer, a V buffer, then a step buffer fails
        prov.arm("allocate", after=after, error=MemoryError)
        with pytest.raises(MemoryError):
            Session(runner, batch=3, capacity=64)
        assert runner.kv_device_bytes == held == kept.state.kv.device_bytes
    assert prov.fired == 3
    assert runner.memory().kv == held
    assert_same(trace(Session(runner, batch=2, capacity=32), PROMPTS, 24), reference(clean, capacity=32))


def test_release_states_drops_the_last_sessions_outputs(faulty):
    _, runner = faulty
    s = Session(runner, batch=2, capacity=32)
    trace(s, PROMPTS, 2)
    s.close()
    assert runner.outputs_owner is s.state and runner.kv_device_bytes > 0
    runner.release_states()
    assert runner.outputs_owner is None  # nothing keeps the dropped state's KV alive
    assert runner.kv_device_bytes == 0 == runner.memory().kv


def test_a_state_whose_recovery_failed_is_never_pooled(faulty, clean):
    prov, runner = faulty
    s = Session(runner, batch=2, capacity=32, capture=False, run_ahead=False)
    s.prefill(PROMPTS)
    state = s.state
    real_write = prov.write

    def failing_write(tensor, array):  # the step fails, then so does every write of its recovery
        raise InjectedFault("device lost")

    prov.write = failing_write
    with pytest.raises(InjectedFault):
        s.step(force_tokens=[1, 2])
    prov.write = real_write
    assert state.broken
    with pytest.raises(RequestError, match="unusable"):
        s.step()
    s.close()
    assert state not in runner._free and runner.kv_device_bytes == 0
    assert_same(trace(Session(runner, batch=2, capacity=32), PROMPTS, 24), reference(clean, capacity=32))

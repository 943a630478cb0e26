"""A prefill's temporaries under a device budget on cpu_reference (core.runtime.workspace): the
workspace a decode state reserves covers its largest prefill run (the prompt positions of every
row at once, not one decode position), so what the provider allocates while a long prompt runs
stays within the KV and workspace reserved; a budget that holds the decode workspace but not the
prefill's is refused before any work, naming the device budget to use, which then decodes
bitwise the resident run. Allocations are counted through the provider's allocate and upload
hooks, live until the array is collected."""

import weakref

import numpy as np
import pytest

from core.generation.loop import decode
from core.plan import header_of
from core.runtime import residency, workspace
from core.runtime.residency import BudgetError
from core.runtime.runner import Runner
from core.session import Session
from core.testing.tiny_model import TinyConfig, make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider

CONFIG = TinyConfig(layers=4, vocab=256, context=128, tied=False)
CAPACITY = 64
ROWS = [list(range(3, 3 + n)) for n in (56, 48, 50, 41)]


class CountingProvider(CpuReferenceProvider):
    """cpu_reference counting the bytes of the arrays it hands out while ``counting`` is set, live
    until collected, and their high-water mark (``reset()`` starts a new one at the live bytes)."""

    def __init__(self):
        super().__init__()
        self.counting, self.live, self.peak, self.arrays = False, 0, 0, 0

    def reset(self) -> None:
        self.peak = self.live

    def _note(self, array):
        if self.counting:
            self.arrays += 1
            self.live += array.nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(array, self._gone, array.nbytes)
        return array

    def _gone(self, nbytes: int) -> None:
        self.live -= nbytes

    def _allocate(self, shape, dtype, zero):
        return self._note(super()._allocate(shape, dtype, zero))

    def _upload(self, array):
        return self._note(np.array(array, copy=True))


@pytest.fixture(autouse=True)
def small_tensors_stream(monkeypatch):
    monkeypatch.setattr(residency, "SMALL_BYTES", 512)


@pytest.fixture(scope="module", params=[None, "int4"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("prefill-work"), quant=request.param, config=CONFIG, external=True)


def _weights(model_dir) -> int:
    return sum(w.nbytes for w in residency.weights_of(Runner(model_dir, CpuReferenceProvider()).plan))


def _decode_only(runner, batch: int, capacity: int) -> int:
    """The workspace a decode step alone allocates (the estimate before prefill was counted)."""
    h = header_of(runner.model, runner.provider)
    shape_of = workspace.decode_shapes(runner.model.graph, h.nodes, h.steps, h.constants, batch, capacity)
    return (runner.provider.planned_workspace_bytes(h.nodes, h.steps, shape_of, batch, capacity)
            + workspace.state_bytes(batch, capacity, runner.model.config.vocab_size, 4))


def test_what_a_prefill_allocates_is_within_the_kv_and_workspace_reserved(model_dir):
    provider = CountingProvider()
    runner = Runner(model_dir, provider)
    provider.counting = True  # from here on: the decode state's KV, buffers, activations and scratch
    s = Session(runner, batch=len(ROWS), capacity=CAPACITY)
    provider.reset()
    decode(s, ROWS, 4)
    reserved = runner.kv_device_bytes + runner.workspace_reserved
    assert provider.arrays > 0 and runner.plan.transient_peak_bytes > 0  # the prefill ran transient
    assert provider.peak <= reserved, (provider.peak, reserved)
    # the decode step's workspace alone is not enough: the prompt's positions are what need the room
    decode_only = runner.kv_device_bytes + _decode_only(runner, len(ROWS), s.max_capacity)
    assert provider.peak > decode_only, (provider.peak, decode_only)


def test_the_prefill_estimate_covers_the_prefill_run_alone(model_dir):
    provider = CountingProvider()
    runner = Runner(model_dir, provider)
    s = Session(runner, batch=len(ROWS), capacity=CAPACITY)
    decode(s, [[5]] * len(ROWS), 2)  # the decode state's buffers and a step's activations exist
    provider.counting = True
    provider.reset()
    s.prefill(ROWS)
    used = provider.peak  # above what lived before the prefill (the count started at 0)
    h = header_of(runner.model, runner.provider)
    planned = workspace.prefill_bytes(runner.model, h, runner.provider, len(ROWS), max(map(len, ROWS)),
                                      s.max_capacity)
    assert provider.arrays > 0 and 0 < used <= planned, (used, planned)


def test_a_budget_for_the_decode_workspace_alone_is_refused_before_work_with_the_one_to_use(model_dir):
    batch = len(ROWS)
    want = decode(Session(Runner(model_dir, CpuReferenceProvider()), batch=batch, capacity=CAPACITY),
                  ROWS, 6).tokens
    probe = Runner(model_dir, CpuReferenceProvider())
    context = probe.model.config.context_length  # a session's max_capacity: its mask's width
    floor = probe._smallest_weight_budget()
    work = probe.workspace_estimate(batch, context, (batch, CAPACITY))  # its prompts: at most the capacity
    decode_work = _decode_only(probe, batch, context)
    assert work > decode_work
    provider = CountingProvider()
    tight = Runner(model_dir, provider, device_budget=_weights(model_dir) // 4)
    before = provider.uploaded_bytes
    with pytest.raises(BudgetError, match=f"a workspace of {work:,} bytes") as info:
        Session(tight, batch=batch, capacity=CAPACITY)
    assert provider.uploaded_bytes == before and tight.plan.transient_peak_bytes == 0  # nothing ran
    assert tight.kv_device_bytes == 0 and tight.workspace_reserved == 0  # the refusal kept nothing
    smallest = int(str(info.value).split("device budget for this KV cache is ")[1].split()[0].replace(",", ""))
    kv = int(str(info.value).split("a KV cache of ")[1].split()[0].replace(",", ""))
    assert smallest == kv + work + floor
    # the budget a decode step's workspace alone would ask for is refused, naming the one to use
    with pytest.raises(BudgetError, match=f"is {smallest:,} bytes"):
        Session(Runner(model_dir, CpuReferenceProvider(), device_budget=kv + decode_work + floor),
                batch=batch, capacity=CAPACITY)
    counting = CountingProvider()
    fits = Runner(model_dir, counting, device_budget=smallest)
    counting.counting = True
    s = Session(fits, batch=batch, capacity=CAPACITY)
    got = decode(s, ROWS, 6).tokens
    assert np.array_equal(got, want) and fits.residency.streams
    assert counting.peak <= fits.kv_device_bytes + fits.workspace_reserved <= smallest


def test_a_prompt_past_a_growing_caches_first_capacity_reserves_its_prefill_before_it_runs(model_dir):
    """A growing cache opens at a small capacity; its prefill of longer prompts reserves that
    prefill's workspace first (the weights giving way), or is refused before it runs."""
    batch, first = len(ROWS), 16
    want = decode(Session(Runner(model_dir, CpuReferenceProvider()), batch=batch, capacity=CAPACITY),
                  ROWS, 4).tokens
    probe = Runner(model_dir, CpuReferenceProvider())
    s = Session(probe, batch=batch, capacity=first, kv_policy="growing")
    opened = probe.workspace_reserved
    longest = max(map(len, ROWS))
    work = probe.workspace_estimate(batch, s.max_capacity, (batch, longest))
    assert opened == probe.workspace_estimate(batch, s.max_capacity, (batch, first)) < work
    provider = CountingProvider()
    runner = Runner(model_dir, provider)
    provider.counting = True
    s = Session(runner, batch=batch, capacity=first, kv_policy="growing")
    provider.reset()
    got = decode(s, ROWS, 4).tokens
    assert np.array_equal(got, want) and runner.workspace_reserved == work
    assert provider.peak <= runner.kv_device_bytes + runner.workspace_reserved
    # a device budget that opens the state but cannot hold the prefill: refused before it runs
    kv = runner.kv_device_bytes
    floor = probe._smallest_weight_budget()
    tight = Runner(model_dir, CpuReferenceProvider(), device_budget=kv + opened + floor)
    s = Session(tight, batch=batch, capacity=first, kv_policy="growing")
    with pytest.raises(BudgetError, match=f"a workspace of {work:,} bytes"):
        s.prefill(ROWS)
    assert s.counters.prefill_runs == 0 and tight.plan.transient_peak_bytes == 0
    assert tight.workspace_reserved == opened  # the refusal kept nothing


@pytest.mark.parametrize("chunk", [8, None])
def test_the_engine_reserves_its_largest_prefill_runs_and_stays_within(model_dir, chunk):
    """The engine's slots reserve its largest chunk (one row) and batched runs (every slot, whole
    prompts of one chunk at most, within an iteration's positions): with chunks of 8 less than
    whole prompts at the capacity; what it allocates while serving long prompts stays within."""
    from core.engine import Engine

    slots, capacity, tokens = 4, 64, 16
    provider = CountingProvider()
    runner = Runner(model_dir, provider)
    provider.counting = True
    engine = Engine(runner, max_batch=slots, capacity=capacity, prefill_chunk=chunk, prefill_tokens=tokens)
    provider.reset()
    context = capacity  # the slots' masks are as wide as their capacity
    runs = [(1, capacity), (slots, tokens)] if chunk is None else [(1, chunk), (slots, chunk)]
    assert runner.workspace_reserved == max(runner.workspace_estimate(slots, context, r) for r in runs)
    if chunk is not None:
        assert runner.workspace_reserved < runner.workspace_estimate(slots, context, (slots, capacity))
    handles = [engine.submit(ids, max_tokens=4) for ids in [*ROWS, ROWS[0][:5], ROWS[1][:7]]]
    engine.run_until_idle()
    assert all(list(h)[-1].finish_reason == "length" for h in handles)
    assert engine.counters.prefill_tokens > 0 and (chunk is None or engine.counters.prefill_chunks > 0)
    assert provider.peak <= runner.kv_device_bytes + runner.workspace_reserved, (
        provider.peak, runner.kv_device_bytes, runner.workspace_reserved)
    engine.shutdown()


def test_a_prefill_that_keeps_every_positions_logits_reserves_what_it_keeps(model_dir):
    """``all_logits``: the prefill computes every position's logits and is not transient (it keeps
    every node's buffer at the prompt's shape), so it reserves more, and stays within that."""
    provider = CountingProvider()
    runner = Runner(model_dir, provider)
    provider.counting = True
    s = Session(runner, batch=len(ROWS), capacity=CAPACITY, all_logits=True)
    opened = runner.workspace_reserved
    provider.reset()
    s.prefill(ROWS)
    longest = max(map(len, ROWS))
    assert s.prompt_logits().shape[:2] == (len(ROWS), longest) and runner.plan.transient_peak_bytes == 0
    assert runner.workspace_reserved == runner.workspace_estimate(len(ROWS), s.max_capacity, (len(ROWS), longest),
                                                                  all_positions=True) > opened
    assert provider.peak <= runner.kv_device_bytes + runner.workspace_reserved, (
        provider.peak, runner.kv_device_bytes, runner.workspace_reserved)

"""Issue 39 on the cuda provider (GPU only): faults injected with core.testing.faults during
KV growth, prefill, decode and streaming leave the next request bitwise a fresh run's; 200
sequential requests keep host RSS and the device memory in use (the driver's figure) at
their post-warm-up baseline; threads sharing a Runner get their solo results."""

import gc
import threading

import numpy as np
import psutil
import pytest
from _gpu import require_gpu

cupy = require_gpu()

import core  # noqa: E402
from core.runtime.runner import Runner  # noqa: E402
from core.session import Session  # noqa: E402
from core.testing.faults import FaultyProvider, InjectedFault  # noqa: E402

PROMPTS = [[5, 6, 7], [8, 9]]
#: Device bytes in use (driver: total - free) allowed over 200 requests after the warm-up.
DEVICE_TOLERANCE = 16 << 20
#: Host RSS growth allowed over the same requests.
RSS_TOLERANCE = 16 << 20


def trace(session, prompts, steps):
    toks = [session.prefill(prompts).tokens]
    toks += [session.step().tokens for _ in range(steps)]
    return np.array(toks), session.last_logits()


@pytest.fixture(scope="module")
def clean(model_dir, gpu):
    return Runner(model_dir, gpu)


@pytest.fixture
def faulty(model_dir):
    from providers.cuda.provider import CudaProvider

    prov = FaultyProvider(CudaProvider())
    return prov, Runner(model_dir, prov)


def same(a, b):
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("site", ["copy", "allocate", "commit"])
def test_a_fault_during_kv_growth_changes_nothing(faulty, clean, site):
    prov, runner = faulty
    # with VMM the cache grows in place (kv_commit backs more pages of its reserved range);
    # without, growth allocates a larger cache and copies the old one into it
    if (site == "commit") != bool(prov.capabilities().vmm):
        pytest.skip(f"KV growth on this GPU does not pass the {site!r} site (vmm={prov.capabilities().vmm})")
    kw = dict(capacity=16, kv_policy="growing", max_capacity=64, capture=False, run_ahead=False)
    want = trace(Session(clean, batch=2, **kw), PROMPTS, 24)
    s = Session(runner, batch=2, **kw)
    if site == "commit":
        # pages are backed in whole VMM granules (2 MiB): a tiny model's growth from 16 to 64
        # positions stays inside the first granule, so the one commit is the prefill's; the
        # growth case is tests/unit/test_vmm_policy.py's, on a host arena of small pages
        held = runner.kv_device_bytes
        prov.arm("commit", error=MemoryError)
        with pytest.raises(MemoryError):
            s.prefill(PROMPTS)
        assert prov.fired == 1 and runner.kv_device_bytes == held
    toks = [s.prefill(PROMPTS).tokens]
    if site == "commit":
        while len(toks) < 25:
            toks.append(s.step().tokens)
        same((np.array(toks), s.last_logits()), want)
        return
    while s.lengths.max() < 16:
        toks.append(s.step().tokens)
    held = runner.kv_device_bytes
    prov.arm(site, error=MemoryError)
    with pytest.raises(MemoryError):
        s.step()
    assert prov.fired == 1 and s.capacity == 16 and runner.kv_device_bytes == held
    while len(toks) < 25:
        toks.append(s.step().tokens)
    same((np.array(toks), s.last_logits()), want)


def test_a_fault_in_prefill_and_in_decode_leaves_the_next_request_right(faulty, clean):
    prov, runner = faulty
    want = trace(Session(clean, batch=2, capacity=40), PROMPTS, 24)
    s = Session(runner, batch=2, capacity=40, capture=False)
    prov.arm("kernel", match="GroupQueryAttention", after=1)
    with pytest.raises(InjectedFault):
        s.prefill(PROMPTS)
    toks = [s.prefill(PROMPTS).tokens, s.step().tokens]
    prov.arm("kernel", after=1)
    with pytest.raises(InjectedFault):
        s.step()
    while len(toks) < 25:
        toks.append(s.step().tokens)
    same((np.array(toks), s.last_logits()), want)
    same(trace(s, PROMPTS, 24), want)


def test_a_fault_while_streaming_and_the_next_stream_is_right(faulty, clean):
    prov, runner = faulty
    want = Session(clean, batch=2, capacity=48).stream(PROMPTS, max_new_tokens=[20, 17]).run()
    s = Session(runner, batch=2, capacity=48, capture=False)
    it = iter(s.stream(PROMPTS, max_new_tokens=[20, 17]))
    for _ in range(6):
        next(it)
    prov.arm("download")
    with pytest.raises(InjectedFault):
        list(it)
    # the step queued ahead and dropped by the fault is reachable only from the exception's
    # traceback cycle: collect it now, not at whatever allocation count (issue 39: its download
    # handle once gave back a pinned slot whose event the collector had destroyed)
    gc.collect()
    got = s.stream(PROMPTS, max_new_tokens=[20, 17]).run()
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


def test_threads_sharing_a_runner_get_their_solo_results(clean):
    prompts = [[i + 1, 3 * i + 2, 3] for i in range(12)]
    want = [core.run(clean, input_ids=[p], max_new_tokens=10).rows[0].output_ids for p in prompts]
    got = {}

    def work(rows):
        for i in rows:
            got[i] = core.run(clean, input_ids=[prompts[i]], max_new_tokens=10).rows[0].output_ids

    threads = [threading.Thread(target=work, args=(range(k, 12, 3),)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(12)] == want


def test_200_requests_leave_host_and_device_memory_at_their_baseline(clean):
    shapes = [([[5, 6, 7]], 6), ([[8, 9], [10, 11, 12, 13]], 9), ([[1] * 20, [2], [3, 4]], 4)]

    def requests(count):
        for i in range(count):
            ids, new = shapes[i % len(shapes)]
            core.run(clean, input_ids=ids, max_new_tokens=new, sampling={"do_sample": True, "seed": i})

    def device_used():
        clean.provider.synchronize()
        free, total = cupy.cuda.runtime.memGetInfo()
        return total - free

    requests(30)
    gc.collect()
    proc = psutil.Process()
    host, device = proc.memory_info().rss, device_used()
    requests(200)
    gc.collect()
    assert device_used() - device <= DEVICE_TOLERANCE
    assert proc.memory_info().rss - host <= RSS_TOLERANCE
    assert clean.kv_device_bytes == sum(state.kv.device_bytes for state in clean._free)

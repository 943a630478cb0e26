"""Growth under a VMM-style arena, emulated on the host (the CUDA arena is tested on the GPU).

The fake provider reserves KV buffers full of NaN ("unbacked") and zero-fills the bytes that
``kv_commit`` backs, page by page, the way providers.cuda.vmm maps and zeroes pages. A session
with the growing policy must then: never reallocate or copy (same buffer objects, 0 bytes
moved), keep a captured graph valid across growth, commit every byte the kernels write, and give
the tokens and logits of a fixed full-capacity run, bitwise.
"""

import numpy as np
import pytest

from core.generation.loop import decode
from core.protocol import Capabilities
from core.runtime import kv as kvgeo
from core.session import Session
from core.testing.tiny_model import make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider

PAGE = 1024  # small pages, so a tiny model's KV spans many of them


class HostArena(CpuReferenceProvider):
    name = "host_arena"

    def __init__(self):
        super().__init__()
        self.pages: dict[int, set] = {}  # id(buffer) -> committed page indices
        self.buffers: dict[int, np.ndarray] = {}

    def capabilities(self):
        return Capabilities(dtypes=("float32", "float16"), vmm=True, page_bytes=PAGE)

    def reserve(self, shape, dtype):
        buf = np.full(shape, np.nan, dtype)
        self.pages[id(buf)], self.buffers[id(buf)] = set(), buf
        return buf

    def kv_commit(self, arena, requests):
        raw = arena.reshape(-1).view(np.uint8)
        added = 0
        for r in requests:
            for page in range(r.offset // PAGE, -(-(r.offset + r.nbytes) // PAGE)):
                if page not in self.pages[id(arena)]:
                    self.pages[id(arena)].add(page)
                    raw[page * PAGE: (page + 1) * PAGE] = 0
                    added += min(PAGE, raw.size - page * PAGE)
        return added


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def run(model_dir, provider, steps, **kw):
    s = Session(model_dir, provider, batch=3, **kw)
    rows = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    first_kv = []
    t = decode(s, rows, steps, keep_logits=True,
               observer=lambda i, *_: first_kv.extend(id(b) for b in s.state.kv.buffers()) if i == 0 else None)
    return t.tokens.T, t.logits.transpose(1, 0, 2), s, first_kv


def test_growth_commits_pages_instead_of_moving(model_dir):
    steps = 100
    fixed = run(model_dir, CpuReferenceProvider(), steps, capacity=128)
    prov = HostArena()
    grown = run(model_dir, prov, steps, capacity=8, kv_policy="growing", max_capacity=128)
    s = grown[2]
    c = s.counters
    assert c.growth_events >= 3 and c.kv_bytes_moved == 0 and c.invalidations == 0
    assert [id(t) for t in s.state.kv.buffers()] == grown[3], "a KV buffer was reallocated"
    assert np.array_equal(fixed[0], grown[0]) and np.array_equal(fixed[1], grown[1])
    # every live byte sits in a committed (zeroed, then written) page
    for t in s.state.kv.buffers():
        for off, size in kvgeo.live_ranges(s.state.kv.geometry, [int(x) for x in s.lengths]):
            pages = set(range(off // PAGE, -(-(off + size) // PAGE)))
            assert pages <= prov.pages[id(t)]
        assert len(prov.pages[id(t)]) < -(-t.nbytes // PAGE), "committed everything up front"
    assert c.kv_committed_bytes > 0


def test_a_failed_commit_during_growth_leaves_the_cache_as_it_was(model_dir):
    # with VMM the cache grows in place: a kv_commit that fails (the device has no page left)
    # must leave the capacity and the charge as they were, and the run must go on bitwise
    from core.runtime.runner import Runner
    from core.testing.faults import FaultyProvider

    rows = [[5, 6, 7], [8, 9]]
    kw = dict(batch=2, capacity=16, kv_policy="growing", max_capacity=64, capture=False)
    want = decode(Session(model_dir, HostArena(), **kw), rows, 30).tokens
    prov = FaultyProvider(HostArena())
    runner = Runner(model_dir, prov)
    s = Session(runner, **kw)
    toks = [s.prefill(rows).tokens]
    while s.lengths.max() < 16:
        toks.append(s.step().tokens)
    held, growths = runner.kv_device_bytes, s.counters.growth_events
    prov.arm("commit", error=MemoryError)
    with pytest.raises(MemoryError):
        s.step()
    assert prov.fired == 1 and s.capacity == 16 and runner.kv_device_bytes == held
    assert s.counters.growth_events == growths
    while len(toks) < 31:
        toks.append(s.step().tokens)
    assert s.capacity > 16 and np.array_equal(np.array(toks), want)


def test_a_failed_first_commit_in_prefill_leaves_the_session_right(model_dir):
    # the first pages are backed by the prefill (on a GPU, whose 2 MiB granules hold a tiny
    # model's whole growth, that is the only commit): a failure there changes nothing, and the
    # next prefill decodes bitwise a clean session's run
    from core.runtime.runner import Runner
    from core.testing.faults import FaultyProvider

    rows = [[5, 6, 7], [8, 9]]
    kw = dict(batch=2, capacity=16, kv_policy="growing", max_capacity=64, capture=False)
    want = decode(Session(model_dir, HostArena(), **kw), rows, 20).tokens
    prov = FaultyProvider(HostArena())
    runner = Runner(model_dir, prov)
    s = Session(runner, **kw)
    held = runner.kv_device_bytes
    prov.arm("commit", error=MemoryError)
    with pytest.raises(MemoryError):
        s.prefill(rows)
    assert prov.fired == 1 and runner.kv_device_bytes == held and s.counters.kv_committed_bytes == 0
    toks = [s.prefill(rows).tokens]
    while len(toks) < 21:
        toks.append(s.step().tokens)
    assert np.array_equal(np.array(toks), want)

"""Issue 39 on the GPU: a fault injected at ``download_async`` while streaming, then the next stream.

One command runs a matrix of variants, each in a fresh process (a broken CUDA context or a
SIGSEGV ends only its own variant), and prints one line per variant: passed or failed, the
first CUDA error named in its output, and the diagnostics its checkpoints took::

    python benchmarks/pdl_fault_repro.py                   # the default matrix (about 5-8 min)
    python benchmarks/pdl_fault_repro.py --list            # the variants
    python benchmarks/pdl_fault_repro.py --only fileorder-pdl1,fileorder-pdl0
    python benchmarks/pdl_fault_repro.py --sanitizer       # the first variants under compute-sanitizer
    python benchmarks/pdl_fault_repro.py --child '{...}'   # one variant in this process (what the matrix runs)

Each variant builds the tiny models the way tests/cuda/conftest.py does (fp32, fp16, int4) and
runs the streaming fault test of tests/cuda/test_reliability_cuda.py: a clean Runner's stream,
then a FaultyProvider's Session whose stream is armed at ``download`` after 6 deltas, the fault
collected, then the next stream on the same session, compared token for token. ``fileorder``
variants run the file's tests before it in pytest's order (module-scoped model parameter:
fp32's whole file, then fp16's, then int4's: the KV-commit fault, the prefill/decode kernel
faults, threads sharing a Runner, repeated requests), which is where the failure was seen.

What was found (issue 39, from reading and a CPU check, to be confirmed here): the fault drops
the step queued ahead; its ``PendingStep`` and pinned-slot download handle are then reachable
only from the exception's traceback cycle (the fault's frame holds the exception), so the
cycle collector reclaims them at whatever allocation count triggers it, often during the next
stream. The collector first runs the finaliser of everything only that cycle reaches, the
slot's ``cupy.cuda.Event`` included (``__del__`` destroys the CUDA event and leaves ``ptr``
set), and main's handle ``__del__`` then put the slot back into the live provider's free list:
the next ``download_async`` taking it called ``cudaEventRecord`` on a destroyed event
(cudaErrorContextIsDestroyed, cudaErrorDeviceUninitialized, or SIGSEGV). PDL only changed how
many objects each launch allocates (a Launch, its packed numpy values, a CUlaunchConfig), so
when the collection came. The ``*-gc-baseline`` variants force the collection right after the
fault with main's handle restored: they should fail with PDL on and off alike; the same with
this branch's handle (``weakref.finalize``) should pass.

Checkpoints (printed as ``ISSUE39 {json}`` lines, flushed, so a crash keeps what came before):
the thread's current driver context against the one at start, ``cuStreamQuery`` of the
provider stream, ``cuCtxSynchronize`` (after a failure, and in the ``sync`` variant: a sticky
device error shows as CUDA_ERROR_ILLEGAL_ADDRESS there), and ``cuEventQuery`` of every live
pinned staging slot's event (duplicate handles flagged), after the fault and when the next
stream fails; after a failure, a new event is recorded on the provider stream and on a new
stream (which handle is bad: the slot's event, the stream, or the context).
With ``paramcheck`` every recorded or PDL launch's packed arguments are checked against the
kernel's parameter sizes (``cuFuncGetParamInfo``): a mismatch means the driver reads past a
packed argument.

Variant knobs (``--child`` JSON): dtypes, prelude (the file's earlier tests), rounds, pdl,
replay, blocking (CUDA_LAUNCH_BLOCKING=1), run_ahead, after ("none", "sync", "gc", "gcoff"),
fix (experiments applied here as patches: "baseline" reverts this branch's fixes,
"pdl_after_kernel" gives the programmatic attribute only to a launch whose stream predecessor
is one of Lockstep's kernels, "no_timer" drops the session's timing events, "fresh_slots" never
reuses a pinned slot, "recover_sync" synchronises at the start of a failed step's recovery).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7], [8, 9]]
NEW = [20, 17]
VARIANTS_ORDER = ("fp32", "fp16", "int4")
DTYPES = {"fp32": ("float32", None), "fp16": ("float16", None), "int4": ("float16", "int4")}


def _v(name, **kw):
    base = dict(name=name, dtypes=list(VARIANTS_ORDER), prelude=True, rounds=1, pdl=1, replay=1, blocking=0,
                run_ahead=True, after="none", fix="", paramcheck=False)
    base.update(kw)
    return base


#: The default matrix, most telling first (the parent stops starting variants near --budget).
MATRIX = [
    # the mechanism found (issue 39): a collection right after the fault reclaims the failed
    # stream's dropped download handle with its traceback cycle; main's handle __del__ then gives
    # back a slot whose cupy Event the collector has already destroyed. Deterministic, PDL or not:
    _v("alone-fp32-pdl0-gc-baseline", dtypes=["fp32"], prelude=False, pdl=0, after="gc", fix="baseline"),
    _v("alone-fp32-pdl1-gc-baseline", dtypes=["fp32"], prelude=False, after="gc", fix="baseline"),
    _v("alone-fp32-pdl0-gc", dtypes=["fp32"], prelude=False, pdl=0, after="gc"),
    _v("fileorder-pdl1"),
    _v("fileorder-pdl0", pdl=0),
    _v("fileorder-pdl1-baseline", fix="baseline"),
    _v("fileorder-pdl1-gc-baseline", after="gc", fix="baseline"),
    _v("fileorder-pdl1-replay0", replay=0),
    _v("fileorder-pdl1-blocking", blocking=1),
    _v("fileorder-pdl1-sync", after="sync"),
    _v("fileorder-pdl1-gc", after="gc"),
    _v("fileorder-pdl1-gcoff", after="gcoff"),
    _v("fileorder-pdl1-pdl_after_kernel", fix="pdl_after_kernel"),
    _v("fileorder-pdl1-no_timer", fix="no_timer"),
    _v("fileorder-pdl1-fresh_slots", fix="fresh_slots"),
    _v("alone-fp32-pdl1-x4", dtypes=["fp32"], prelude=False, rounds=4),
    _v("alone-fp16-pdl1-x4", dtypes=["fp16"], prelude=False, rounds=4),
    _v("alone-int4-pdl1-x4", dtypes=["int4"], prelude=False, rounds=4),
    _v("fileorder-pdl1-noahead", run_ahead=False),
    _v("fileorder-pdl1-paramcheck", paramcheck=True),
    dict(name="micro-pdl1", micro=True, pdl=1),
    dict(name="micro-pdl0", micro=True, pdl=0),
]


# ----------------------------------------------------------------------------------------- child
def say(**kw) -> None:
    print("ISSUE39 " + json.dumps(kw, default=str), flush=True)


class Diag:
    """The checkpoints (module docstring)."""

    def __init__(self):
        import cupy
        from cuda.bindings import driver  # the driver only: cuda.bindings.runtime is a second runtime

        self.cupy, self.driver = cupy, driver
        cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))  # the runtime's primary context is current
        err, ctx = driver.cuCtxGetCurrent()
        self.ctx0 = int(ctx)
        self.slots: list = []  # weakrefs to every pinned staging slot made
        self.param_mismatch: list = []
        self.sync_checks = False  # cuCtxSynchronize at each checkpoint (after="sync" turns it on)
        self._param_seen: set = set()

    def track_slots(self) -> None:
        import weakref

        from providers.cuda import provider as prov_mod

        init = prov_mod._PinnedSlot.__init__
        diag = self

        def patched(slot, cupy, nbytes):
            init(slot, cupy, nbytes)
            diag.slots.append(weakref.ref(slot))

        prov_mod._PinnedSlot.__init__ = patched

    def check_params(self) -> None:
        """Patch replay.Launch so each new (kernel, argument sizes) is checked once."""
        from providers.cuda import replay

        init = replay.Launch.__init__
        diag, drv = self, self.driver

        def patched(launch, fn, grid, block, args, shared):
            init(launch, fn, grid, block, args, shared)
            values = launch._keep[0]
            key = (fn, tuple(v.nbytes for v in values))
            if key in diag._param_seen:
                return
            diag._param_seen.add(key)
            f = drv.CUfunction(fn)
            sizes = []
            for i in range(len(values) + 1):
                err, _off, size = drv.cuFuncGetParamInfo(f, i)
                if err != drv.CUresult.CUDA_SUCCESS:
                    if i == 0 and values and err != drv.CUresult.CUDA_ERROR_INVALID_VALUE:
                        say(event="paramcheck_unsupported", error=str(err))  # a driver before 12.4
                        replay.Launch.__init__ = init
                        return
                    break
                sizes.append(int(size))
            got = [int(v.nbytes) for v in values]
            if sizes != got:
                diag.param_mismatch.append(dict(fn=hex(fn), kernel_sizes=sizes, packed_sizes=got))
                say(event="param_mismatch", fn=hex(fn), kernel_sizes=sizes, packed_sizes=got,
                    where="".join(traceback.format_stack(limit=6)[:-1]))

        replay.Launch.__init__ = patched

    def checkpoint(self, tag: str, stream_ptr: int) -> dict:
        drv = self.driver
        out: dict = dict(event="checkpoint", tag=tag)
        err, ctx = drv.cuCtxGetCurrent()
        out["ctx"] = "same" if int(ctx) == self.ctx0 else f"CHANGED {int(ctx):#x} (start {self.ctx0:#x})"
        (sync,) = drv.cuCtxSynchronize() if self.sync_checks else (None,)
        out["ctx_synchronize"] = getattr(sync, "name", str(sync))
        (sq,) = drv.cuStreamQuery(drv.CUstream(stream_ptr))
        out["stream_query"] = getattr(sq, "name", str(sq))
        say(**out)  # before the event queries: a dangling event handle may crash them
        live = [s for s in (r() for r in self.slots) if s is not None]
        ptrs = [int(s.event.ptr) for s in live]
        dup = sorted({p for p in ptrs if ptrs.count(p) > 1})
        events = {}
        for p in ptrs:
            (q,) = drv.cuEventQuery(drv.CUevent(p))
            events[hex(p)] = getattr(q, "name", str(q))
        out.update(slots=len(live), duplicate_event_handles=[hex(p) for p in dup], slot_events=events)
        say(**out)
        return out


    def probe(self, stream_ptr: int) -> None:
        """After a failure: can a new event be recorded on the provider stream, and on a new
        stream? Both fine: the context and stream are sound and the failing slot's event handle
        is not (a destroyed or overwritten event); both failing: the context is gone (a sticky
        error or a destroyed context); only the provider stream failing: the stream handle."""
        drv = self.driver
        out: dict = dict(event="probe")
        for where, make in (("provider stream", lambda: drv.CUstream(stream_ptr)),
                            ("new stream", lambda: drv.cuStreamCreate(1)[1])):
            try:
                err, ev = drv.cuEventCreate(2)  # CU_EVENT_DISABLE_TIMING
                (rec,) = drv.cuEventRecord(ev, make()) if err == drv.CUresult.CUDA_SUCCESS else (err,)
                (syn,) = drv.cuEventSynchronize(ev) if rec == drv.CUresult.CUDA_SUCCESS else (rec,)
                out[where] = f"create={getattr(err, 'name', err)} record={getattr(rec, 'name', rec)} " \
                             f"sync={getattr(syn, 'name', syn)}"
            except Exception as exc:  # noqa: BLE001 - a probe: report whatever happens
                out[where] = f"{type(exc).__name__}: {exc}"
        say(**out)


def _apply_fix(fix: str) -> None:
    """Experiments as patches (module docstring)."""
    import numpy as np

    from providers.cuda import module, replay
    from providers.cuda import provider as prov_mod

    if fix == "baseline":  # this branch's changes reverted: main's code paths
        import core.session as sess

        sess.Session._recover = _recover_main

        prov_mod._PinnedDownload = _PinnedDownloadMain
        say(event="fix", fix=fix)
    elif fix == "recover_sync":
        import core.session as sess

        recover = sess.Session._recover

        def patched(self):
            self.provider.synchronize()
            recover(self)

        sess.Session._recover = patched
    elif fix == "no_timer":
        prov_mod.CudaProvider.node_timer = lambda self: None
    elif fix == "fresh_slots":
        keep: list = []

        def fresh(self, nbytes):
            slot = prov_mod._PinnedSlot(self.cupy, max(nbytes, 4096))
            keep.append(slot)  # never freed, never reused
            return slot

        prov_mod.CudaProvider._pinned_slot = fresh
        prov_mod.CudaProvider._pinned_free = property(lambda self: [], lambda self, v: None)  # nothing comes back
    elif fix == "pdl_after_kernel":
        state = {"kernel": False}  # the last op queued on the stream was one of our kernels
        fire = replay.Launch.fire

        def fire_patched(self, stream):
            pdl = self.pdl
            if pdl and not state["kernel"]:
                self.pdl = False
                try:
                    fire(self, stream)
                finally:
                    self.pdl = pdl
            else:
                fire(self, stream)
            state["kernel"] = True

        replay.Launch.fire = fire_patched
        call = module.Kernel.__call__

        def call_patched(self, grid, block, args, shared_mem=0):
            call(self, grid, block, args, shared_mem)
            state["kernel"] = replay._pdl_rows is not None  # a CuPy launch (PDL off) is not a PDL kernel

        module.Kernel.__call__ = call_patched
        spoil = replay.not_replayable

        def not_replayable():
            state["kernel"] = False
            spoil()

        replay.not_replayable = not_replayable
        for name in ("download_async", "_write", "_fill", "_copy_bytes", "replay", "synchronize", "_download",
                     "_upload", "_allocate"):
            orig = getattr(prov_mod.CudaProvider, name)

            def wrapped(self, *a, __orig=orig, **k):
                state["kernel"] = False
                return __orig(self, *a, **k)

            setattr(prov_mod.CudaProvider, name, wrapped)
        timer = prov_mod.CudaProvider.node_timer

        def node_timer(self):
            t = timer(self)
            mark = t.mark

            def marked():
                state["kernel"] = False
                return mark()

            t.mark = marked
            return t

        prov_mod.CudaProvider.node_timer = node_timer
    elif fix:
        raise SystemExit(f"unknown fix {fix!r}")
    del np


class _PinnedDownloadMain:
    """providers.cuda.provider._PinnedDownload as on main (9ee7158): the slot goes back from __del__."""

    def __init__(self, free, slot, shape, dtype, nbytes):
        self._free, self._shape, self._dtype, self._n = free, shape, dtype, nbytes
        self._slot = slot
        self._out = None

    def wait(self):
        if self._out is None:
            slot = self._slot
            slot.event.synchronize()
            self._out = slot.host[:self._n].view(self._dtype).reshape(self._shape).copy()
            self._free.append(slot)
            self._slot = None
        return self._out

    def __del__(self):
        if self._slot is not None:
            self._free.append(self._slot)
            self._slot = None


def _recover_main(self) -> None:
    """core.session.Session._recover as on main (9ee7158): no synchronisation first."""
    state = self.state
    try:
        dropped = self._unread[:]
        self._unread.clear()
        for q in dropped:
            q.discarded = True
        state.set_lengths(state.lengths - len(dropped))
        if self._last_raw is not None:
            self.provider.write(state.result, self._last_raw)
        self._logits_stale = True
        state.capture.invalidate("a decode step failed", self.counters)
    except BaseException:
        state.broken = True
        raise


def _trace(session, prompts, steps):
    import numpy as np

    toks = [session.prefill(prompts).tokens]
    toks += [session.step().tokens for _ in range(steps)]
    return np.array(toks), session.last_logits()


def _same(a, b) -> bool:
    import numpy as np

    return bool(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]))


def _prelude(model, gpu, clean, label: str) -> None:
    """tests/cuda/test_reliability_cuda.py's tests before the streaming one, for one model."""
    import numpy as np

    from core.runtime.runner import Runner
    from core.session import Session
    from core.testing.faults import FaultyProvider, InjectedFault

    def faulty():
        prov = FaultyProvider(_provider())
        return prov, Runner(model, prov)

    for site in ("copy", "allocate", "commit"):
        prov, runner = faulty()
        if (site == "commit") != bool(prov.capabilities().vmm):
            continue
        kw = dict(capacity=16, kv_policy="growing", max_capacity=64, capture=False, run_ahead=False)
        want = _trace(Session(clean, batch=2, **kw), PROMPTS, 24)
        s = Session(runner, batch=2, **kw)
        if site == "commit":
            prov.arm("commit", error=MemoryError)
            with contextlib.suppress(MemoryError):
                s.prefill(PROMPTS)
            toks = [s.prefill(PROMPTS).tokens]
            while len(toks) < 25:
                toks.append(s.step().tokens)
        else:
            toks = [s.prefill(PROMPTS).tokens]
            while s.lengths.max() < 16:
                toks.append(s.step().tokens)
            prov.arm(site, error=MemoryError)
            with contextlib.suppress(MemoryError):
                s.step()
            while len(toks) < 25:
                toks.append(s.step().tokens)
        say(event="prelude", model=label, test=f"kv_growth[{site}]",
            ok=_same((np.array(toks), s.last_logits()), want))
    prov, runner = faulty()
    want = _trace(Session(clean, batch=2, capacity=40), PROMPTS, 24)
    s = Session(runner, batch=2, capacity=40, capture=False)
    prov.arm("kernel", match="GroupQueryAttention", after=1)
    with contextlib.suppress(InjectedFault):
        s.prefill(PROMPTS)
    toks = [s.prefill(PROMPTS).tokens, s.step().tokens]
    prov.arm("kernel", after=1)
    with contextlib.suppress(InjectedFault):
        s.step()
    while len(toks) < 25:
        toks.append(s.step().tokens)
    say(event="prelude", model=label, test="prefill_decode_fault",
        ok=_same((np.array(toks), s.last_logits()), want) and _same(_trace(s, PROMPTS, 24), want))
    return None


def _postlude(clean, label: str) -> None:
    """The file's tests after the streaming one (threads, repeated requests), shortened."""
    import threading

    import core

    prompts = [[i + 1, 3 * i + 2, 3] for i in range(6)]
    want = [core.run(clean, input_ids=[p], max_new_tokens=10).rows[0].output_ids for p in prompts]
    got: dict = {}

    def work(rows):
        for i in rows:
            got[i] = core.run(clean, input_ids=[prompts[i]], max_new_tokens=10).rows[0].output_ids

    threads = [threading.Thread(target=work, args=(range(k, 6, 3),)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shapes = [([[5, 6, 7]], 6), ([[8, 9], [10, 11, 12, 13]], 9), ([[1] * 20, [2], [3, 4]], 4)]
    for i in range(60):
        ids, new = shapes[i % len(shapes)]
        core.run(clean, input_ids=ids, max_new_tokens=new, sampling={"do_sample": True, "seed": i})
    say(event="postlude", model=label, threads_ok=[got[i] for i in range(6)] == want)


def _stream_fault(model, clean, diag, cfg: dict, label: str, rnd: int) -> bool:
    import gc

    from core.runtime.runner import Runner
    from core.session import Session
    from core.testing.faults import FaultyProvider, InjectedFault

    want = Session(clean, batch=2, capacity=48).stream(PROMPTS, max_new_tokens=NEW).run()
    prov = FaultyProvider(_provider())
    runner = Runner(model, prov)
    s = Session(runner, batch=2, capacity=48, capture=False, run_ahead=cfg["run_ahead"])
    it = iter(s.stream(PROMPTS, max_new_tokens=NEW))
    for _ in range(6):
        next(it)
    prov.arm("download")
    raised = None
    try:  # as pytest.raises without "as": the exception (a cycle with its traceback) is dropped here
        list(it)
    except InjectedFault as exc:
        raised = type(exc).__name__
    say(event="fault", model=label, round=rnd, raised=raised, fired=prov.fired, downloads=prov.calls["download"])
    stream_ptr = getattr(getattr(prov.inner, "stream", None), "ptr", 0)
    diag.checkpoint(f"{label}#{rnd} after the fault", stream_ptr)
    if cfg["after"] == "sync":
        diag.sync_checks = True
        prov.synchronize()
        diag.checkpoint(f"{label}#{rnd} after sync", stream_ptr)
    elif cfg["after"] == "gc":
        gc.collect()
        diag.checkpoint(f"{label}#{rnd} after gc.collect", stream_ptr)
    try:
        got = s.stream(PROMPTS, max_new_tokens=NEW).run()
    except BaseException as exc:  # noqa: BLE001 - the defect: report, then fail the variant
        say(event="next_stream_failed", model=label, round=rnd, error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc(limit=12))
        diag.probe(stream_ptr)  # first: the checkpoint's event queries may crash on a bad handle
        diag.sync_checks = True
        diag.checkpoint(f"{label}#{rnd} after the failure", stream_ptr)
        return False
    ok = [r.output_ids for r in got] == [r.output_ids for r in want]
    say(event="next_stream", model=label, round=rnd, bitwise_right=ok)
    return ok


_CPU = False  # --child {"cpu": true}: the flow on cpu_reference, no GPU (a check of this script)


def _provider():
    if _CPU:
        from providers.cpu_reference.provider import CpuReferenceProvider

        return CpuReferenceProvider()
    from providers.cuda.provider import CudaProvider

    return CudaProvider()


class _NoDiag:
    def checkpoint(self, tag: str, stream_ptr: int) -> dict:
        say(event="checkpoint", tag=tag)
        return {}

    def probe(self, stream_ptr: int) -> None:
        say(event="probe")

    sync_checks = False
    param_mismatch: list = []


def child(cfg: dict) -> int:
    global _CPU
    import faulthandler

    faulthandler.enable()
    sys.path.insert(0, str(ROOT))
    if cfg.get("after") == "gcoff":
        import gc

        gc.disable()
    if cfg.get("micro"):
        return micro(cfg)
    _CPU = bool(cfg.get("cpu"))
    from core.runtime.runner import Runner
    from core.testing.tiny_model import make_tiny_model

    if _CPU:
        diag: Diag | _NoDiag = _NoDiag()
        gpu = _provider()
        say(event="start", device="cpu_reference (a dry run of this script)")
    else:
        diag = Diag()
        diag.track_slots()
        if cfg.get("paramcheck"):
            diag.check_params()
        _apply_fix(cfg.get("fix", ""))
        gpu = _provider()  # the session-scoped provider of tests/cuda/conftest.py
        say(event="start", device=diag.cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
            settings=gpu.settings(), cupy=diag.cupy.__version__,
            bindings=__import__("cuda.bindings").bindings.__version__,
            driver=diag.cupy.cuda.runtime.driverGetVersion())
    tmp = Path(tempfile.mkdtemp(prefix="issue39-"))
    ok = True
    for label in cfg["dtypes"]:
        dtype, quant = DTYPES[label]
        model = make_tiny_model(tmp / label, dtype=dtype, quant=quant)
        clean = Runner(model, gpu)
        if cfg["prelude"]:
            _prelude(model, gpu, clean, label)
        for rnd in range(cfg["rounds"]):
            if not _stream_fault(model, clean, diag, cfg, label, rnd):
                ok = False
                break
        if not ok:
            break
        if cfg["prelude"]:
            _postlude(clean, label)
    if diag.param_mismatch:
        ok = False
    gpu.synchronize()
    say(event="result", ok=ok, param_mismatches=len(diag.param_mismatch))
    return 0 if ok else 1


MICRO_SRC = r"""
extern "C" __global__ void step(float* x, const float* w, int n, int hold) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i]; for (int k = 0; k < hold; ++k) v = v * 0.999f + w[i]; x[i] = v; }
}
"""


def micro(cfg: dict) -> int:
    """Lockstep's stream pattern without Lockstep: PDL kernels (cuLaunchKernelEx), timing events
    recorded between them and dropped while pending, a D2H copy into a reused pinned slot and
    its event, on one non-blocking stream; a download skipped now and then (the fault)."""
    import cupy
    import numpy as np

    from providers.cuda import replay

    stream = cupy.cuda.Stream(non_blocking=True)
    stream.use()
    fn = cupy.RawModule(code=MICRO_SRC).get_function("step")
    n = 1 << 16
    x, w = cupy.ones(n, cupy.float32), cupy.full(n, 1e-3, cupy.float32)
    replay.use_pdl(1 << 62 if cfg["pdl"] else None)
    replay._rows = 1
    slots = [(cupy.cuda.alloc_pinned_memory(4096), cupy.cuda.Event(disable_timing=True)) for _ in range(3)]
    free = list(slots)
    pending: list = []
    t0 = time.time()
    for it in range(20000):
        start = cupy.cuda.Event()
        start.record(stream)
        for _ in range(6):
            replay.Launch(fn.kernel.ptr, (n // 256,), (256,), (x, w, np.int32(n), np.int32(64)), 0).fire(stream.ptr)
        end = cupy.cuda.Event()
        end.record(stream)
        if it % 7 == 3:  # the fault: no download; queued slots go back unread (a dropped handle)
            free += pending
            pending.clear()
            continue
        mem, ev = free.pop(0)
        cupy.cuda.runtime.memcpyAsync(mem.ptr, x.data.ptr, 4096, cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        ev.record(stream)
        pending.append((mem, ev))
        if len(pending) > 2:
            m, e = pending.pop(0)
            e.synchronize()
            free.append((m, e))
        if time.time() - t0 > 60:
            break
    stream.synchronize()
    say(event="result", ok=True, iterations=it + 1)
    return 0


# ---------------------------------------------------------------------------------------- parent
ERROR_RE = re.compile(r"(cudaError\w+|CUDA_ERROR_\w+|Fatal Python error: \w+|Segmentation fault|"
                      r"an illegal memory access|CUDARuntimeError[^\n]*)")


def run_variant(cfg: dict, timeout: int, sanitizer: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               LOCKSTEP_CUDA_PDL=str(cfg.get("pdl", 1)), LOCKSTEP_CUDA_REPLAY=str(cfg.get("replay", 1)))
    if cfg.get("blocking"):
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    cmd = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--child", json.dumps(cfg)]
    if sanitizer:
        cmd = ["compute-sanitizer", "--tool", "memcheck", "--print-limit", "5", *cmd]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out += "\n(timed out)"
        rc = 124
    lines = [json.loads(ln[8:]) for ln in out.splitlines() if ln.startswith("ISSUE39 {")]
    first = ERROR_RE.search(out)
    failed = [x for x in lines if x.get("event") == "next_stream_failed"]
    checkpoints = [x for x in lines if x.get("event") == "checkpoint" and "slot_events" in x]
    odd = [c for c in checkpoints if c["ctx"] != "same" or c["duplicate_event_handles"]
           or c["ctx_synchronize"] not in ("None", "CUDA_SUCCESS")
           or any(v not in ("CUDA_SUCCESS", "CUDA_ERROR_NOT_READY") for v in c["slot_events"].values())]
    return dict(name=cfg["name"], rc=rc, seconds=round(time.time() - t0, 1),
                first_error=first.group(0) if first else None,
                failed_at=[f"{f['model']}#{f['round']}: {f['error'][:160]}" for f in failed],
                odd_checkpoints=odd[:3], mismatches=[x for x in lines if x.get("event") == "param_mismatch"][:3],
                prelude_bad=[x for x in lines if x.get("event") == "prelude" and not x.get("ok")],
                probes=[x for x in lines if x.get("event") == "probe"],
                tail=out[-1500:] if rc not in (0,) else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help="run one variant (JSON) in this process")
    ap.add_argument("--only", help="comma-separated variant names")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--budget", type=int, default=540, help="seconds; no variant starts after it")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per variant")
    ap.add_argument("--sanitizer", action="store_true", help="run under compute-sanitizer memcheck")
    ap.add_argument("--out", help="write every variant's result as JSON here")
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    matrix = MATRIX
    if args.only:
        names = args.only.split(",")
        matrix = [v for v in MATRIX if v["name"] in names]
        missing = set(names) - {v["name"] for v in matrix}
        if missing:
            raise SystemExit(f"unknown variants {sorted(missing)}; --list names them")
    if args.list:
        for v in MATRIX:
            print(v["name"], json.dumps(v))
        return 0
    t0, results = time.time(), []
    for cfg in matrix:
        left = args.budget - (time.time() - t0)
        if left < 20:
            print(f"SKIPPED (budget) {cfg['name']}", flush=True)
            continue
        r = run_variant(cfg, int(min(args.timeout, left)), args.sanitizer)
        results.append(r)
        verdict = "PASS" if r["rc"] == 0 else ("TIMEOUT" if r["rc"] == 124 else f"FAIL rc={r['rc']}")
        print(f"{verdict:12s} {r['name']:36s} {r['seconds']:6.1f}s first_error={r['first_error']} "
              f"failed_at={r['failed_at']}", flush=True)
        for c in r["odd_checkpoints"]:
            print(f"    checkpoint {c['tag']}: ctx={c['ctx']} sync={c['ctx_synchronize']} "
                  f"stream={c['stream_query']} dup={c['duplicate_event_handles']} events={c['slot_events']}")
        for m in r["mismatches"]:
            print(f"    PARAM MISMATCH {m['fn']} kernel={m['kernel_sizes']} packed={m['packed_sizes']}\n{m['where']}")
        for p in r["probes"]:
            print(f"    probe after the failure: {p}")
        for p in r["prelude_bad"]:
            print(f"    prelude not bitwise: {p}")
        if r["rc"] != 0:
            print("    --- tail ---\n    " + r["tail"].replace("\n", "\n    "), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

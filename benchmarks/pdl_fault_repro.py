"""Issue 39 on the GPU: a fault injected at ``download_async`` while streaming, then the next stream.

One command runs a matrix of variants, each in a fresh process (a broken CUDA context or a
SIGSEGV ends only its own variant), and prints one line per variant: passed or failed, the
first CUDA error named in its output, and the diagnostics its checkpoints took::

    python benchmarks/pdl_fault_repro.py                   # the default matrix (about 5-8 min)
    python benchmarks/pdl_fault_repro.py --only fileorder-pdl1,fileorder-pdl0   # --list names them
    python benchmarks/pdl_fault_repro.py --sanitizer       # the first variants under compute-sanitizer
    python benchmarks/pdl_fault_repro.py --child '{...}'   # one variant in this process (what the matrix runs)

Each variant builds the tiny models the way tests/cuda/conftest.py does (fp32, fp16, int4) and
runs the streaming fault test of tests/cuda/test_reliability_cuda.py: a clean Runner's stream,
then a FaultyProvider's Session whose stream is armed at ``download`` after 6 deltas, the fault
collected, then the next stream on the same session, compared token for token. ``fileorder``
variants run the file's tests before it in pytest's order (module-scoped model parameter:
fp32's whole file, then fp16's, then int4's: the KV-commit fault, the prefill/decode kernel
faults, threads sharing a Runner, repeated requests), which is where the failure was seen.

What was found (issue 39; a CPU check, to be confirmed here): the fault drops the step queued
ahead, whose download handle is then reachable only from the exception's traceback cycle; the
cycle collector reclaims it when allocations trigger it, often during the next stream, and
first runs the finaliser of everything only that cycle reaches: the slot's ``cupy.cuda.Event``
too (its ``__del__`` destroys the CUDA event, ``ptr`` stays set). Main's handle ``__del__``
then put the slot back in the live provider's free list, and the next ``download_async`` taking
it recorded a destroyed event (cudaErrorContextIsDestroyed, cudaErrorDeviceUninitialized,
SIGSEGV). PDL only changed how many objects a launch allocates, so when the collection came.

Checkpoints (``ISSUE39 {json}`` lines, flushed, so a crash keeps what came before), after the
fault, after the ``sync``/``gc`` step and after a failure: slots whose Event was destroyed
(``DESTROYED_EVENT_SLOTS``, alive and in the free list: the mechanism itself), the current
driver context against the start's, ``cuStreamQuery``, ``cuCtxSynchronize`` (``sync`` and
after a failure: a sticky device error shows there), ``cuEventQuery`` of the other slots'
events; after a failure a new event is recorded on the provider stream and on a new stream.

Variant knobs (``--child`` JSON): dtypes, prelude (the file's earlier tests), rounds, pdl,
replay, blocking (CUDA_LAUNCH_BLOCKING=1), run_ahead, after ("none", "sync", "gc", "gcoff"),
fix ("baseline": main's download handle, restored by a patch), cpu (a dry run on cpu_reference).
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
                run_ahead=True, after="none", fix="")
    base.update(kw)
    return base


#: The default matrix, most telling first (the parent starts no variant past --budget). The
#: "gc" variants collect right after the fault, which reclaims the failed stream's dropped
#: download handle with its traceback cycle: with main's handle ("baseline") the next stream
#: should fail with PDL on and off alike; with this branch's, pass.
MATRIX = [
    _v("alone-fp32-pdl0-gc-baseline", dtypes=["fp32"], prelude=False, pdl=0, after="gc", fix="baseline"),
    _v("alone-fp32-pdl1-gc-baseline", dtypes=["fp32"], prelude=False, after="gc", fix="baseline"),
    _v("alone-fp32-pdl0-gc", dtypes=["fp32"], prelude=False, pdl=0, after="gc"),
    _v("alone-fp32-pdl1-gc", dtypes=["fp32"], prelude=False, after="gc"),
    _v("fileorder-pdl1-gc", after="gc"),
    _v("fileorder-pdl1"),
    _v("fileorder-pdl1-baseline", fix="baseline"),
    _v("fileorder-pdl1-replay0", replay=0),
    _v("fileorder-pdl1-replay0-baseline", replay=0, fix="baseline"),
    _v("fileorder-pdl0", pdl=0),
    _v("fileorder-pdl1-blocking", blocking=1),
    _v("fileorder-pdl1-sync", after="sync"),
    _v("fileorder-pdl1-gcoff-baseline", after="gcoff", fix="baseline"),
    _v("alone-fp16-pdl1-x4", dtypes=["fp16"], prelude=False, rounds=4),
    _v("alone-int4-pdl1-x4", dtypes=["int4"], prelude=False, rounds=4),
    _v("fileorder-pdl1-noahead", run_ahead=False),
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
        self.sync_checks = False  # cuCtxSynchronize at each checkpoint (after="sync" turns it on)

    def track_slots(self) -> None:
        import weakref

        from providers.cuda import provider as prov_mod

        init = prov_mod._PinnedSlot.__init__
        diag = self

        def patched(slot, cupy, nbytes):
            init(slot, cupy, nbytes)
            diag.slots.append(weakref.ref(slot))

        prov_mod._PinnedSlot.__init__ = patched
        try:  # mark each cupy Event as its __del__ destroys it (no driver call on it afterwards)
            destroy = self.cupy.cuda.Event.__del__

            def marked(ev, *a, **k):
                ev.issue39_destroyed = True
                destroy(ev, *a, **k)

            self.cupy.cuda.Event.__del__ = marked
        except (AttributeError, TypeError) as exc:
            say(event="no_event_marks", why=str(exc))

    def checkpoint(self, tag: str, provider) -> dict:
        drv, stream_ptr = self.driver, getattr(getattr(provider, "stream", None), "ptr", 0)
        out: dict = dict(event="checkpoint", tag=tag)
        err, ctx = drv.cuCtxGetCurrent()
        out["ctx"] = "same" if int(ctx) == self.ctx0 else f"CHANGED {int(ctx):#x} (start {self.ctx0:#x})"
        (sync,) = drv.cuCtxSynchronize() if self.sync_checks else (None,)
        out["ctx_synchronize"] = getattr(sync, "name", str(sync))
        (sq,) = drv.cuStreamQuery(drv.CUstream(stream_ptr))
        out["stream_query"] = getattr(sq, "name", str(sq))
        say(**out)  # before the event queries: a dangling event handle may crash them
        free = list(getattr(provider, "_pinned_free", []))  # a resurrected slot's weakrefs were cleared
        live = free + [s for s in (r() for r in self.slots) if s is not None and s not in free]
        dead = [s for s in live if getattr(s.event, "issue39_destroyed", False)]
        out["DESTROYED_EVENT_SLOTS"] = dict(alive=len(dead), in_free_list=sum(s in free for s in dead))
        ptrs = [int(s.event.ptr) for s in live if s not in dead]
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
    from providers.cuda import provider as prov_mod

    if fix == "baseline":  # main's download handle (its slot back from __del__)
        prov_mod._PinnedDownload = _PinnedDownloadMain
        say(event="fix", fix=fix)
    elif fix:
        raise SystemExit(f"unknown fix {fix!r}")


class _PinnedDownloadMain:
    """providers.cuda.provider._PinnedDownload as on main (9ee7158): the slot goes back from __del__."""

    def __init__(self, free, slot, shape, dtype, nbytes):
        self._free, self._slot, self._shape, self._dtype, self._n, self._out = free, slot, shape, dtype, nbytes, None

    def wait(self):
        if self._out is None:
            self._slot.event.synchronize()
            self._out = self._slot.host[:self._n].view(self._dtype).reshape(self._shape).copy()
            self._free.append(self._slot)
            self._slot = None
        return self._out

    def __del__(self):
        if self._slot is not None:
            self._free.append(self._slot)
            self._slot = None


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
        if site == "commit":  # the prefill's commit (a tiny model's growth stays in its granule)
            prov.arm("commit", error=MemoryError)
            with contextlib.suppress(MemoryError):
                s.prefill(PROMPTS)
        toks = [s.prefill(PROMPTS).tokens]
        while site != "commit" and s.lengths.max() < 16:
            toks.append(s.step().tokens)
        if site != "commit":  # the step that grows the cache
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


def _postlude(clean, label: str) -> None:
    """The file's tests after the streaming one (threads sharing the Runner, requests), shortened."""
    from concurrent.futures import ThreadPoolExecutor

    import core

    def one(i):
        return core.run(clean, input_ids=[[i + 1, 3 * i + 2, 3]], max_new_tokens=10).rows[0].output_ids

    want = [one(i) for i in range(6)]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(one, range(6)))
    shapes = [([[5, 6, 7]], 6), ([[8, 9], [10, 11, 12, 13]], 9), ([[1] * 20, [2], [3, 4]], 4)]
    for i in range(60):
        ids, new = shapes[i % len(shapes)]
        core.run(clean, input_ids=ids, max_new_tokens=new, sampling={"do_sample": True, "seed": i})
    say(event="postlude", model=label, threads_ok=got == want)


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
    inner = prov.inner
    diag.checkpoint(f"{label}#{rnd} after the fault", inner)
    if cfg["after"] == "sync":
        diag.sync_checks = True
        prov.synchronize()
        diag.checkpoint(f"{label}#{rnd} after sync", inner)
    elif cfg["after"] == "gc":
        gc.collect()
        diag.checkpoint(f"{label}#{rnd} after gc.collect", inner)
    try:
        got = s.stream(PROMPTS, max_new_tokens=NEW).run()
    except BaseException as exc:  # noqa: BLE001 - the defect: report, then fail the variant
        say(event="next_stream_failed", model=label, round=rnd, error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc(limit=12))
        diag.probe(getattr(getattr(inner, "stream", None), "ptr", 0))  # before any event query
        diag.sync_checks = True
        diag.checkpoint(f"{label}#{rnd} after the failure", inner)
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
    def checkpoint(self, tag: str, provider) -> dict:
        say(event="checkpoint", tag=tag)
        return {}

    def probe(self, stream_ptr: int) -> None:
        say(event="probe")

    sync_checks = False


def child(cfg: dict) -> int:
    global _CPU
    import faulthandler

    faulthandler.enable()
    sys.path.insert(0, str(ROOT))
    if cfg.get("after") == "gcoff":
        import gc

        gc.disable()
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
    gpu.synchronize()
    say(event="result", ok=ok)
    return 0 if ok else 1


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
           or c["DESTROYED_EVENT_SLOTS"]["alive"]
           or c["ctx_synchronize"] not in ("None", "CUDA_SUCCESS")
           or any(v not in ("CUDA_SUCCESS", "CUDA_ERROR_NOT_READY") for v in c["slot_events"].values())]
    return dict(name=cfg["name"], rc=rc, seconds=round(time.time() - t0, 1),
                first_error=first.group(0) if first else None,
                failed_at=[f"{f['model']}#{f['round']}: {f['error'][:160]}" for f in failed],
                odd_checkpoints=odd[:3],
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
            print(f"    checkpoint {c['tag']}: destroyed-event slots={c['DESTROYED_EVENT_SLOTS']} "
                  f"ctx={c['ctx']} sync={c['ctx_synchronize']} "
                  f"stream={c['stream_query']} dup={c['duplicate_event_handles']} events={c['slot_events']}")
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

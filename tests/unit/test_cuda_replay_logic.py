"""The bookkeeping of the cuda provider's eager launch replay (providers/cuda/replay.py),
checked without a GPU: a stand-in ``cupy`` module supplies the array type and the current
stream, and the driver launch is replaced by a recorder. The GPU tests (tests/cuda/test_replay.py)
check that replayed steps are bitwise the launchers' steps on real kernels."""

import ctypes
import sys
import types

import numpy as np
import pytest

from providers.cuda import replay
from providers.cuda.ops import group_query_attention as gqa
from providers.cuda.tuning import Tuning


class FakeArray:
    """Enough of cupy.ndarray for the replay code: a device pointer and a shape."""

    def __init__(self, ptr, shape=(4,)):
        self.data = types.SimpleNamespace(ptr=ptr)
        self.shape = shape


@pytest.fixture
def fake_cupy(monkeypatch):
    stream = types.SimpleNamespace(ptr=0x5151)
    cupy = types.SimpleNamespace(ndarray=FakeArray,
                                 cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    fired = []
    monkeypatch.setattr(replay, "_launch", lambda *args: fired.append(args))
    monkeypatch.setattr(replay, "_pdl_rows", None)  # no provider with PDL has launched yet
    monkeypatch.setattr(replay, "_rows", None)
    return fired


class Ctx:
    def __init__(self):
        self.frozen = False
        self.transient = False
        self.cache = {}
        self.kv_layout = "head_major"


def make_op(calls, spoil=False, python_int=False):
    """An op whose launcher 'launches' one kernel (fn 0xF00) over its input and output."""
    out = FakeArray(0xB000)

    def run(ctx, x, n=None):
        calls.append(n)
        scalar = 3 if python_int else np.int32(3)
        replay.record(0xF00, (2,), (128,), (x, out, scalar), 64)
        if spoil:
            replay.not_replayable()
        return (out,)

    return run, out


def test_same_inputs_fire_the_recorded_launch_instead_of_the_launcher(fake_cupy):
    calls = []
    run, out = make_op(calls)
    kernel, ctx, x = replay.ReplayKernel(run), Ctx(), FakeArray(0xA000)
    assert kernel(ctx, x) == (out,) and calls == [None] and fake_cupy == []
    assert kernel(ctx, x) == (out,) and calls == [None]  # launcher not run again
    (fn, gx, gy, gz, bx, by, bz, shared, stream, params), = fake_cupy
    assert (fn, gx, gy, gz, bx, by, bz, shared, stream) == (0xF00, 2, 1, 1, 128, 1, 1, 64, 0x5151)
    # the packed parameter array points at the argument values: two pointers and an int32
    pointers = (ctypes.c_uint64 * 3).from_address(params)
    assert ctypes.c_uint64.from_address(pointers[0]).value == 0xA000
    assert ctypes.c_uint64.from_address(pointers[1]).value == 0xB000
    assert ctypes.c_int32.from_address(pointers[2]).value == 3


def test_other_inputs_or_host_values_run_the_launcher(fake_cupy):
    calls = []
    run, _ = make_op(calls)
    kernel, ctx, x = replay.ReplayKernel(run), Ctx(), FakeArray(0xA000)
    kernel(ctx, x, np.array([5]))
    kernel(ctx, FakeArray(0xA000), np.array([5]))  # inputs match by identity, not by pointer
    kernel(ctx, x, np.array([5]))  # the memo keeps the last call only: x was replaced
    kernel(ctx, x, np.array([6]))  # another host value
    kernel(ctx, x, np.array([6]))  # the only replay
    assert [int(n[0]) for n in calls] == [5, 5, 5, 6] and len(fake_cupy) == 1


def test_frozen_contexts_always_run_the_launcher(fake_cupy):
    calls = []
    run, _ = make_op(calls)
    kernel, ctx, x = replay.ReplayKernel(run), Ctx(), FakeArray(0xA000)
    kernel(ctx, x)
    ctx.frozen = True  # capture: the context must see every buffer request
    kernel(ctx, x)
    kernel(ctx, x)
    assert len(calls) == 3 and fake_cupy == []


def test_transient_runs_neither_replay_nor_replace_the_decode_record(fake_cupy):
    calls = []
    run, _ = make_op(calls)
    kernel, ctx, x = replay.ReplayKernel(run), Ctx(), FakeArray(0xA000)
    kernel(ctx, x)  # a decode step: recorded
    record = replay.run_memos(ctx)["replay"]
    ctx.transient = True  # a prefill: its buffers die after the run, so nothing may hold them
    prompt = FakeArray(0xC000)
    kernel(ctx, prompt)
    kernel(ctx, x)  # even the decode step's inputs: the launcher runs
    assert len(calls) == 3 and fake_cupy == [] and replay.run_memos(ctx)["replay"] is record
    ctx.transient = False
    kernel(ctx, x)  # the next decode step replays the decode record
    assert len(calls) == 3 and len(fake_cupy) == 1


@pytest.mark.parametrize("kw", [{"spoil": True}, {"python_int": True}])
def test_launchers_with_unrecorded_work_are_never_replayed(fake_cupy, kw):
    calls = []
    run, _ = make_op(calls, **kw)
    kernel, ctx, x = replay.ReplayKernel(run), Ctx(), FakeArray(0xA000)
    before = replay.stats()["unreplayable"]
    for _ in range(3):
        kernel(ctx, x)
    assert len(calls) == 3 and fake_cupy == []
    assert replay.stats()["unreplayable"] == before + 3


def test_gqa_replay_key_ignores_the_growing_total_but_not_the_phase_or_capacity(fake_cupy):
    ctx = Ctx()
    q, kv = FakeArray(1, (2, 1, 96)), FakeArray(2, (2, 1, 64, 32))  # past [B, Nkv, cap=64, H]
    seqlens = FakeArray(3, (2,))

    def key(q_, total):
        return gqa.replay_key(ctx, q_, None, None, kv, kv, seqlens, np.array([total], np.int32))

    assert key(q, 10) == key(q, 11) == key(q, 64)  # decode steps
    assert key(q, 64) != key(q, 65)  # past the KV capacity: the launcher must raise
    prompt = FakeArray(4, (2, 7, 96))
    assert key(prompt, 7) != key(prompt, 9)  # first prompt vs a later chunk


def test_pdl_launch_builds_its_config_once_per_stream(fake_cupy, monkeypatch):
    """With programmatic dependent launch on, a prepared launch goes through cuLaunchKernelEx
    (here a recorder) with a launch config built once per stream, never through cuLaunchKernel."""
    monkeypatch.setattr(replay, "_pdl_rows", replay.pdl_rows(Tuning(), capable=True))  # a provider with PDL
    monkeypatch.setattr(replay, "_rows", 1)  # made as a one-row node makes it (the PDL rows rule)
    configs, ex = [], []
    monkeypatch.setattr(replay, "_pdl_config", lambda dims, shared, stream: configs.append((dims, shared, stream))
                        or ("cfg", stream))
    monkeypatch.setattr(replay, "_launch_ex", lambda fn, cfg, params: ex.append((fn, cfg, params)))
    launch = replay.Launch(0xF00, (2, 3), (128,), (FakeArray(0xA000), np.int32(7)), 64)
    launch.fire(0x5151)
    launch.fire(0x5151)
    launch.fire(0x6262)
    assert configs == [((2, 3, 1, 128, 1, 1), 64, 0x5151), ((2, 3, 1, 128, 1, 1), 64, 0x6262)]
    assert [e[1] for e in ex] == [("cfg", 0x5151), ("cfg", 0x5151), ("cfg", 0x6262)]
    assert all(e[0] == 0xF00 and e[2] == launch.params for e in ex)
    assert fake_cupy == []  # the plain launch was never used


@pytest.mark.parametrize("limit,pdl_rows", [("16", [1, 8, 16]), ("8", [1, 8]), ("all", [1, 8, 16, 17, 4096])])
def test_pdl_takes_only_the_launches_of_nodes_of_few_rows(fake_cupy, monkeypatch, limit, pdl_rows):
    """With PDL on, a node's launches take cuLaunchKernelEx only when its first device input has
    at most ``Tuning.pdl_rows`` rows (elements over the last dimension); a recorded launch
    keeps that choice when it is replayed, and a launch made before any node never takes it."""
    monkeypatch.setattr(replay, "_pdl_config", lambda dims, shared, stream: "cfg")
    ex = []
    monkeypatch.setattr(replay, "_launch_ex", lambda fn, cfg, params: ex.append(fn))
    rule, took = replay.pdl_rows(Tuning(pdl_rows=limit), capable=True), []
    for rows in (1, 8, 16, 17, 4096):
        run, _ = make_op([])
        kernel, ctx = replay.ReplayKernel(run, pdl_rows=rule), Ctx()
        shape = (rows // 8, 8, 64) if rows % 8 == 0 and rows > 8 else (rows, 64)  # rows over leading dims
        x = FakeArray(0xA000, shape)
        kernel(ctx, x)  # the launcher records its launch
        ex.clear()
        kernel(ctx, x)  # same inputs: the recorded launch is fired
        if ex:
            took.append(rows)
    assert took == pdl_rows
    plain = len(fake_cupy)
    replay._rows = None
    replay.Launch(0xF01, (1,), (32,), (np.int32(1),), 0).fire(0x5151)  # before any node
    assert len(fake_cupy) == plain + 1


@pytest.mark.parametrize("tuning,capable,rule", [
    (Tuning(), True, 16), (Tuning(pdl_rows="all"), True, 1 << 62), (Tuning(pdl_rows="8"), True, 8),
    (Tuning(pdl=False), True, None), (Tuning(), False, None)])
def test_the_pdl_rule_is_the_tunings_where_the_device_can(tuning, capable, rule):
    assert replay.pdl_rows(tuning, capable=capable) == rule


def test_two_providers_in_one_process_keep_their_own_pdl_rule(fake_cupy, monkeypatch):
    """Each node launches under its own provider's rule (its ReplayKernel's), whatever ran
    before it: one with PDL on takes cuLaunchKernelEx, one with PDL off the plain launch; a
    provider's own launches after a node take that node's rule."""
    monkeypatch.setattr(replay, "_pdl_config", lambda dims, shared, stream: "cfg")
    ex = []
    monkeypatch.setattr(replay, "_launch_ex", lambda fn, cfg, params: ex.append(fn))
    on, off = replay.pdl_rows(Tuning(), capable=True), replay.pdl_rows(Tuning(pdl=False), capable=True)
    fired = {}
    for name, rule in (("on", on), ("off", off), ("on again", on)):
        run, _ = make_op([])
        kernel, ctx, x = replay.ReplayKernel(run, pdl_rows=rule), Ctx(), FakeArray(0xA000, (1, 64))
        kernel(ctx, x)
        ex.clear()
        plain = len(fake_cupy)
        kernel(ctx, x)
        fired[name] = (len(ex), len(fake_cupy) - plain)
        replay.Launch(0xF01, (1,), (32,), (np.int32(1),), 0).fire(0x5151)  # the provider's own, after the node
        fired[name] += (len(ex) - fired[name][0],)
    assert fired == {"on": (1, 0, 1), "off": (0, 1, 0), "on again": (1, 0, 1)}
    assert replay.use_pdl(None) == on and replay.use_pdl(off) is None


@pytest.mark.parametrize("regs,threads,blocks", [(64, 256, 4), (124, 256, 2), (128, 256, 2), (136, 256, 1),
                                                 (174, 256, 1), (64, 224, 4), (32, 256, 8), (16, 128, 16)])
def test_blocks_per_multiprocessor_follows_registers_and_threads(monkeypatch, regs, threads, blocks):
    """Kernel.blocks_per_multiprocessor, the split-K rule's input: registers allocated per warp
    in units of 256 against an H200's 65,536 per multiprocessor, and at most 2,048 threads."""
    from providers.cuda import module

    attrs = {"MaxRegistersPerMultiprocessor": 65536, "MaxThreadsPerMultiProcessor": 2048}
    device = types.SimpleNamespace(attributes=attrs)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: device)))
    monkeypatch.setattr(module, "_RESIDENT", {})
    raw = types.SimpleNamespace(num_regs=regs, kernel=types.SimpleNamespace(ptr=0xA000 + regs))
    assert module.Kernel(raw).blocks_per_multiprocessor(threads) == blocks

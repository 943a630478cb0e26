"""Run-ahead on the cuda provider (GPU only): download_async copies through pinned slots behind
the queued work, and decode loops that queue steps before reading the last one give the bits of
the synchronous loop, with captured replays, at batch 1 and 8."""

import numpy as np
import pytest
from _gpu import require_gpu

cupy = require_gpu()

from core.generation.loop import decode  # noqa: E402
from core.runtime.runner import Runner  # noqa: E402
from core.session import Session  # noqa: E402


def test_download_async_is_the_tensor_as_the_queued_work_left_it(gpu):
    gpu.own_stream()  # the CuPy expression below launches on the current stream
    t = gpu.upload(np.arange(4096, dtype=np.int32))
    handles = []
    for _ in range(6):  # more handles than free slots at first: slots are made, then reused
        handles.append(gpu.download_async(t))
        t += 1  # a kernel queued behind the copy (the provider stream is the current one)
    for i, h in reversed(list(enumerate(handles))):  # read out of order
        assert np.array_equal(h.wait(), np.arange(4096) + i)
        assert h.wait() is h.wait()  # read once, kept
    again = gpu.download_async(t)  # a slot given back is reused
    assert len(gpu._pinned_free) >= 5
    assert np.array_equal(again.wait(), np.arange(4096) + 6)


@pytest.fixture(scope="module")
def runner(model_dir, gpu):
    return Runner(model_dir, gpu)


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_running_ahead_equals_the_synchronous_loop_bitwise(runner, batch):
    rng = np.random.default_rng(3)
    rows = [list(rng.integers(3, 200, 4 + b % 5)) for b in range(batch)]
    out = {}
    for ahead in (False, True):
        s = Session(runner, batch=batch, capacity=96, kv_policy="fixed", run_ahead=ahead)
        t = decode(s, rows, 40)
        out[ahead] = (t, s.counters, s.step().tokens)
        s.close()
    (sync, cs, next_sync), (got, ca, next_ahead) = out[False], out[True]
    assert np.array_equal(got.tokens, sync.tokens) and np.array_equal(next_ahead, next_sync)
    assert ca.run_ahead_steps >= 35 and cs.run_ahead_steps == 0
    assert ca.replays >= 35 and not ca.fallbacks  # captured steps ran ahead
    assert all(d is not None and d > 0 for d in got.device_seconds)
    assert ca.decode_device_s <= ca.decode_s * 1.05  # device time cannot exceed the wall time


def test_a_stopped_generation_undoes_its_queued_steps_on_the_gpu(runner):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    s = Session(runner, batch=3, capacity=96, kv_policy="fixed", run_ahead=False)
    full = [r.output_ids for r in s.stream(prompts, max_new_tokens=12).run()]
    s.close()
    stops = [[row[min(4, len(row) - 1)]] for row in full]  # every row ends early
    got = {}
    for ahead in (False, True):
        s = Session(runner, batch=3, capacity=96, kv_policy="fixed", run_ahead=ahead)
        rows = s.stream(prompts, max_new_tokens=12, stop_token_ids=stops).run()
        got[ahead] = ([r.output_ids for r in rows], s.lengths.tolist(), s.step().tokens.tolist(),
                      s.counters.discarded_steps)
        s.close()
    assert got[True][:3] == got[False][:3]
    assert got[True][3] > 0 and got[False][3] == 0


def test_a_stream_block_around_the_caller_does_not_split_a_step(runner):
    """CuPy's ``with stream:`` leaves the null stream current on exit; the provider makes its
    own stream current again before a step, so run-ahead still reads each step's own tokens
    (before the guard, every read returned the prefill's token)."""
    rows = [[5, 6, 7, 8], [9, 10]]
    want = decode(Session(runner, batch=2, capacity=64, kv_policy="fixed", run_ahead=False), rows, 12).tokens
    with cupy.cuda.Stream(non_blocking=True):
        pass
    assert cupy.cuda.get_current_stream().ptr != runner.provider.stream.ptr  # what the caller left
    got = decode(Session(runner, batch=2, capacity=64, kv_policy="fixed", run_ahead=True), rows, 12).tokens
    assert np.array_equal(got, want)
    assert cupy.cuda.get_current_stream().ptr == runner.provider.stream.ptr

"""Weight memory on the GPU: one resident copy per weight, in the layout the kernels read.

- the device packing (CuPy) is bitwise the host packing (NumPy) the CPU tests check against
  the fragment order (dense fp16 and int4);
- after a Runner loads a model, the CuPy pool holds the runner's weight bytes (to its 512-byte
  rounding), those are the model's weight bytes exactly (the builder's shapes are aligned, so
  packing pads nothing), no raw weight a hook replaced is left, and the tied embedding is the
  lm_head's weight (one packed constant, fp16 and int4);
- the load's peak is the weights plus one node's transient;
- a plan whose weights are prepared computes the bits of the same plan unprepared (the kernels
  then pack per call), so preparing changes no output;
- ``lockstep profile`` accounts its peak: weights + KV + workspace never exceed it.

    pytest -m cuda tests/cuda/test_cuda_weight_memory.py -v -s
"""

import numpy as np
import pytest
from _gpu import require_gpu

cupy = require_gpu()

from core.executor import is_host_constant, storage  # noqa: E402
from core.models.model import load_model  # noqa: E402
from core.runtime.runner import Runner  # noqa: E402
from providers.cuda.ops import _mma_layout  # noqa: E402
from providers.cuda.provider import CudaProvider  # noqa: E402


class Unprepared(CudaProvider):
    """The cuda provider without its prepare hooks: raw weights resident, packed per call."""

    def prepare(self, node):
        return None


@pytest.mark.parametrize("k,n", [(64, 16), (100, 37), (576, 1536), (2048, 24)])
def test_device_packing_is_the_host_packing(gpu, k, n):
    rng = np.random.default_rng(k + n)
    w, up = (rng.standard_normal((k, n)).astype(np.float16) for _ in range(2))
    dw, dup = cupy.asarray(w), cupy.asarray(up)
    assert np.array_equal(_mma_layout.pack(cupy, dw).get(), _mma_layout.pack(np, w))
    assert np.array_equal(_mma_layout.pack(cupy, dw, dup).get(), _mma_layout.pack(np, w, up))
    codes = rng.integers(0, 256, (n, 3, 8)).astype(np.uint8), rng.integers(0, 256, (n, 3, 8)).astype(np.uint8)
    host = _mma_layout.glu_interleave(np, *(c.reshape(n, -1) for c in codes))
    device = _mma_layout.glu_interleave(cupy, *(cupy.asarray(c).reshape(n, -1) for c in codes))
    assert np.array_equal(device.get(), host)
    # the int4 layout (_mma_layout.pack_int4), with and without zero points, K aligned or not
    if k % 16 == 0:
        scales = rng.random((n, -(-k // 32))).astype(np.float16)
        q = rng.integers(0, 256, (n, scales.shape[1], 16)).astype(np.uint8)
        zp = rng.integers(0, 256, (n, -(-scales.shape[1] // 2))).astype(np.uint8)
        for z in (None, zp):
            want = _mma_layout.pack_int4(np, q, scales, z, n, k, 32)
            got = _mma_layout.pack_int4(cupy, cupy.asarray(q), cupy.asarray(scales),
                                        None if z is None else cupy.asarray(z), n, k, 32)
            for a, b in zip(got[:3], want[:3]):
                assert (a is None and b is None) or (np.array_equal(a.get(), b) and a.dtype == b.dtype)


def _load(model_dir, provider):
    """(Runner, pool bytes the load left in use); earlier tests' garbage is collected first,
    so no block of theirs is freed while this load is measured."""
    import gc

    gc.collect()
    pool = cupy.get_default_memory_pool()
    provider.synchronize()
    provider.reset_peak()
    before = pool.used_bytes()
    runner = Runner(model_dir, provider)
    provider.synchronize()
    return runner, pool.used_bytes() - before


def test_resident_weights_are_the_model_weights_once_in_the_kernels_layout(model_dir, gpu):
    model = load_model(model_dir)
    runner, used = _load(model_dir, gpu)
    plan = runner.plan
    device = [v for v in plan.constants.values() if isinstance(v, cupy.ndarray)]
    weights = sum(a.nbytes for a in model.initializers.values() if not is_host_constant(a))
    print(f"\n{model_dir}: weights {runner.weight_bytes:,} B (model {weights:,} B), pool used {used:,} B, "
          f"load peak {plan.load_peak_bytes:,} B")
    # the counter is the truth, and the truth is one copy of every weight
    assert runner.weight_bytes == plan.weight_bytes() == weights
    assert runner.weight_bytes <= used <= runner.weight_bytes + 512 * len(device)
    # no raw weight a hook replaced is left: compare with the plan the hooks did not touch
    raw = Unprepared()
    bare = Runner(model_dir, raw).plan
    replaced = {x for a, b in zip(bare.nodes, plan.nodes) for x, y in zip(a.inputs, b.inputs) if x != y and x}
    assert not replaced & set(plan.constants)
    if model.io_dtype == np.float16:
        assert replaced  # fp16 dense weights packed, int4 gate/up pairs interleaved
    # the tied embedding is the lm_head's weight
    lookups = ("GatherColumns", "GatherBlockQuantized")
    (lookup,) = [plan.nodes[i] for i in plan.steps if plan.nodes[i].op_type in lookups]
    (lm_head,) = [plan.nodes[i] for i in plan.steps if plan.nodes[i].name.startswith("/lm_head/")]
    table, head = plan.constants[lookup.inputs[0]], plan.constants[lm_head.inputs[1]]
    assert storage(table) is storage(head)
    # the load's peak: the weights plus one node's raw inputs and their transient
    largest = max(a.nbytes for a in model.initializers.values())
    assert plan.load_peak_bytes is not None
    assert plan.load_peak_bytes <= runner.weight_bytes + 2 * largest + 2**20, (plan.load_peak_bytes, largest)


def test_prepared_weights_compute_the_unprepared_bits(model_dir, gpu):
    """Prefill and 16 captured decode steps of 3 rows: tokens and logits bitwise equal."""
    from core.generation.loop import decode
    from core.session import Session

    rng = np.random.default_rng(11)
    rows = [list(rng.integers(3, 200, 5 + 4 * b)) for b in range(3)]
    runs = []
    for provider in (gpu, Unprepared()):
        session = Session(model_dir, provider, batch=3, capacity=64)
        trace = decode(session, rows, 16, keep_logits=True)
        runs.append((trace.tokens, trace.logits))
        session.close()
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])


def test_profile_peak_covers_weights_kv_and_workspace(model_dir, gpu):
    import gc
    from types import SimpleNamespace

    from core.profile import profile

    args = SimpleNamespace(prompt_len=16, warmup=2, tokens=4, context=64, layout="head_major", no_capture=False)
    # the peak is the process's (the CuPy pool's total and this provider's VMM pages): what other
    # tests of this process still hold (arrays, KV arenas of sessions not yet collected) is in it
    # too, so it is measured first and left out
    gc.collect()
    gpu.reset_peak()
    held = gpu.peak_bytes()
    rows = profile(str(model_dir), gpu, [1, 8], args)
    runner_weights = Runner(model_dir, gpu).weight_bytes
    for r in rows:
        print(f"\nbatch {r.batch}: peak {r.peak_device_bytes:,} = weights {r.weight_device_bytes:,} + KV "
              f"{r.kv_device_bytes:,} + workspace {r.workspace_bytes:,} + other {r.other_bytes:,} "
              f"(held by the process before: {held:,})")
        assert r.row0_matches_batch1 and r.weight_device_bytes == runner_weights
        assert r.kv_device_bytes == r.kv_bytes > 0 and r.workspace_bytes > 0
        assert r.other_bytes >= 0  # nothing counted twice: the holders fit inside the pool's total
        # and nothing beyond them but the prefill's live activations (freed as it went) and slack:
        # the bandwidth probes' GiB buffers once stayed in the pool here
        assert r.other_bytes - held <= 2 * r.prefill_activation_bytes + (64 << 20), (r, held)


def test_bandwidth_probes_give_their_memory_back():
    pool = cupy.get_default_memory_pool()
    keep = cupy.ones(1 << 20, cupy.float32)  # something live while the probes run, as a session would be
    provider = CudaProvider()  # a new provider measures again
    before = pool.total_bytes()
    assert provider.device_bandwidth() > 0 and provider.host_to_device_bandwidth() > 0
    after = cupy.ones(1 << 20, cupy.float32)  # an allocation after the probes: not carved from a probe's chunk
    assert pool.total_bytes() <= before + after.nbytes, (pool.total_bytes(), before)
    del keep, after

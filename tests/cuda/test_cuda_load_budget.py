"""Loading under a budget on the GPU, by the driver's count (cudaMemGetInfo, polled every
millisecond): a model larger than its weight budget loads with the device never holding more
than the budget beyond what it held before (the CUDA context and earlier work, measured as the
baseline, plus :data:`SLACK` for kernel modules loaded on first use), decodes bitwise like the
resident run at batch 1 and 8, eager and captured, with its embedding read in place from
pinned host memory (not resident). An fp32 model's lm_head and projections, and the fp16 and
int4 models' packed lm_head and projections, stream as row-block pages (core.runtime.rowblocks;
the tensor-core pages are whole 16-row tiles of the packed weights, and a page launched on its
rows computes the whole node's columns bitwise).
"""

import gc

import numpy as np
import pytest
from _gpu import require_gpu

require_gpu()

from core.generation.loop import decode  # noqa: E402
from core.runtime import streaming  # noqa: E402
from core.runtime.meter import DriverMeter  # noqa: E402
from core.runtime.runner import Runner  # noqa: E402
from core.session import Session  # noqa: E402

#: Device bytes beyond the budget the driver may show: modules of kernels compiled on first use
#: (NVRTC and CuPy's elementwise kernels) and the pool's rounding.
SLACK = 32 * 2**20
MIB = 2**20


@pytest.fixture(scope="module", params=[None, "int4"], ids=["fp16", "int4"])
def big_model(request, tmp_path_factory):
    """A builder-pattern model of ~100-250 MB (external data): many pages, none dominant; the
    fp16 one with an embedding of its own (a Gather, as the builder writes Llama-3.1-8B), the
    int4 one with the tiny model's tied table (under a budget it folds into its own copy)."""
    from core.testing.tiny_model import TinyConfig, make_tiny_model

    config = TinyConfig(hidden=1024, heads=8, kv_heads=2, head_size=128, intermediate=4096, vocab=16384,
                        layers=6, context=512, tied=request.param is not None)
    return make_tiny_model(tmp_path_factory.mktemp("big"), dtype="float16", quant=request.param, config=config,
                           external=True)


def _rows(batch, vocab):
    rng = np.random.default_rng(5)
    return [list(rng.integers(3, vocab, 3 + (5 * b) % 11)) for b in range(batch)]


def _trace(runner, rows, steps, capture):
    s = Session(runner, batch=len(rows), capacity=128, capture=capture)
    logits = []
    t = decode(s, rows, steps, observer=lambda *_: logits.append(s.last_logits()))
    counters = s.counters
    s.close()
    return t.tokens, np.stack(logits), counters


def _free(gpu):
    gc.collect()
    gpu.synchronize()
    gpu.reset_peak()


def _smallest(model, gpu, page_bytes=None) -> int:
    """The smallest working weight budget, as a one-byte budget's refusal names it."""
    from core.runtime.residency import BudgetError

    with pytest.raises(BudgetError) as info:
        Runner(model, gpu, weight_budget=1, page_bytes=page_bytes)
    return int(str(info.value).rsplit("is ", 1)[1].split()[0].replace(",", ""))


def test_a_model_larger_than_its_budget_loads_within_it_and_decodes_bitwise(big_model, gpu):
    _free(gpu)
    resident = Runner(big_model, gpu)
    total = resident.weight_bytes
    vocab = resident.model.config.vocab_size
    want = {b: _trace(resident, _rows(b, vocab), 16, capture=False) for b in (1, 8)}
    del resident
    _free(gpu)
    budget = max(total // 3, _smallest(big_model, gpu))
    meter = DriverMeter(gpu, interval_s=0.001)
    with meter:
        runner = Runner(big_model, gpu, weight_budget=budget)
    load_peak = meter.peak_bytes - meter.baseline_bytes
    r = runner.residency
    print(f"{big_model.name}: {total / MIB:.0f} MiB of weights under a {budget / MIB:.0f} MiB budget: driver "
          f"+{load_peak / MIB:.1f} MiB while loading ({meter.baseline_bytes / MIB:.0f} MiB before), "
          f"{r.weight_bytes_streamed_per_step / MIB:.0f} MiB streamed per step, "
          f"{r.weight_bytes_mapped / MIB:.0f} MiB mapped, host-prepared {len(runner.placer.host_prepared)} nodes")
    assert r.streams and runner.placer is not None
    assert load_peak <= budget + SLACK, f"the load took {load_peak:,} device bytes for a {budget:,} byte budget"
    assert runner.weight_bytes + r.staging_bytes <= budget
    # the embedding is not resident: it is read in place from pinned host memory
    assert r.mapped and all(streaming.mapped(runner.plan, n) for n in r.mapped)
    table = runner.plan.constants[r.mapped[0]]
    assert table.data.ptr == runner.plan.staged_weights[r.mapped[0]].ctypes.data
    for batch in (1, 8):
        rows = _rows(batch, vocab)
        for capture in (False, True):
            with meter:
                meter.reset()
                got = _trace(runner, rows, 16, capture=capture)
            assert np.array_equal(want[batch][0], got[0]), f"tokens differ (batch {batch}, capture {capture})"
            assert np.array_equal(want[batch][1], got[1]), f"logits differ (batch {batch}, capture {capture})"
            c = got[2]
            assert c.htod_bytes == (c.decode_steps + 1) * r.weight_bytes_streamed_per_step > 0
            if capture:
                assert c.captures == 1 and c.fallbacks == []
            step_peak = meter.peak_bytes - meter.baseline_bytes
            print(f"  batch {batch} capture {capture}: driver +{step_peak / MIB:.1f} MiB")
            # weights and ring within the budget; the KV cache, activations and graphs on top
            assert step_peak <= budget + 64 * MIB + SLACK
    del runner
    _free(gpu)


def test_a_budget_one_byte_below_the_smallest_is_refused_with_that_number(big_model, gpu):
    from core.runtime.residency import BudgetError

    smallest = _smallest(big_model, gpu)
    _free(gpu)
    meter = DriverMeter(gpu, interval_s=0.001)
    with meter:
        runner = Runner(big_model, gpu, weight_budget=smallest)
    assert meter.peak_bytes - meter.baseline_bytes <= smallest + SLACK
    assert runner.weight_bytes + runner.residency.staging_bytes <= smallest
    del runner
    _free(gpu)
    with pytest.raises(BudgetError, match=f"smallest working budget is {smallest:,} bytes"):
        Runner(big_model, gpu, weight_budget=smallest - 1)


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory):
    """An fp32 model of ~130 MB with an untied 32 MiB lm_head (kernels/linear.cu: row blocks)."""
    from core.testing.tiny_model import TinyConfig, make_tiny_model

    config = TinyConfig(hidden=512, heads=8, kv_heads=2, head_size=64, intermediate=1536, vocab=16384,
                        layers=4, context=512, tied=False)
    return make_tiny_model(tmp_path_factory.mktemp("fp32"), dtype="float32", config=config, external=True)


def test_row_block_pages_hold_the_budget_and_decode_bitwise(fp32_model, gpu):
    page = 2 * MIB
    _free(gpu)
    resident = Runner(fp32_model, gpu)
    vocab = resident.model.config.vocab_size
    want = {b: _trace(resident, _rows(b, vocab), 12, capture=False) for b in (1, 8)}
    del resident
    _free(gpu)
    budget = _smallest(fp32_model, gpu, page)
    meter = DriverMeter(gpu, interval_s=0.001)
    with meter:
        runner = Runner(fp32_model, gpu, weight_budget=budget, page_bytes=page)
    r = runner.residency
    head = max(r.weights, key=lambda w: (w.layer < 0 and w.rows is not None, w.nbytes))
    pages = {w.page for w in r.weights if w.node == head.node and w.name in set(r.streamed)}
    head_bytes = sum(w.nbytes for w in r.weights if w.node == head.node)
    load = meter.peak_bytes - meter.baseline_bytes
    print(f"fp32: smallest budget {budget / MIB:.1f} MiB with {page / MIB:.0f} MiB pages; {r.page_ins_per_step} "
          f"pages per step, {r.row_block_pages} row blocks; slot {r.slot_bytes / MIB:.1f} MiB; "
          f"load +{load / MIB:.1f} MiB")
    assert r.page_bytes == page and r.row_block_pages > 0 and len(pages) > 1  # the lm_head is cut
    # the slot is a page or an uncut node (a fused MLP), never the lm_head; the budget is below it
    assert r.slot_bytes < head_bytes / 2 and budget < head_bytes
    assert meter.peak_bytes - meter.baseline_bytes <= budget + SLACK
    assert r.mapped and all(streaming.mapped(runner.plan, n) for n in r.mapped)
    kernels = [h for h in runner.plan.hooks.values() if h.ranges]  # the row-blocked nodes' hooks
    assert kernels and all(len(h.ranges) > 1 for h in kernels)
    for batch in (1, 8):
        rows = _rows(batch, vocab)
        for capture in (False, True):
            before = sum(h.count for h in kernels)
            with meter:
                meter.reset()
                got = _trace(runner, rows, 12, capture=capture)
            assert sum(h.count for h in kernels) > before  # the pages ran (eagerly, or while capturing)
            assert np.array_equal(want[batch][0], got[0]), f"tokens differ (batch {batch}, capture {capture})"
            assert np.array_equal(want[batch][1], got[1]), f"logits differ (batch {batch}, capture {capture})"
            if capture:
                assert got[2].captures == 1 and got[2].fallbacks == []
            assert meter.peak_bytes - meter.baseline_bytes <= budget + 64 * MIB + SLACK
    del runner
    _free(gpu)


def test_tensor_core_pages_are_row_blocks_and_decode_bitwise(big_model, gpu):
    """The packed lm_head and gate/up projections stream as row blocks (whole 16-row tiles of the
    packed weights: providers/cuda/streaming.dense_rows for the fp16 MatMul and SiluGatedMatMul,
    int4_rows for MatMulNBits and SiluGatedMatMulNBits) under 4 MiB pages, within the budget,
    bitwise the resident run, eager and captured."""
    page = 4 * MIB
    _free(gpu)
    resident = Runner(big_model, gpu)
    vocab = resident.model.config.vocab_size
    int4 = any(n.op_type.endswith("MatMulNBits") for n in resident.plan.nodes)
    want = {b: _trace(resident, _rows(b, vocab), 12, capture=False) for b in (1, 8)}
    del resident
    _free(gpu)
    budget = _smallest(big_model, gpu, page)
    meter = DriverMeter(gpu, interval_s=0.001)
    with meter:
        runner = Runner(big_model, gpu, weight_budget=budget, page_bytes=page)
    r = runner.residency
    cut = {w.node for w in r.weights if w.rows is not None}
    ops = {runner.plan.nodes[i].op_type for i, h in runner.plan.hooks.items() if h.ranges}
    print(f"{'int4' if int4 else 'fp16'}: smallest budget {budget / MIB:.1f} MiB with 4 MiB pages; "
          f"{r.row_block_pages} row-block pages of {r.page_ins_per_step}; slot {r.slot_bytes / MIB:.1f} MiB; "
          f"cut {sorted(cut)[:3]}...; ops {sorted(ops)}")
    assert r.row_block_pages > 0 and any("lm_head" in n for n in cut) and any("mlp" in n for n in cut)
    assert ops >= ({"MatMulNBits", "SiluGatedMatMulNBits"} if int4 else {"MatMul", "SiluGatedMatMul"})
    assert r == runner.placer.predicted  # the plan made before loading
    assert meter.peak_bytes - meter.baseline_bytes <= budget + SLACK
    kernels = [h for h in runner.plan.hooks.values() if h.ranges]  # the row-blocked nodes' hooks
    assert kernels and all(len(h.ranges) > 1 for h in kernels)
    for batch in (1, 8):
        rows = _rows(batch, vocab)
        for capture in (False, True):
            before = sum(h.count for h in kernels)
            got = _trace(runner, rows, 12, capture=capture)
            assert sum(h.count for h in kernels) > before  # the pages ran (eagerly, or while capturing)
            assert np.array_equal(want[batch][0], got[0]), f"tokens differ (batch {batch}, capture {capture})"
            assert np.array_equal(want[batch][1], got[1]), f"logits differ (batch {batch}, capture {capture})"
            if capture:
                assert got[2].captures == 1 and got[2].fallbacks == []
    del runner
    _free(gpu)


@pytest.mark.parametrize("tuning", ["default", "wide", "pipeline"])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("m,k", [(1, 1024), (8, 4096), (40, 200), (64, 2304), (300, 1024)])
def test_a_page_of_a_packed_fp16_weight_computes_the_whole_nodes_columns(m, k, glu, tuning):
    """Rows a:b (whole 16-row tiles; GLU: 2a:2b) of the 3-D packed fp16 weight, launched with N =
    b - a, give columns a:b of the whole node's output bitwise, whatever kernel and grid the
    launcher picks for either (the schedules of kernels/linear_mma.cu never change a bit), and
    the launches ran (no NaN left of the output's fill)."""
    from attrs import evolve

    from providers.cuda.ops import NULL, _mma, _mma_layout
    from providers.cuda.tuning import Tuning

    cupy = pytest.importorskip("cupy")
    t = Tuning()
    t = {"default": t, "wide": evolve(t, gemm_wide="all"), "pipeline": evolve(t, gemm_pipeline="all")}[tuning]
    rng = np.random.default_rng(m + k)
    n = 112
    w, up = (rng.standard_normal((k, n)).astype(np.float16) * np.float16(k ** -0.5) for _ in range(2))
    whole = cupy.asarray(_mma_layout.pack(np, w, up if glu else None).reshape(_mma_layout.packed_shape(k, n, glu)))
    assert _mma_layout.packed_rows(whole, glu) == n
    x = cupy.asarray(rng.standard_normal((m, k)).astype(np.float16))
    y = cupy.full((m, n), np.nan, np.float16)
    _mma.dense(x, whole, None, y, m, n, k, NULL, glu=glu, tuning=t)
    want = y.get()
    assert not np.isnan(want).any()
    per = 2 if glu else 1
    for a, b in ((0, 16), (16, 64), (64, 112), (0, 112)):
        page = whole[per * a:per * b]
        assert page.flags.c_contiguous and _mma_layout.packed_rows(page, glu) == b - a
        got = cupy.full((m, b - a), np.nan, np.float16)
        _mma.dense(x, page, None, got, m, b - a, k, NULL, glu=glu, tuning=t)
        assert np.array_equal(got.get().view(np.uint16), want[:, a:b].view(np.uint16)), (a, b)


def test_a_replan_gives_the_moved_weights_device_memory_back(big_model, gpu):
    """KV growth under a device budget streams more weights: their device copies must go back at
    once, though eager replay had kept every node's last arguments (providers/cuda/replay.py)."""
    _free(gpu)
    runner = Runner(big_model, gpu, device_budget=3 * Runner(big_model, gpu).weight_bytes)
    _free(gpu)
    total = runner.weight_bytes
    assert not runner.residency.streams
    _trace(runner, _rows(8, runner.model.config.vocab_size), 4, capture=False)  # replay memos filled
    pool = gpu.cupy.get_default_memory_pool()
    gc.collect()
    before = pool.used_bytes()
    # half the weights must give way (beside the workspace the trace's state reserved)
    assert runner.reserve_kv(3 * total - total // 2 - runner.workspace_reserved) is not None
    gc.collect()
    r = runner.residency
    moved = sum(w.nbytes for w in r.weights if w.name in set(r.streamed))
    freed = before - pool.used_bytes()
    print(f"re-plan: {moved / MIB:.0f} MiB streamed now, {freed / MIB:.0f} MiB given back, ring "
          f"{r.staging_bytes / MIB:.0f} MiB")
    assert moved > 0 and freed >= moved - r.staging_bytes - SLACK
    del runner
    _free(gpu)


def test_a_device_budget_holds_the_kv_and_the_workspace_by_the_drivers_count(big_model, gpu):
    """Under a device budget the decode workspace (activations, split-K and split-KV scratch,
    the state's buffers: core.runtime.workspace) is reserved beside the KV cache, so the
    driver's figure stays within the budget (plus SLACK) through load, prefill and decode,
    eager and captured, and the tokens are the resident run's."""
    _free(gpu)
    resident = Runner(big_model, gpu)
    total, vocab = resident.weight_bytes, resident.model.config.vocab_size
    rows = _rows(8, vocab)
    want = _trace(resident, rows, 16, capture=False)
    s = Session(resident, batch=8, capacity=128)
    kv, work = resident.kv_device_bytes, resident.workspace_reserved
    s.close()
    del resident, s
    _free(gpu)
    budget = max(total // 3, _smallest(big_model, gpu)) + kv + work
    meter = DriverMeter(gpu, interval_s=0.001)
    with meter:
        runner = Runner(big_model, gpu, device_budget=budget)
        for capture in (False, True):
            got = _trace(runner, rows, 16, capture=capture)
            assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1]), f"capture {capture}"
    peak = meter.peak_bytes - meter.baseline_bytes
    held = runner.memory()
    print(f"{big_model.name}: device budget {budget / MIB:.0f} MiB (KV {kv / MIB:.1f}, workspace "
          f"{work / MIB:.1f} MiB reserved): driver +{peak / MIB:.1f} MiB, "
          f"allocator workspace {held.workspace / MIB:.1f} MiB")
    assert runner.residency.streams and runner.workspace_reserved == work
    assert held.workspace <= work, "the workspace allocated is more than the one reserved"
    assert peak <= budget + SLACK, f"the run took {peak:,} device bytes for a {budget:,} byte device budget"
    del runner
    _free(gpu)

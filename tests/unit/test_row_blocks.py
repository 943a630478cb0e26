"""Row-block pages on cpu_reference: under a budget that forces them, the lm_head and the
projections stream as pages of their output rows (a node runs once per page), the staging slot
is the page size, the embedding stays in host memory, the smallest working budget falls far
below the lm_head's bytes, and tokens and logits are bitwise those of the resident run."""

from collections import Counter

import numpy as np
import pytest

from core.generation.loop import decode
from core.plan import plan_model
from core.runtime import residency, rowblocks, streaming
from core.runtime.residency import BudgetError
from core.runtime.runner import Runner
from core.session import Session
from core.testing.tiny_model import TinyConfig, make_tiny_model
from providers.cpu_reference.ops import rowwise_matmul
from providers.cpu_reference.provider import CpuReferenceProvider

ROWS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3], [4, 4, 4, 4], [7, 8], [9], [1, 2, 3]]
#: page size per model kind: a few row blocks of the lm_head and of the projections
PAGES = {"fp32": 8192, "fp16": 4096, "int4": 2048}


@pytest.fixture(autouse=True)
def small_tensors_stream(monkeypatch):
    """The tiny model's matrices are a few KiB: let everything but norms and biases stream."""
    monkeypatch.setattr(residency, "SMALL_BYTES", 512)


@pytest.fixture(scope="module", params=sorted(PAGES))
def model_dir(request, tmp_path_factory):
    """Untied (the embedding is a table of its own, mapped; the lm_head a MatMul or MatMulNBits)."""
    config = TinyConfig(layers=2, vocab=1024, context=128, tied=False)
    return make_tiny_model(tmp_path_factory.mktemp(f"rows_{request.param}_"),
                           dtype="float16" if request.param == "fp16" else "float32",
                           quant="int4" if request.param == "int4" else None, config=config, external=True)


def page_of(model_dir) -> int:
    return PAGES[model_dir.name.split("_")[1]]


def smallest(model_dir) -> int:
    with pytest.raises(BudgetError) as info:
        Runner(model_dir, CpuReferenceProvider(), weight_budget=1, page_bytes=page_of(model_dir))
    return int(str(info.value).rsplit("is ", 1)[1].split()[0].replace(",", ""))


def tokens_and_logits(runner, rows, steps=6):
    s = Session(runner, batch=len(rows), capacity=64)
    logits = []
    t = decode(s, rows, steps, observer=lambda *_: logits.append(s.last_logits()))
    return t.tokens, np.stack(logits), s.counters


def lm_head(runner) -> residency.Weight:
    """The largest streamable weight read by the last node (the lm_head's weight)."""
    return max((w for w in runner._weights if not residency._pinned(w)), key=lambda w: (w.layer < 0, w.nbytes))


def test_the_products_give_a_row_block_the_bits_of_the_whole_matrix():
    rng = np.random.default_rng(0)
    for k, n in ((64, 96), (256, 1000), (100, 333)):
        w = rng.standard_normal((k, n)).astype(np.float32)
        x = rng.standard_normal((8, k)).astype(np.float32)
        whole = rowwise_matmul(x, w)
        for rows in (16, 48, 256):
            parts = [rowwise_matmul(x, np.ascontiguousarray(w[:, a:b])) for a, b in rowblocks.blocks(n, rows)]
            assert np.array_equal(np.concatenate(parts, -1), whole), (k, n, rows)


def test_row_blocks_decode_bitwise_as_resident_at_the_smallest_budget(model_dir):
    page = page_of(model_dir)
    budget = smallest(model_dir)
    resident = Runner(model_dir, CpuReferenceProvider())
    runner = Runner(model_dir, CpuReferenceProvider(), weight_budget=budget, page_bytes=page)
    r = runner.residency
    assert r.page_bytes == page and r.row_block_pages > 0
    # pages per node: the lm_head and at least one projection of each layer are cut in several
    per_node = Counter(w.node for w in r.weights if w.rows is not None and w.name in set(r.streamed))
    head = lm_head(runner)
    assert per_node[head.page] > 1, per_node
    assert sum(1 for node, count in per_node.items() if "layers." in node and count > 1) >= 2, per_node
    # the slot is a page, not the lm_head; the smallest budget is far below the lm_head's bytes
    assert r.slot_bytes <= 2 * page < head.nbytes
    assert budget < head.nbytes
    whole = residency.smallest_budget(runner._weights, mappable=True)  # pages of whole nodes
    assert budget < whole - head.nbytes // 2
    # the embedding is not resident: read in place from host memory
    assert r.mapped and all(streaming.mapped(runner.plan, name) for name in r.mapped)
    kernels = [h for h in runner.plan.hooks.values() if h.ranges]  # the row-blocked nodes' hooks
    assert kernels and all(len(h.ranges) > 1 for h in kernels)
    for rows in (ROWS[:1], ROWS):
        want_tokens, want_logits, _ = tokens_and_logits(resident, rows)
        before = sum(h.count for h in kernels)
        got_tokens, got_logits, counters = tokens_and_logits(runner, rows)
        assert sum(h.count for h in kernels) > before  # the pages ran
        assert np.array_equal(got_tokens, want_tokens)
        assert np.array_equal(got_logits, want_logits)
        assert counters.page_bytes == page and counters.row_block_pages_per_step == r.row_block_pages
        assert counters.page_ins_per_token > 0


def test_one_byte_below_the_smallest_budget_is_refused_with_that_number(model_dir):
    budget = smallest(model_dir)
    prov = CpuReferenceProvider()
    runner = Runner(model_dir, prov, weight_budget=budget, page_bytes=page_of(model_dir))
    # smallest = what stays resident (small tensors, tables that are not mapped) + the ring of pages
    assert prov.uploaded_bytes + runner.residency.staging_bytes <= budget
    assert runner.residency.slots == 2
    with pytest.raises(BudgetError, match=f"smallest working budget is {budget:,} bytes"):
        Runner(model_dir, CpuReferenceProvider(), weight_budget=budget - 1, page_bytes=page_of(model_dir))


def test_the_plan_from_the_header_cuts_the_same_pages(model_dir):
    page, budget = page_of(model_dir), smallest(model_dir)
    runner = Runner(model_dir, CpuReferenceProvider(), weight_budget=budget, page_bytes=page)
    (row,) = plan_model(model_dir, [1], 64, CpuReferenceProvider(), weight_budget=budget, page_bytes=page)
    assert row.residency.pages == runner.residency.pages
    assert row.row()["page_bytes"] == page and row.row()["row_block_pages_per_step"] == runner.residency.row_block_pages


def test_the_page_size_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(rowblocks.PAGE_ENV, "3MiB")
    assert rowblocks.page_bytes() == 3 * 2**20 and rowblocks.page_bytes(4096) == 4096
    monkeypatch.setenv(rowblocks.PAGE_ENV, "lots")
    with pytest.raises(BudgetError, match="page size"):
        rowblocks.page_bytes()


def _holds(value, target, depth=0) -> bool:
    if value is target:
        return True
    if depth < 3 and isinstance(value, (tuple, list)):
        return any(_holds(v, target, depth + 1) for v in value)
    return False


def test_a_replan_drops_what_node_caches_hold_of_the_weights_it_moves(tmp_path):
    # fp16: each MatMul caches its fp32 conversion beside the weight it came from (as the cuda
    # replay memo keeps a node's last arguments); a KV-growth re-plan must not leave those behind
    folder = make_tiny_model(tmp_path / "m", dtype="float16", config=TinyConfig(layers=2, vocab=1024, tied=False),
                             external=True)
    weights = Runner(folder, CpuReferenceProvider()).plan.step_weight_bytes()
    runner = Runner(folder, CpuReferenceProvider(), device_budget=2 * weights, page_bytes=4096)
    assert not runner.residency.streams
    tokens_and_logits(runner, ROWS[:2], steps=2)
    before = dict(runner.plan.constants)
    least = residency.smallest_budget(runner._weights, mappable=True)
    room = 2 * weights - runner.kv_device_bytes - runner.workspace_reserved  # what the session leaves the weights
    assert runner.reserve_kv(room - (least + weights) // 2) is not None  # the weights must give way
    moved = {n for n in runner.residency.streamed_tensors if before.get(n) is not None}
    assert moved
    for name in moved:
        for ctx in runner.plan.contexts:
            assert not any(_holds(v, before[name]) for v in ctx.cache.values()), (name, ctx.node.name)


class _PackingProvider(CpuReferenceProvider):
    """cpu_reference whose MatMul weights are prepared as W^T and say so in ``ctx.cache`` (as the
    cuda hooks record a packed weight's geometry there): a kernel that lost that record would
    read the streamed copy in the wrong layout."""

    def prepare(self, node):
        if node.op_type != "MatMul":
            return super().prepare(node)

        def hook(ctx, a, w):
            if w is None:
                return None
            ctx.cache["transposed"] = True
            return {1: np.ascontiguousarray(w.T)}
        return hook

    def kernel(self, node):
        run = super().kernel(node)
        if node.op_type != "MatMul":
            return run
        return lambda ctx, a, w: run(ctx, a, np.ascontiguousarray(w.T) if ctx.cache.get("transposed") else w)

    def row_blocks(self, node, shape_of):
        return None  # a transposed weight's output rows are its first axis: not the ONNX split


def test_a_replan_keeps_what_prepare_hooks_recorded(tmp_path):
    folder = make_tiny_model(tmp_path / "m", config=TinyConfig(layers=2, vocab=1024, tied=False), external=True)
    want = tokens_and_logits(Runner(folder, _PackingProvider()), ROWS[:2], steps=8)
    weights = Runner(folder, _PackingProvider()).plan.step_weight_bytes()
    runner = Runner(folder, _PackingProvider(), device_budget=2 * weights)
    assert not runner.residency.streams
    least = residency.smallest_budget(runner._weights, mappable=True)
    assert least < weights
    # KV takes all but a weight budget between the smallest and the whole, beside the traced
    # session's KV and workspace (reserved first, its state pooled): the re-plan streams
    Session(runner, batch=2, capacity=64).close()
    assert not runner.residency.streams
    room = 2 * weights - runner.kv_device_bytes - runner.workspace_reserved
    assert runner.reserve_kv(room - (least + weights) // 2) is not None
    assert runner.residency.streams and any(ctx.cache.get("transposed") for ctx in runner.plan.contexts)
    got = tokens_and_logits(runner, ROWS[:2], steps=8)
    assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])

"""The residency a budget is planned with before loading is the loaded one, on a provider whose
prepare hooks change the weights' sizes and pages (core.runtime.forecast).

``CudaSizes`` is cpu_reference preparing weights as the cuda provider does, without a GPU: the
cuda op modules' hooks run on numpy arrays (their packing is array-module generic), and their
``prepared`` declarations give the forecast. It loads and plans; it does not decode (the
cpu_reference kernels do not read packed weights). The model's widths are not multiples of
16, so the packed forms are padded and larger than the raw weights, and its down projection's
K (136) is not one the int4 kernels pack, so that node keeps its raw weights.
"""

import numpy as np
import pytest
from attrs import evolve as attrs_evolve

from core.ops import OpTable, Spec
from core.protocol import KernelContext, NodeInfo
from core.runtime import residency
from core.runtime.residency import BudgetError
from core.runtime.runner import Runner
from core.testing.tiny_model import TinyConfig, make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider
from providers.cuda import ops as cuda_ops
from providers.cuda.ops import _mma_layout, gather_block_quantized, matmul, matmul_nbits, silu_gated_matmul_nbits
from providers.cuda.streaming import row_blocks as cuda_row_blocks
from providers.cuda.tuning import Tuning


class CudaSizes(CpuReferenceProvider):
    """cpu_reference with the cuda provider's prepare hooks, declarations and row blocks."""

    name = "cuda_sizes"

    def __init__(self):
        super().__init__()
        self.cuda = OpTable(cuda_ops)

    def prepare(self, node):
        return self.cuda.prepare(node)

    def prepared_forms(self, node, inputs):
        declare = self.cuda.prepared(node)
        return None if declare is None else declare(node, *inputs)

    def row_blocks(self, node, shape_of):
        return cuda_row_blocks(node, shape_of)


@pytest.fixture(autouse=True)
def small_tensors_stream(monkeypatch):
    """The tiny model's matrices are a few KiB: let everything but norms and biases stream."""
    monkeypatch.setattr(residency, "SMALL_BYTES", 512)


@pytest.fixture(scope="module", params=["fp16-tied", "fp16-untied", "int4"])
def model_dir(request, tmp_path_factory):
    """fp16 tied (one packed weight for the lm_head and the column gather), fp16 untied (a table
    of its own, mapped) and int4 (the table folds into its own copy, packed apart from the
    lm_head's codes: each pair of codes and scales a form of its own)."""
    config = TinyConfig(layers=3, vocab=200, intermediate=136, context=64, tied=request.param != "fp16-untied")
    return make_tiny_model(tmp_path_factory.mktemp(request.param), dtype="float16",
                           quant="int4" if request.param == "int4" else None, config=config, external=True)


def _smallest(model_dir) -> int:
    with pytest.raises(BudgetError) as info:
        Runner(model_dir, CudaSizes(), weight_budget=1)
    return int(str(info.value).rsplit("is ", 1)[1].split()[0].replace(",", ""))


def _facts(weights):
    return [(w.name, w.nbytes, w.gathered, w.readers, w.aliases, w.page, w.rows) for w in weights]


def test_the_plan_made_before_loading_is_the_loaded_plan(model_dir):
    raw = Runner(model_dir, CpuReferenceProvider()).weight_bytes
    full = Runner(model_dir, CudaSizes()).weight_bytes
    runner = Runner(model_dir, CudaSizes(), weight_budget=full // 2)
    predicted, loaded = runner.placer.predicted, runner.residency
    assert any(":prepared:" in w.name for w in predicted.weights)  # the forecast saw the packed forms
    assert full > raw  # padded: the raw sizes would have planned another residency
    assert _facts(predicted.weights) == _facts(loaded.weights)
    assert predicted == loaded


def test_the_smallest_budget_loads_and_one_byte_less_is_refused_before_any_upload(model_dir):
    smallest = _smallest(model_dir)
    runner = Runner(model_dir, CudaSizes(), weight_budget=smallest)
    assert runner.residency.streams and runner.residency == runner.placer.predicted
    assert runner.weight_bytes + runner.residency.staging_bytes <= smallest
    prov = CudaSizes()
    with pytest.raises(BudgetError, match=f"smallest working budget is {smallest:,} bytes"):
        Runner(model_dir, prov, weight_budget=smallest - 1)
    assert prov.uploaded_bytes == 0 and prov.staged_bytes == 0


class _Host:
    def allocate(self, shape, dtype, zero=False):
        return np.zeros(shape, dtype)


def _declared_as_prepared(module, op, inputs, attrs=None, dtypes=()):
    """The hook's changes on ``inputs`` (numpy arrays or None) and the declaration's on their
    Specs agree: the same inputs replaced, each by an array of the declared shape and dtype, and
    the same inputs dropped. Returns the changes."""
    names = tuple(f"w{i}" if x is not None else "" for i, x in enumerate(inputs))
    node = NodeInfo(name=op, op_type=op, domain=module.DOMAIN, attrs=attrs or {}, inputs=names, outputs=("y",),
                    input_dtypes=tuple(dtypes))
    ctx = KernelContext(node, _Host(), "head_major")
    ctx.cache["prepare_shared"] = {}
    changes = module.prepare(ctx, *inputs)
    declared = module.prepared(node, *[None if x is None else Spec(x.shape, x.dtype, name)
                                       for x, name in zip(inputs, names)])
    assert (changes is None) == (declared is None)
    if changes is not None:
        assert changes.keys() == declared.keys()
        for j, value in changes.items():
            spec = declared[j]
            assert (value is None) == (spec is None)
            if value is not None:
                assert (tuple(value.shape), value.dtype) == (spec.shape, spec.dtype)
    return changes


def _int4(rng, n, k, bs, zp):
    nb = -(-k // bs)
    codes = rng.integers(0, 256, (n, nb, bs // 2), dtype=np.uint8)
    scales = rng.standard_normal((n, nb)).astype(np.float16)
    zeros = rng.integers(0, 256, (n, -(-nb // 2)), dtype=np.uint8) if zp else None
    return codes, scales, zeros


@pytest.mark.parametrize("n, k, bs, zp", [(40, 64, 32, True), (24, 136, 32, False), (48, 96, 64, True)])
def test_each_int4_declaration_is_what_its_hook_makes(n, k, bs, zp):
    rng = np.random.default_rng(n + k)
    attrs = {"K": k, "N": n, "bits": 4, "block_size": bs}
    codes, scales, zeros = _int4(rng, n, k, bs, zp)
    packs = _declared_as_prepared(matmul_nbits, "MatMulNBits", [None, codes, scales, zeros], attrs,
                                  (np.dtype(np.float16),))
    assert (packs is None) == (k % 16 != 0)
    up = _int4(rng, n, k, bs, zp)
    _declared_as_prepared(silu_gated_matmul_nbits, "SiluGatedMatMulNBits", [None, codes, scales, zeros, *up], attrs,
                          (np.dtype(np.float16),))
    table = codes.reshape(n, -1)
    _declared_as_prepared(gather_block_quantized, "GatherBlockQuantized",
                          [table, np.zeros(2, np.int64), scales, zeros], {"bits": 4, "block_size": bs})


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_the_dense_declaration_is_what_its_hook_makes(dtype):
    w = np.ones((72, 200), dtype)
    changes = _declared_as_prepared(matmul, "MatMul", [None, w], dtypes=(np.dtype(dtype), np.dtype(dtype)))
    assert (changes is not None) == (dtype == np.float16)


@pytest.mark.parametrize("n, k, bs, zp", [(64, 128, 32, True), (48, 256, 64, False)])
def test_a_block_of_whole_tiles_of_packed_int4_rows_is_the_packed_block(n, k, bs, zp):
    """Rows a:b (multiples of 16) of the packed codes, scales and zero points are the packing of
    the block's own weights (GLU: rows 2a:2b of the interleaved pair, the pair of the block), so
    a page launch reads the weights of a node of N = b - a (providers/cuda/streaming.int4_rows)."""
    rng = np.random.default_rng(n)
    gate, up = _int4(rng, n, k, bs, zp), _int4(rng, n, k, bs, zp)
    whole = _mma_layout.pack_int4(np, *gate, n, k, bs)
    pair = silu_gated_matmul_nbits.packed(np, n, k, bs, (*gate, *up))
    for a, b in ((0, 16), (16, n)):
        block = _mma_layout.pack_int4(np, *[None if x is None else x[a:b] for x in gate], b - a, k, bs)
        glu = silu_gated_matmul_nbits.packed(np, b - a, k, bs, [None if x is None else x[a:b] for x in (*gate, *up)])
        for part in ("codes", "scales", "zq"):
            if getattr(block, part) is not None:
                assert np.array_equal(getattr(whole, part)[a:b], getattr(block, part))
                assert np.array_equal(getattr(pair, part)[2 * a:2 * b], getattr(glu, part))


def test_int4_nodes_stream_as_row_blocks_planned_before_loading(tmp_path):
    """Small pages cut the int4 lm_head and the fused gate/up projection into row blocks; the
    plan made before loading (over the declared packed shapes) is the loaded one."""
    config = TinyConfig(layers=2, vocab=256, intermediate=128, context=64)
    folder = make_tiny_model(tmp_path, dtype="float16", quant="int4", config=config, external=True)
    page = 4096
    with pytest.raises(BudgetError) as info:
        Runner(folder, CudaSizes(), weight_budget=1, page_bytes=page)
    smallest = int(str(info.value).rsplit("is ", 1)[1].split()[0].replace(",", ""))
    runner = Runner(folder, CudaSizes(), weight_budget=smallest, page_bytes=page)
    r = runner.residency
    cut = {w.node for w in r.weights if w.rows is not None}
    assert r.row_block_pages > 0 and any("lm_head" in n for n in cut) and any("mlp" in n for n in cut)
    assert r == runner.placer.predicted
    with pytest.raises(BudgetError, match=f"smallest working budget is {smallest:,} bytes"):
        Runner(folder, CudaSizes(), weight_budget=smallest - 1, page_bytes=page)


@pytest.fixture
def launches(monkeypatch):
    """The tensor-core launches (expression, grid, block, args, shared) instead of running them."""
    from providers.cuda.ops import _mma

    record = []
    monkeypatch.setattr(_mma, "function", lambda name, expression, expressions:
                        lambda grid, block, args, shared_mem=0: record.append((expression, grid, block, args,
                                                                               shared_mem)))
    return record


def _prepared_ctx(module, op, inputs, attrs):
    names = tuple(f"w{i}" if x is not None else "" for i, x in enumerate(inputs))
    node = NodeInfo(name=op, op_type=op, domain=module.DOMAIN, attrs=attrs, inputs=names, outputs=("y",),
                    input_dtypes=(np.dtype(np.float16),))
    ctx = KernelContext(node, _Host(), "head_major")
    ctx.provider.tuning = Tuning()
    changes = module.prepare(ctx, *inputs)
    # rewired as the plan's prepare pass does: a dropped input is absent
    ctx.node = attrs_evolve(node, inputs=tuple("" if j in changes and changes[j] is None else x
                                               for j, x in enumerate(names)))
    return ctx, [changes.get(j, x) for j, x in enumerate(inputs)]


@pytest.mark.parametrize("glu", [False, True])
def test_a_page_of_a_prepared_int4_node_launches_as_the_node_of_its_rows(launches, glu):
    """Run as row blocks (the executor's row-block launches, core.executor.hooks, over the split cuda declares),
    each page of a prepared MatMulNBits (or SiluGatedMatMulNBits) launches exactly what a
    prepared node of its rows' own weights launches: the page context keeps the prepare hook's
    layout entry and the kernel takes N from the page."""
    from core.executor.hooks import Launch, NodeHooks, block_args, page_contexts
    from core.runtime import rowblocks
    from providers.cuda.streaming import row_blocks as declared

    rng = np.random.default_rng(3)
    n, k, bs = 48, 128, 32
    module, op = (silu_gated_matmul_nbits, "SiluGatedMatMulNBits") if glu else (matmul_nbits, "MatMulNBits")
    weights = [*_int4(rng, n, k, bs, True), *(_int4(rng, n, k, bs, True) if glu else ())]
    attrs = {"K": k, "N": n, "bits": 4, "block_size": bs}
    x = rng.standard_normal((3, k)).astype(np.float16)
    ctx, prepared = _prepared_ctx(module, op, [None, *weights], attrs)
    shapes = {name: getattr(v, "shape", None) for name, v in zip(ctx.node.inputs, prepared) if name}
    split = declared(ctx.node, lambda name: shapes.get(name))
    assert split is not None and split.n == n
    ranges = rowblocks.blocks(n, 16)
    hooks = NodeHooks([Launch(rows=r) for r in ranges], n=split.n, axes=split.axes)
    args = [x, *prepared[1:]]
    for context, launch in zip(page_contexts(ctx, hooks), hooks.launches):
        module.run(context, *block_args(args, hooks, launch))
    pages = list(launches)
    assert len(ranges) == len(pages) == 3
    for (a, b), page in zip(ranges, pages):
        launches.clear()
        own, own_prepared = _prepared_ctx(module, op, [None, *[w[a:b] for w in weights]], {**attrs, "N": b - a})
        module.run(own, x, *own_prepared[1:])
        (alone,) = launches
        assert page[:3] == alone[:3] and page[4] == alone[4] and len(page[3]) == len(alone[3])
        for got, want in zip(page[3], alone[3]):
            assert np.array_equal(np.asarray(got), np.asarray(want)) and np.asarray(got).dtype == np.asarray(want).dtype


def test_lockstep_plan_forecasts_the_loaded_plan_from_the_header(model_dir):
    """``lockstep plan`` (the header alone, nothing read) plans over the same declared forms."""
    from core.plan import plan_model

    budget = Runner(model_dir, CudaSizes()).weight_bytes // 2
    runner = Runner(model_dir, CudaSizes(), weight_budget=budget, page_bytes=4096)
    (row,) = plan_model(model_dir, [1], 64, CudaSizes(), weight_budget=budget, page_bytes=4096)
    assert row.residency == runner.residency and runner.residency.streams

"""fp16 tensor-core nodes stream as row blocks on cuda (docs/large-models.md, "Pages and the page
size"), checked without a GPU: the cuda provider's prepare hooks and declarations run on numpy
arrays (their packing is array-module generic), and the tensor-core launches are recorded
instead of run.

The packed fp16 weight of a MatMul or a SiluGatedMatMul whose N is a multiple of 16 is 3-D,
``[R, ceil(K / 64), 64]`` (``_mma_layout.packed_shape``): its leading axis gives N, and a block
of whole 16-row tiles is a contiguous range of it, the packing of the block's own weights
(providers/cuda/streaming.dense_rows). A page then launches as the node of its rows, and the
budget forecast (core.runtime.forecast, ``lockstep plan``) sees the cut before loading: for a
Llama-3.1-8B-shaped fp16 model the smallest working weight budget at 64 MiB pages drops from
the lm_head's two slots to two pages plus the small tensors.
"""

import os

import numpy as np
import onnx
import pytest
from attrs import evolve as attrs_evolve

from core.ops import OpTable, Spec
from core.protocol import KernelContext, NodeInfo
from core.runtime import residency, rowblocks
from core.runtime.residency import BudgetError
from core.runtime.runner import Runner
from core.testing.tiny_model import TinyConfig, build_graph, genai_config, make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider
from providers.cuda import ops as cuda_ops
from providers.cuda import streaming as cuda_streaming
from providers.cuda.ops import _mma_layout, gather_columns, matmul, silu_gated_matmul
from providers.cuda.tuning import Tuning

MIB = 2**20


class CudaSizes(CpuReferenceProvider):
    """cpu_reference with the cuda provider's prepare hooks, declarations and row blocks (it
    loads and plans; it does not decode: the cpu_reference kernels do not read packed weights).
    ``dense=False``: the row blocks cuda declared before the fp16 cut (fp32 and int4 only)."""

    name = "cuda_sizes"

    def __init__(self, dense: bool = True):
        super().__init__()
        self.cuda = OpTable(cuda_ops)
        self.dense = dense

    def prepare(self, node):
        return self.cuda.prepare(node)

    def prepared_forms(self, node, inputs):
        declare = self.cuda.prepared(node)
        return None if declare is None else declare(node, *inputs)

    def row_blocks(self, node, shape_of):
        if (not self.dense and (node.domain, node.op_type) in cuda_streaming._DENSE
                and cuda_streaming.dense_rows(node, shape_of) is not None):
            return None
        return cuda_streaming.row_blocks(node, shape_of)


class _Host:
    def allocate(self, shape, dtype, zero=False):
        return np.zeros(shape, dtype)


def _node(module, op, inputs):
    names = tuple(f"w{i}" if x is not None else "" for i, x in enumerate(inputs))
    return NodeInfo(name=op, op_type=op, domain=module.DOMAIN, attrs={}, inputs=names, outputs=("y",),
                    input_dtypes=(np.dtype(np.float16),) * len(names))


def _prepared_ctx(module, op, inputs):
    """The node's context after its prepare hook ran, rewired as the plan's prepare pass does
    (a dropped input is absent), and its inputs as the kernel then receives them."""
    node = _node(module, op, inputs)
    ctx = KernelContext(node, _Host(), "head_major")
    ctx.provider.tuning = Tuning()
    ctx.cache["prepare_shared"] = {}
    changes = module.prepare(ctx, *inputs)
    ctx.node = attrs_evolve(node, inputs=tuple("" if j in changes and changes[j] is None else x
                                               for j, x in enumerate(node.inputs)))
    return ctx, [changes.get(j, x) for j, x in enumerate(inputs)]


@pytest.mark.parametrize("k, n, glu", [(96, 48, False), (100, 40, False), (128, 64, True), (64, 24, True)])
def test_the_packed_form_is_3d_when_n_is_whole_tiles_and_declared_so(k, n, glu):
    rng = np.random.default_rng(k + n)
    w, up = (rng.standard_normal((k, n)).astype(np.float16) for _ in range(2))
    module, op, inputs = ((silu_gated_matmul, "SiluGatedMatMul", [None, w, up]) if glu
                          else (matmul, "MatMul", [None, w]))
    ctx, prepared = _prepared_ctx(module, op, inputs)
    packed = prepared[1]
    shape = _mma_layout.packed_shape(k, n, glu)
    assert packed.shape == shape and packed.size == _mma_layout.packed_size(k, n, glu)
    assert np.array_equal(packed.reshape(-1), _mma_layout.pack(np, w, up if glu else None))  # the same elements
    if n % 16 == 0:
        assert shape == ((2 * n if glu else n), -(-k // 64), 64) and _mma_layout.packed_rows(packed, glu) == n
    else:
        assert len(shape) == 1 and _mma_layout.packed_rows(packed, glu) is None
    declared = module.prepared(ctx.node, *[None if x is None else Spec(x.shape, x.dtype, f"w{i}")
                                           for i, x in enumerate(inputs)])
    assert declared[1].shape == packed.shape and declared[1].dtype == packed.dtype
    # the tied lookup reads the lm_head's packed weight: the same form
    lookup = gather_columns.prepared(NodeInfo(name="g", op_type="GatherColumns", domain="lockstep", attrs={},
                                              inputs=("w1", "i"), outputs=("y",)), Spec(w.shape, w.dtype, "w1"), None)
    assert lookup[0].shape == _mma_layout.packed_shape(k, n)


@pytest.mark.parametrize("glu", [False, True])
def test_a_block_of_whole_tiles_of_the_packed_weight_is_the_packed_block(glu):
    """Rows a:b (multiples of 16) of the 3-D packed weight (GLU: rows 2a:2b of the interleaved
    pair) are the packing of columns a:b of the weight (of both)."""
    rng = np.random.default_rng(7)
    k, n = 136, 64
    w, up = (rng.standard_normal((k, n)).astype(np.float16) for _ in range(2))
    whole = _mma_layout.pack(np, w, up if glu else None).reshape(_mma_layout.packed_shape(k, n, glu))
    per = 2 if glu else 1
    for a, b in ((0, 16), (16, 48), (48, 64)):
        block = _mma_layout.pack(np, w[:, a:b], up[:, a:b] if glu else None)
        assert np.array_equal(whole[per * a:per * b].reshape(-1), block)


def _split(module, op, inputs):
    ctx, prepared = _prepared_ctx(module, op, inputs)
    shapes = {name: getattr(v, "shape", None) for name, v in zip(ctx.node.inputs, prepared) if name}
    return cuda_streaming.row_blocks(ctx.node, lambda name: shapes.get(name))


def test_cuda_declares_row_blocks_of_prepared_fp16_nodes_only():
    rng = np.random.default_rng(1)
    w, up = (rng.standard_normal((96, 48)).astype(np.float16) for _ in range(2))
    assert _split(matmul, "MatMul", [None, w]) == rowblocks.RowSplit(48, {1: 0})
    assert _split(silu_gated_matmul, "SiluGatedMatMul", [None, w, up]) == rowblocks.RowSplit(48, {1: 0})
    odd = w[:, :40].copy()
    assert _split(matmul, "MatMul", [None, odd]) is None  # flat: N is not whole tiles
    assert _split(silu_gated_matmul, "SiluGatedMatMul", [None, odd, odd]) is None
    # an fp16 weight left raw (K above the tensor-core kernels' MAX_K) is not cut
    node = _node(matmul, "MatMul", [None, w])
    assert cuda_streaming.row_blocks(node, lambda name: (96, 48)) is None
    # fp32 MatMul: the raw [K, N] split along its columns (kernels/linear.cu), as before
    fp32 = attrs_evolve(node, input_dtypes=(np.dtype(np.float32),) * 2)
    assert cuda_streaming.row_blocks(fp32, lambda name: (96, 48)) == rowblocks.RowSplit(48, {1: 1})


@pytest.fixture
def launches(monkeypatch):
    """The tensor-core launches (expression, grid, block, args, shared) instead of running them."""
    from providers.cuda.ops import _mma

    record = []
    monkeypatch.setattr(_mma, "function", lambda name, expression, expressions:
                        lambda grid, block, args, shared_mem=0: record.append((expression, grid, block, args,
                                                                               shared_mem)))
    return record


@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("glu", [False, True])
def test_a_page_of_a_prepared_fp16_node_launches_as_the_node_of_its_rows(launches, monkeypatch, glu, m):
    """Run as row blocks (the executor's row-block launches over the split cuda declares), each
    page of a prepared MatMul (SiluGatedMatMul) launches exactly what a prepared node of its
    rows' own weights launches: N from the page's leading axis, the weights of its tiles, the
    output of its width. The kernels' arithmetic per output depends on K alone, so the page
    computes the node's bits for its columns (the GPU test checks the bits)."""
    from core.executor.hooks import Launch, NodeHooks, block_args, page_contexts

    monkeypatch.setattr(silu_gated_matmul, "is_host", lambda v: v is None)  # numpy stands for device arrays
    rng = np.random.default_rng(3)
    k, n = 160, 48
    module, op = (silu_gated_matmul, "SiluGatedMatMul") if glu else (matmul, "MatMul")
    weights = [rng.standard_normal((k, n)).astype(np.float16) for _ in range(2 if glu else 1)]
    x = rng.standard_normal((m, k)).astype(np.float16)
    ctx, prepared = _prepared_ctx(module, op, [None, *weights])
    shapes = {name: getattr(v, "shape", None) for name, v in zip(ctx.node.inputs, prepared) if name}
    split = cuda_streaming.row_blocks(ctx.node, lambda name: shapes.get(name))
    assert split is not None and split.n == n
    ranges = rowblocks.blocks(n, 16)
    hooks = NodeHooks([Launch(rows=r) for r in ranges], n=split.n, axes=split.axes)
    args = [x, *prepared[1:]]
    outputs = []
    for context, launch in zip(page_contexts(ctx, hooks), hooks.launches):
        outputs.append(module.run(context, *block_args(args, hooks, launch))[0])
    pages = list(launches)
    assert len(ranges) == 3 and len(pages) == 3 * len(_mma_rows(m))
    per_page = len(pages) // 3
    for p, ((a, b), y) in enumerate(zip(ranges, outputs)):
        assert y.shape == (m, b - a)
        launches.clear()
        own, own_prepared = _prepared_ctx(module, op, [None, *[w[:, a:b] for w in weights]])
        module.run(own, x, *own_prepared[1:])
        alone = list(launches)
        for page, want in zip(pages[p * per_page:(p + 1) * per_page], alone, strict=True):
            assert page[0] == want[0] and page[1:3] == want[1:3] and page[4] == want[4]
            for got, exp in zip(page[3], want[3], strict=True):
                got, exp = np.asarray(got), np.asarray(exp)
                assert np.array_equal(got, exp) and got.dtype == exp.dtype
            assert int(page[3][5]) == (2 * (b - a) if glu else b - a)  # the launch's weight rows: the page's


def _mma_rows(m):
    from providers.cuda.ops import row_slices

    return list(row_slices(m, 32))


def _smallest(folder, provider, page) -> int:
    with pytest.raises(BudgetError) as info:
        Runner(folder, provider, weight_budget=1, page_bytes=page)
    return int(str(info.value).rsplit("is ", 1)[1].split()[0].replace(",", ""))


@pytest.fixture
def small_tensors_stream(monkeypatch):
    """The tiny model's matrices are a few KiB: let everything but norms and biases stream."""
    monkeypatch.setattr(residency, "SMALL_BYTES", 512)


@pytest.mark.parametrize("tied", [False, True])
def test_fp16_nodes_stream_as_row_blocks_planned_before_loading(tmp_path, small_tensors_stream, tied):
    """Small pages cut the fp16 lm_head and the fused gate/up projection into row blocks; the plan
    made before loading (over the declared 3-D packed shapes) is the loaded one, the smallest
    working budget loads and one byte less is refused with it; the cut lowers the smallest
    budget below the uncut one."""
    config = TinyConfig(layers=2, vocab=512, intermediate=128, context=64, tied=tied)
    folder = make_tiny_model(tmp_path, dtype="float16", config=config, external=True)
    page = 8192
    smallest = _smallest(folder, CudaSizes(), page)
    runner = Runner(folder, CudaSizes(), weight_budget=smallest, page_bytes=page)
    r = runner.residency
    cut = {w.node for w in r.weights if w.rows is not None}
    ops = {n.op_type for n in runner.plan.nodes if n.name in cut}
    assert r.row_block_pages > 0 and ops == {"MatMul", "SiluGatedMatMul"}
    assert tied or any("lm_head" in n for n in cut)  # a tied lm_head is read by the lookup too: resident
    assert r == runner.placer.predicted
    assert runner.weight_bytes + r.staging_bytes <= smallest
    with pytest.raises(BudgetError, match=f"smallest working budget is {smallest:,} bytes"):
        Runner(folder, CudaSizes(), weight_budget=smallest - 1, page_bytes=page)
    assert _smallest(folder, CudaSizes(dense=False), page) > smallest


def test_lockstep_plan_forecasts_the_fp16_cut_from_the_header(tmp_path, small_tensors_stream):
    from core.plan import plan_model

    config = TinyConfig(layers=2, vocab=512, intermediate=128, context=64, tied=False)
    folder = make_tiny_model(tmp_path, dtype="float16", config=config, external=True)
    budget = Runner(folder, CudaSizes()).weight_bytes // 2
    runner = Runner(folder, CudaSizes(), weight_budget=budget, page_bytes=8192)
    (row,) = plan_model(folder, [1], 64, CudaSizes(), weight_budget=budget, page_bytes=8192)
    assert row.residency == runner.residency and runner.residency.row_block_pages > 0


#: Llama-3.1-8B's geometry (untied, as the builder writes it).
LLAMA31_8B = TinyConfig(hidden=4096, heads=32, kv_heads=8, head_size=128, intermediate=14336, vocab=128256,
                        layers=32, context=512, tied=False)


def hollow_model(folder, cfg: TinyConfig, dtype: str = "float16"):
    """A builder-pattern model of ``cfg``'s geometry whose external data file is sparse (never
    written): the graph is built at a small width with ``cfg``'s heads and layers, then each
    weight's dims are set to ``cfg``'s and its bytes pointed into the data file. Only headers
    and sizes can be read from it (``lockstep plan``, the forecast)."""
    small = attrs_evolve(cfg, hidden=16, intermediate=16, vocab=16, context=8)
    model = build_graph(small, dtype)
    h, inter, v, qkv = cfg.hidden, cfg.intermediate, cfg.vocab, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_size
    shapes = {"model.embed_tokens.weight": [v, h], "lm_head.MatMul.weight": [h, v], "qkv_proj": [h, qkv],
              "o_proj": [cfg.heads * cfg.head_size, h], "gate_proj": [h, inter], "up_proj": [h, inter],
              "down_proj": [inter, h], "layernorm": [h], "cos_cache": [cfg.context, cfg.head_size // 2],
              "sin_cache": [cfg.context, cfg.head_size // 2]}
    offset = 0
    for t in model.graph.initializer:
        dims = next(s for key, s in shapes.items() if key in t.name)
        size = int(np.prod(dims)) * np.dtype(dtype).itemsize
        del t.dims[:]
        t.dims.extend(dims)
        t.ClearField("raw_data")
        t.data_location = onnx.TensorProto.EXTERNAL
        del t.external_data[:]
        for key, value in (("location", "model.onnx.data"), ("offset", str(offset)), ("length", str(size))):
            t.external_data.add(key=key, value=value)
        offset += -(-size // 4096) * 4096
    for out in model.graph.output:
        if out.name == "logits":
            out.type.tensor_type.shape.dim[2].dim_value = v
    os.makedirs(folder, exist_ok=True)
    onnx.save(model, os.path.join(folder, "model.onnx"))
    with open(os.path.join(folder, "model.onnx.data"), "wb") as f:
        f.truncate(offset)
    import json

    with open(os.path.join(folder, "genai_config.json"), "w") as f:
        json.dump(genai_config(cfg), f)
    return folder


def smallest_weight_budget(folder, page: int, dense: bool = True) -> tuple[int, dict]:
    """The smallest working weight budget ``lockstep plan`` forecasts for ``folder`` on the cuda
    provider's declarations (hooks emulated: :class:`CudaSizes`) at ``page``-byte pages, and
    the splits it planned with."""
    from core.models.model import load_model
    from core.plan import header_splits, header_weights

    model, provider = load_model(folder), CudaSizes(dense)
    weights, splits = header_weights(model, provider), header_splits(model, provider)
    return residency.smallest_budget(weights, None, True, splits, page), splits


def test_an_8b_shaped_fp16_model_plans_below_its_lm_head(tmp_path):
    """Llama-3.1-8B's geometry, fp16, from its header alone: with fp16 row blocks every projection
    and the lm_head are cut, and the smallest working weight budget at 64 MiB pages is two
    pages plus the small tensors (128.4 MiB; docs/large-models.md), where the uncut 1.05 GB
    lm_head set the slot before (1.42 GiB)."""
    folder = hollow_model(tmp_path / "m", LLAMA31_8B)
    before, _ = smallest_weight_budget(folder, 64 * MIB, dense=False)
    after, splits = smallest_weight_budget(folder, 64 * MIB)
    assert len(splits) == 4 * LLAMA31_8B.layers + 1  # qkv, o, gate/up, down per layer; the lm_head
    assert any("lm_head" in n for n in splits)
    head = 4096 * 128256 * 2
    assert before > head and before == 1_521_098_768
    assert 2 * 64 * MIB < after <= 2 * 64 * MIB + MIB and after == 134_619_152


@pytest.mark.parametrize("m", [1, 40, 300])
@pytest.mark.parametrize("glu", [False, True])
def test_a_resident_node_launches_as_it_did_flat(launches, monkeypatch, glu, m):
    """A whole (resident) node launches what it launched when its packed weight was flat: the
    same kernels, grids and arguments, N from the 3-D weight equal to the node's (the same
    bits, batch invariance untouched)."""
    monkeypatch.setattr(silu_gated_matmul, "is_host", lambda v: v is None)
    rng = np.random.default_rng(11)
    k, n = 200, 64
    module, op = (silu_gated_matmul, "SiluGatedMatMul") if glu else (matmul, "MatMul")
    weights = [rng.standard_normal((k, n)).astype(np.float16) for _ in range(2 if glu else 1)]
    x = rng.standard_normal((m, k)).astype(np.float16)
    ctx, prepared = _prepared_ctx(module, op, [None, *weights])
    assert prepared[1].ndim == 3
    module.run(ctx, x, *prepared[1:])
    shaped = list(launches)
    launches.clear()
    module.run(ctx, x, prepared[1].reshape(-1), *prepared[2:])
    assert len(shaped) == len(launches) > 0
    for got, want in zip(shaped, launches, strict=True):
        assert got[:3] == want[:3] and got[4] == want[4]
        for a, b in zip(got[3], want[3], strict=True):
            assert np.array_equal(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1))
        assert int(got[3][7]) == n

"""Weight memory without a GPU: the cuda provider's packing run on the host with NumPy (the same
code as on the device, ``xp=numpy``) against the fragment order written out element by element,
and a plan made with the cuda prepare hooks on a host provider: one copy per weight in the
kernels' layout, the tied embedding shared with the lm_head, and a load whose peak is the
weights plus one node's transient (tracemalloc counts NumPy's allocations)."""

import tracemalloc

import numpy as np
import pytest

from core.executor import Plan
from core.models.model import load_model
from core.testing.tiny_model import TinyConfig, make_tiny_model
from providers.cpu_reference.ops import gather_columns, matmul, silu_gated_matmul
from providers.cpu_reference.provider import CpuReferenceProvider
from providers.cuda.ops import _mma_layout
from providers.cuda.ops import gather_columns as cuda_gather_columns
from providers.cuda.ops import matmul as cuda_matmul
from providers.cuda.ops import silu_gated_matmul as cuda_silu_gated_matmul


def fragment_order(w: np.ndarray) -> np.ndarray:
    """The packed order of kernels/linear_mma.cu written out per element: for each 16-column
    tile nt, virtual k16 tile kt, lane (g = lane / 4, t = lane % 4) and fragment element e,
    column nt*16 + g + 8*((e >> 1) & 1) and row (kt // 4)*64 + 16 t + 4 (kt % 4) + (e & 1) +
    2 (e >> 2) of W padded with zeros to K % 64 == 0, N % 16 == 0."""
    k, n = w.shape
    kp, np_ = -(-k // 64) * 64, -(-n // 16) * 16
    pad = np.zeros((kp, np_), np.float16)
    pad[:k, :n] = w
    nt, kt, lane, e = np.meshgrid(np.arange(np_ // 16), np.arange(kp // 16), np.arange(32), np.arange(8),
                                  indexing="ij")
    g, t = lane >> 2, lane & 3
    col = nt * 16 + g + 8 * ((e >> 1) & 1)
    row = (kt // 4) * 64 + 16 * t + 4 * (kt % 4) + (e & 1) + 2 * (e >> 2)
    return pad[row, col].reshape(-1)


SHAPES = [(64, 16), (100, 37), (576, 1536), (1, 1), (130, 70), (2048, 24)]


@pytest.mark.parametrize("k,n", SHAPES)
def test_host_packing_is_the_fragment_order(k, n):
    rng = np.random.default_rng(k * 1000 + n)
    w, up = (rng.standard_normal((k, n)).astype(np.float16) for _ in range(2))
    packed = _mma_layout.pack(np, w)
    assert packed.dtype == np.float16 and packed.size == _mma_layout.packed_size(k, n)
    assert np.array_equal(packed, fragment_order(w))
    # gate/up: the columns of both interleaved in glu_rows order (zero column past N), then packed
    both = np.concatenate([w, up, np.zeros((k, 1), np.float16)], axis=1)[:, _mma_layout.glu_rows(n)]
    glu = _mma_layout.pack(np, w, up)
    assert glu.size == _mma_layout.packed_size(k, n, glu=True) and np.array_equal(glu, fragment_order(both))


@pytest.mark.parametrize("k,n", SHAPES)
def test_packed_offset_reads_every_element_back(k, n):
    w = np.random.default_rng(n).standard_normal((k, n)).astype(np.float16)
    kk, nn = np.meshgrid(np.arange(k), np.arange(n), indexing="ij")
    assert np.array_equal(_mma_layout.pack(np, w)[_mma_layout.packed_offset(np, kk, nn, k)], w)


@pytest.mark.parametrize("n,x", [(52, 7), (16, 3), (5, 1), (8, 10)])
def test_interleave_is_the_glu_row_order(n, x):
    rng = np.random.default_rng(n)
    gate, up = (rng.integers(0, 256, (n, x)).astype(np.uint8) for _ in range(2))
    want = np.concatenate([gate, up, np.zeros((1, x), np.uint8)])[_mma_layout.glu_rows(n)]
    assert np.array_equal(_mma_layout.glu_interleave(np, gate, up), want)


def _unpack(packed, k: int, n: int) -> np.ndarray:
    kk, nn = np.meshgrid(np.arange(k), np.arange(n), indexing="ij")
    return packed.reshape(-1)[_mma_layout.packed_offset(np, kk, nn, k)]  # 3-D when N % 16 == 0: flat order


def _packed_matmul(ctx, a, w):
    if _mma_layout.PREPARED in ctx.cache:
        w = _unpack(w, *ctx.cache[_mma_layout.PREPARED])
    return matmul.run(ctx, a, w)


def _packed_gated(ctx, x, w, up):
    if _mma_layout.PREPARED in ctx.cache:
        k, n = ctx.cache[_mma_layout.PREPARED]
        both = _unpack(w, k, _mma_layout.glu_width(n))
        where = np.empty(2 * n + 1, np.int64)
        where[_mma_layout.glu_rows(n)] = np.arange(_mma_layout.glu_width(n))
        w, up = (np.ascontiguousarray(both[:, cols]) for cols in (where[:n], where[n:2 * n]))
    return silu_gated_matmul.run(ctx, x, w, up)


def _packed_gather(ctx, w, indices):
    if _mma_layout.PREPARED in ctx.cache:
        w = _unpack(w, *ctx.cache[_mma_layout.PREPARED])
    return gather_columns.run(ctx, w, indices)


class HostPacked(CpuReferenceProvider):
    """cpu_reference planned with the cuda provider's prepare hooks, packing on the host, whose
    MatMul, SiluGatedMatMul and GatherColumns kernels read the packed forms back
    through ``_mma_layout.packed_offset`` (the index formula of the cuda gather kernel). ``upload``
    copies, as a device upload allocates."""

    HOOKS = {"MatMul": cuda_matmul.prepare, "SiluGatedMatMul": cuda_silu_gated_matmul.prepare,
             "GatherColumns": cuda_gather_columns.prepare}
    KERNELS = {"MatMul": _packed_matmul, "SiluGatedMatMul": _packed_gated, "GatherColumns": _packed_gather}
    #: the inputs the hooks replace
    WEIGHTS = {"MatMul": slice(1, 2), "SiluGatedMatMul": slice(1, 3), "GatherColumns": slice(0, 1)}

    def prepare(self, node):
        return self.HOOKS.get(node.op_type)

    def kernel(self, node):
        return self.KERNELS.get(node.op_type) or super().kernel(node)

    def _upload(self, array):
        return np.array(array, copy=True)


CONFIG = TinyConfig(hidden=128, heads=4, kv_heads=2, head_size=32, intermediate=512, vocab=1024)


def _feeds(model, plan):
    cfg = model.config
    prompt = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 7)).astype(np.int64)
    kv = {n: np.zeros((2, cfg.num_kv_heads, 16, cfg.head_size), model.io_dtype)
          for n in plan.input_names if n.startswith("past_key_values")}
    return {"input_ids": prompt, "attention_mask": np.ones((2, 7), np.int64), **kv}


def test_host_packed_plan_holds_one_copy_per_weight_and_computes_the_plain_bits(tmp_path):
    model = load_model(make_tiny_model(tmp_path / "m", dtype="float16", config=CONFIG))
    plain = Plan(model.graph, model.initializers, CpuReferenceProvider())
    tracemalloc.start()
    try:
        plan = Plan(model.graph, model.initializers, HostPacked())
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the same logits bit for bit: every packed weight is read back exactly
    assert np.array_equal(plan.run(_feeds(model, plan))["logits"], plain.run(_feeds(model, plain))["logits"])
    # the tied table: one packed constant read by the lookup and the lm_head, no raw copy left
    tied = model.initializers["lm_head.MatMul.weight"]
    (lookup,) = [plan.nodes[i] for i in plan.steps if plan.nodes[i].op_type == "GatherColumns"]
    (lm_head,) = [plan.nodes[i] for i in plan.steps if plan.nodes[i].name == "/lm_head/MatMul"]
    assert lookup.inputs[0] == lm_head.inputs[1] and lookup.inputs[0] in plan.prepared
    assert np.array_equal(plan.constants[lookup.inputs[0]].reshape(-1), _mma_layout.pack(np, tied))
    prepared = [plan.nodes[i] for i in plan.steps if plan.nodes[i].op_type in HostPacked.HOOKS]
    raw = {x for i in plain.steps if plain.nodes[i].op_type in HostPacked.HOOKS
           for x in plain.nodes[i].inputs[HostPacked.WEIGHTS[plain.nodes[i].op_type]] if x in model.initializers}
    # lookup, lm_head; per layer qkv, o, gate/up and down
    assert len(prepared) == 2 + 4 * model.config.num_layers
    assert raw and not raw & set(plan.constants)  # every raw weight a hook packed is gone
    # aligned shapes pack without padding: the packed plan holds exactly the plain plan's bytes
    assert plan.weight_bytes() == plain.weight_bytes() == sum(v.nbytes for v in plan.constants.values())
    # the load's peak: the weights it keeps plus one node's raw inputs (uploaded for its hook,
    # dropped after it) and small Python objects; all raw weights at once would be 3 MiB more
    largest = max(tied.nbytes, 2 * CONFIG.hidden * CONFIG.intermediate * 2)
    assert peak - held <= largest + 256 * 1024, (peak, held, largest)

"""The tensor-parallel sharding plan: a builder graph cut into R rank graphs (Megatron layout).

:func:`plan_shards` reads a loaded :class:`~core.models.model.Model` and finds, per layer, the
packed QKV projection, its GroupQueryAttention, the o_proj, the gate/up projections and the
down projection, plus the embedding lookup and the lm_head. It checks everything it needs
(the KV-head count divides R, the patterns are the builder's) before any rank starts.
:meth:`ShardPlan.shard` then writes rank r's graph:

- **attention** by KV-head groups: rank r keeps KV heads [r·Nkv/R, (r+1)·Nkv/R) and their
  query heads (GQA groups are contiguous), so the packed QKV weight keeps the matching q, k
  and v columns (in that order), GroupQueryAttention runs with ``num_heads/R`` and
  ``kv_num_heads/R``, and o_proj keeps the matching rows (row-parallel): its output is a
  partial sum;
- **MLP**: gate and up keep a contiguous range of intermediate columns (column-parallel), the
  elementwise ops between run on the shard, down keeps the same rows (row-parallel);
- **embedding and lm_head** by vocab: rank r owns ids [start_r, end_r); the lookup gathers its
  own rows and writes zeros for ids outside its range (Less/Where/Sub/Unsqueeze around the
  Gather), and the lm_head computes logits of its own vocab range only (``[B, S, end_r -
  start_r]``); the argmax across ranks is the provider's (:mod:`core.parallel.provider`);
- **all-reduce points**: after the embedding lookup, o_proj and down, the partial sum is fed
  through a ``lockstep.AllReduce`` node (one input, one output of the same shape and dtype:
  the elementwise sum over ranks), which the rank's provider runs through its communicator.

Splits are in whole units: heads for attention, MatMulNBits blocks for a row-parallel int4
projection (a K range must hold whole quantization blocks), single columns otherwise; uneven
counts are spread like ``numpy.array_split`` (the first ranks get one more unit).

The rank graph's initializers are dtype/shape stubs; the values are in the rank
:class:`~core.models.model.Model`'s ``initializers`` (what :class:`~core.executor.Plan` reads).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from core.models.model import Model, ModelError

#: The op of an all-reduce point: domain, op type.
ALL_REDUCE = ("lockstep", "AllReduce")
_PROJ = ("MatMul", "MatMulNBits")
#: Ops that may sit between the gate/up and down projections (elementwise on the shard).
_ELEMENTWISE = {"Sigmoid", "Mul", "Tanh", "Gelu", "FastGelu", "QuickGelu", "Add", "Div", "Pow", "Sub", "Cast",
                "Erf", "Relu", "Neg", "Sqrt"}


def split_units(units: int, ranks: int) -> list[tuple[int, int]]:
    """``ranks`` contiguous ranges [start, end) covering ``range(units)`` like
    ``numpy.array_split`` (the first ``units % ranks`` ranges one longer)."""
    base, extra = divmod(units, ranks)
    out, start = [], 0
    for r in range(ranks):
        end = start + base + (1 if r < extra else 0)
        out.append((start, end))
        start = end
    return out


@attrs.frozen
class LayerShard:
    """The node names of one layer's sharded projections.

    Attributes:
        qkv: the packed QKV projection (column-parallel by heads).
        attention: its GroupQueryAttention node.
        o_proj: the output projection (row-parallel; all-reduced).
        column: the gate/up projections (column-parallel).
        down: the down projection (row-parallel; all-reduced).
        mlp_units: the unit the MLP's intermediate axis is split in (1, or the int4 block size).
    """

    qkv: str
    attention: str
    o_proj: str
    column: tuple[str, ...]
    down: str
    mlp_units: int


@attrs.frozen
class ShardPlan:
    """Where a model is cut for ``ranks`` ranks (module docstring); made by :func:`plan_shards`.

    Attributes:
        ranks: R.
        num_heads, num_kv_heads, head_size, intermediate: the full model's geometry.
        vocab: the vocabulary size V.
        layers: one :class:`LayerShard` per layer.
        embedding: the embedding lookup node (Gather or GatherBlockQuantized of ``input_ids``).
        lm_head: the node producing ``logits``.
    """

    ranks: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate: int
    vocab: int
    layers: tuple[LayerShard, ...]
    embedding: str
    lm_head: str

    def vocab_range(self, rank: int) -> tuple[int, int]:
        """Token ids [start, end) whose embedding rows and logits rank ``rank`` holds."""
        return split_units(self.vocab, self.ranks)[rank]

    def all_reduces_per_run(self) -> int:
        """All-reduce calls one run of the graph makes (the embedding, then o_proj and down
        per layer)."""
        return 1 + 2 * len(self.layers)

    def shard(self, model: Model, rank: int) -> Model:
        """Rank ``rank``'s model: the rewritten graph (module docstring), its sliced weights,
        and a config with ``num_heads/R`` and ``num_kv_heads/R`` (the vocab size stays V:
        token ids are global).

        Raises:
            ValueError: ``rank`` not in [0, R).
        """
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank must be in [0, {self.ranks}), got {rank}")
        return _Rewriter(model, self, rank).run()


def _index(graph: onnx.GraphProto) -> tuple[dict, dict, dict]:
    producer: dict[str, onnx.NodeProto] = {}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    by_name: dict[str, onnx.NodeProto] = {}
    for i, n in enumerate(graph.node):
        by_name[n.name or f"{n.op_type}_{i}"] = n
        for o in n.output:
            if o:
                producer[o] = n
        for x in n.input:
            if x:
                consumers.setdefault(x, []).append(n)
    return producer, consumers, by_name


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _fail(what: str) -> ModelError:
    return ModelError(f"tensor parallel: {what}")


def plan_shards(model: Model, ranks: int) -> ShardPlan:
    """Find the sharding plan of ``model`` for ``ranks`` ranks, checking it can be cut.

    Raises:
        ModelError: the KV-head count is not divisible by ``ranks`` (no padding is done), or
            the graph does not have the builder's pattern (packed QKV into GroupQueryAttention,
            o_proj, gate/up/down with elementwise ops between, a Gather of ``input_ids``, an
            lm_head producing ``logits``); the message names what is missing.
        ValueError: ``ranks`` < 1.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    cfg = model.config
    nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    if nkv % ranks:
        raise _fail(f"the model has {nkv} KV heads, which {ranks} ranks cannot share evenly (attention is "
                    f"sharded by KV-head groups); use a tensor_parallel that divides {nkv}")
    if nq % nkv:
        raise _fail(f"{nq} query heads do not form whole groups over {nkv} KV heads")
    graph, inits = model.graph, model.initializers
    producer, consumers, _ = _index(graph)
    layers = []
    intermediate = 0
    for n in graph.node:
        if n.op_type != "GroupQueryAttention":
            continue
        name = n.name
        if len(n.input) > 2 and (n.input[1] or n.input[2]):
            raise _fail(f"{name} takes separate q/k/v inputs; only the packed QKV projection is sharded")
        qkv = producer.get(n.input[0])
        if qkv is None or qkv.op_type not in _PROJ or qkv.input[1] not in inits:
            raise _fail(f"the query input of {name} is not a MatMul/MatMulNBits of a weight (a bias Add or "
                        "norm between is not sharded)")
        if _attr(n, "num_heads") != nq or _attr(n, "kv_num_heads") != nkv:
            raise _fail(f"{name} has num_heads/kv_num_heads {_attr(n, 'num_heads')}/{_attr(n, 'kv_num_heads')}, "
                        f"genai_config.json says {nq}/{nkv}")
        users = consumers.get(n.output[0], [])
        if len(users) != 1 or users[0].op_type not in _PROJ:
            raise _fail(f"the output of {name} does not feed one o_proj MatMul")
        o_proj = users[0]
        after = consumers.get(o_proj.output[0], [])
        if len(after) != 1 or after[0].op_type != "SkipSimplifiedLayerNormalization":
            raise _fail(f"{o_proj.name} does not feed a SkipSimplifiedLayerNormalization")
        normed = after[0].output[0]
        column = [c for c in consumers.get(normed, []) if c.op_type in _PROJ]
        if not column:
            raise _fail(f"no gate/up projection reads {normed}")
        down = _find_down(column, consumers)
        widths = {_out_features(c, inits) for c in column}
        if len(widths) != 1:
            raise _fail(f"the gate/up projections after {name} have different widths {sorted(widths)}")
        intermediate = widths.pop()
        unit = int(_attr(down, "block_size", 1)) if down.op_type == "MatMulNBits" else 1
        if intermediate % unit:
            raise _fail(f"{down.name}: K={intermediate} is not whole blocks of {unit}")
        if o_proj.op_type == "MatMulNBits" and (nq // ranks * hd) % int(_attr(o_proj, "block_size")):
            raise _fail(f"{o_proj.name}: a rank's {nq // ranks * hd} input rows are not whole quantization "
                        f"blocks of {_attr(o_proj, 'block_size')}")
        for proj in (qkv, o_proj, down, *column):
            if proj.op_type == "MatMulNBits" and len([x for x in proj.input[3:] if x]):
                raise _fail(f"{proj.name} has zero points, g_idx or a bias; those are not sharded yet")
        layers.append(LayerShard(qkv.name, name, o_proj.name, tuple(c.name for c in column), down.name, unit))
    if len(layers) != cfg.num_layers:
        raise _fail(f"found {len(layers)} GroupQueryAttention layers, genai_config.json says {cfg.num_layers}")
    emb = [c for c in consumers.get("input_ids", []) if c.op_type in ("Gather", "GatherBlockQuantized")
           and len(c.input) > 1 and c.input[1] == "input_ids"]
    if len(emb) != 1 or any(c not in emb for c in consumers.get("input_ids", [])):
        raise _fail("input_ids must feed exactly one embedding Gather / GatherBlockQuantized")
    head = producer.get("logits")
    if head is None or head.op_type not in _PROJ or head.input[1] not in inits:
        raise _fail("logits are not produced by a MatMul/MatMulNBits of a weight (the lm_head)")
    if _out_features(head, inits) != cfg.vocab_size:
        raise _fail(f"the lm_head has {_out_features(head, inits)} outputs, vocab_size is {cfg.vocab_size}")
    return ShardPlan(ranks, nq, nkv, hd, intermediate, cfg.vocab_size, tuple(layers), emb[0].name, head.name)


def _out_features(node: onnx.NodeProto, inits: dict) -> int:
    if node.op_type == "MatMulNBits":
        return int(_attr(node, "N"))
    return int(inits[node.input[1]].shape[-1])


def _find_down(column: list[onnx.NodeProto], consumers: dict) -> onnx.NodeProto:
    """The one projection the gate/up outputs reach through elementwise ops only."""
    frontier = [c.output[0] for c in column]
    seen: set[str] = set()
    downs: dict[str, onnx.NodeProto] = {}
    while frontier:
        value = frontier.pop()
        for user in consumers.get(value, []):
            if user.name in seen:
                continue
            seen.add(user.name)
            if user.op_type in _PROJ:
                downs[user.name] = user
            elif user.op_type in _ELEMENTWISE and not user.domain:
                frontier.extend(user.output)
            else:
                raise _fail(f"{user.op_type} node {user.name} between the gate/up and down projections is not "
                            "elementwise; this MLP is not sharded")
    if len(downs) != 1:
        raise _fail(f"the gate/up projections {[c.name for c in column]} reach {len(downs)} projections, not one "
                    "down projection")
    return next(iter(downs.values()))


class _Rewriter:
    """Rank ``rank``'s graph and weights (one use)."""

    def __init__(self, model: Model, plan: ShardPlan, rank: int):
        self.model, self.plan, self.rank = model, plan, rank
        self.inits = model.initializers
        self.new: dict[str, np.ndarray] = {}
        self.cut_keys: dict[str, tuple] = {}
        self.nodes = [_copy(n) for n in model.graph.node]
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.by_name = {n.name: n for n in self.nodes}
        self.after: dict[str, list[onnx.NodeProto]] = {}   # node name -> nodes inserted after it
        self.before: dict[str, list[onnx.NodeProto]] = {}  # node name -> nodes inserted before it

    # -- weights -------------------------------------------------------------------------
    def cut(self, name: str, key: tuple, fn: Callable[[np.ndarray], np.ndarray]) -> None:
        """Replace weight ``name`` by ``fn(weight)``; ``key`` says which cut, so that two nodes
        sharing a weight (the tied embedding) must agree."""
        if name in self.cut_keys:
            if self.cut_keys[name] != key:
                raise _fail(f"weight {name} is read by nodes that shard it differently")
            return
        self.cut_keys[name] = key
        self.new[name] = np.ascontiguousarray(fn(self.inits[name]))

    def columns(self, node: onnx.NodeProto, cols: np.ndarray) -> None:
        """Keep output features ``cols`` of projection ``node``."""
        key = ("cols", cols.tobytes())
        if node.op_type == "MatMul":
            self.cut(node.input[1], key, lambda w: w[..., cols])
            return
        n_full = int(_attr(node, "N"))
        self.cut(node.input[1], key, lambda b: b[cols])
        self.cut(node.input[2], key, lambda s: s.reshape(n_full, -1)[cols].reshape(
            (-1,) if s.ndim == 1 else (len(cols), -1)))
        _set_attr(node, "N", len(cols))

    def rows(self, node: onnx.NodeProto, start: int, end: int) -> None:
        """Keep input features [start, end) of projection ``node`` (whole blocks for int4)."""
        key = ("rows", start, end)
        if node.op_type == "MatMul":
            self.cut(node.input[1], key, lambda w: w[start:end])
            return
        block, n_full = int(_attr(node, "block_size")), int(_attr(node, "N"))
        b0, b1 = start // block, end // block
        self.cut(node.input[1], key, lambda b: b[:, b0:b1])
        self.cut(node.input[2], key, lambda s: s.reshape(n_full, -1)[:, b0:b1].reshape(
            (-1,) if s.ndim == 1 else (n_full, -1)))
        _set_attr(node, "K", end - start)

    def constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` when it is an initializer or a Constant node's output."""
        if name in self.inits:
            return self.inits[name]
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and not node.domain:
            value = _attr(node, "value")
            return None if value is None else numpy_helper.to_array(value)
        return None

    # -- graph ---------------------------------------------------------------------------
    def all_reduce(self, node: onnx.NodeProto) -> None:
        """Make ``node``'s output a partial sum and all-reduce it into the original name."""
        full = node.output[0]
        partial = f"{full}/tp_partial"
        node.output[0] = partial
        self.after.setdefault(node.name, []).append(helper.make_node(
            ALL_REDUCE[1], [partial], [full], name=f"{node.name}/AllReduce", domain=ALL_REDUCE[0]))

    def run(self) -> Model:
        p, r = self.plan, self.rank
        ranks, hd = p.ranks, p.head_size
        kv_per, q_per = p.num_kv_heads // ranks, p.num_heads // ranks
        q_cols = np.arange(r * q_per * hd, (r + 1) * q_per * hd)
        k_cols = p.num_heads * hd + np.arange(r * kv_per * hd, (r + 1) * kv_per * hd)
        v_cols = (p.num_heads + p.num_kv_heads) * hd + np.arange(r * kv_per * hd, (r + 1) * kv_per * hd)
        qkv_cols = np.concatenate([q_cols, k_cols, v_cols])
        for layer in p.layers:
            self.columns(self.by_name[layer.qkv], qkv_cols)
            gqa = self.by_name[layer.attention]
            _set_attr(gqa, "num_heads", q_per)
            _set_attr(gqa, "kv_num_heads", kv_per)
            o_proj = self.by_name[layer.o_proj]
            self.rows(o_proj, int(q_cols[0]), int(q_cols[-1]) + 1)
            self.all_reduce(o_proj)
            u0, u1 = split_units(p.intermediate // layer.mlp_units, ranks)[r]
            lo, hi = u0 * layer.mlp_units, u1 * layer.mlp_units
            if hi == lo:
                raise _fail(f"rank {r} gets no MLP columns ({p.intermediate} split in units of "
                            f"{layer.mlp_units} over {ranks} ranks)")
            for name in layer.column:
                self.columns(self.by_name[name], np.arange(lo, hi))
            down = self.by_name[layer.down]
            self.rows(down, lo, hi)
            self.all_reduce(down)
        start, end = p.vocab_range(r)
        self.columns(self.by_name[p.lm_head], np.arange(start, end))
        self.embedding(start, end)
        return self.model_of(start, end)

    def embedding(self, start: int, end: int) -> None:
        """Vocab-shard the lookup: gather local rows, zeros for ids of other ranks, all-reduce."""
        node = self.by_name[self.plan.embedding]
        key = ("vocab", start, end)
        data = node.input[0]
        src = self.producer.get(data)
        if data in self.inits and node.op_type == "Gather":
            self.cut(data, key, lambda e: e[start:end])
        elif src is not None and src.op_type == "Transpose" and src.input[0] in self.inits \
                and list(_attr(src, "perm", [1, 0])) == [1, 0] and node.op_type == "Gather":
            self.cut(src.input[0], ("cols", np.arange(start, end).tobytes()), lambda w: w[:, start:end])
        elif node.op_type == "GatherBlockQuantized":
            if _attr(node, "gather_axis", 0) != 0:
                raise _fail(f"{node.name} gathers along axis {_attr(node, 'gather_axis')}, not 0")
            if len(node.input) > 3 and node.input[3]:
                raise _fail(f"{node.name} has zero points; they are not sharded yet")
            codes = data
            if src is not None and src.op_type == "Reshape" and src.input[0] in self.inits \
                    and self.constant(src.input[1]) is not None:
                codes = src.input[0]
                shape = np.array(self.constant(src.input[1]), np.int64).copy()
                shape[0] = end - start
                new_shape = f"{src.input[1]}/tp_rank{self.rank}"
                self.new[new_shape] = shape
                src.input[1] = new_shape
            elif codes not in self.inits:
                raise _fail(f"the table of {node.name} is not a weight (or a Reshape of one)")
            rows = np.arange(start, end)
            self.cut(codes, ("cols", rows.tobytes()), lambda b: b[rows])
            self.cut(node.input[2], ("cols", rows.tobytes()), lambda s: s.reshape(self.plan.vocab, -1)[rows]
                     .reshape((-1,) if s.ndim == 1 else (len(rows), -1)))
        else:
            raise _fail(f"the embedding {node.name} does not read a weight table this plan can shard")
        t = f"/tp/embedding/rank{self.rank}"
        consts = {f"{t}/start": np.array(start, np.int64), f"{t}/end": np.array(end, np.int64),
                  f"{t}/false": np.array(False), f"{t}/zero_id": np.array(0, np.int64),
                  f"{t}/axes": np.array([-1], np.int64),
                  f"{t}/zero": np.array(0, self.model.io_dtype)}
        self.new.update(consts)
        ids = node.input[1]
        pre = [
            helper.make_node("Less", [ids, f"{t}/start"], [f"{t}/below"], name=f"{t}/Less_start"),
            helper.make_node("Less", [ids, f"{t}/end"], [f"{t}/under_end"], name=f"{t}/Less_end"),
            helper.make_node("Where", [f"{t}/below", f"{t}/false", f"{t}/under_end"], [f"{t}/mine"],
                             name=f"{t}/Where_mine"),
            helper.make_node("Sub", [ids, f"{t}/start"], [f"{t}/local"], name=f"{t}/Sub"),
            helper.make_node("Where", [f"{t}/mine", f"{t}/local", f"{t}/zero_id"], [f"{t}/index"],
                             name=f"{t}/Where_index"),
            helper.make_node("Unsqueeze", [f"{t}/mine", f"{t}/axes"], [f"{t}/mine_rows"], name=f"{t}/Unsqueeze"),
        ]
        node.input[1] = f"{t}/index"
        full = node.output[0]
        node.output[0] = f"{t}/rows"
        self.before.setdefault(node.name, []).extend(pre)
        self.after.setdefault(node.name, []).extend([
            helper.make_node("Where", [f"{t}/mine_rows", f"{t}/rows", f"{t}/zero"], [f"{full}/tp_partial"],
                             name=f"{t}/Where_rows"),
            helper.make_node(ALL_REDUCE[1], [f"{full}/tp_partial"], [full], name=f"{node.name}/AllReduce",
                             domain=ALL_REDUCE[0])])

    def model_of(self, start: int, end: int) -> Model:
        p = self.plan
        old = self.model.graph
        nodes = []
        for n in self.nodes:
            nodes.extend(self.before.get(n.name, []))
            nodes.append(n)
            nodes.extend(self.after.get(n.name, []))
        values = {**self.inits, **self.new}
        stubs = [_stub(name, a) for name, a in values.items()]
        kv_names = {self.model.config.past_key % i for i in range(len(p.layers))}
        kv_names |= {self.model.config.past_value % i for i in range(len(p.layers))}
        kv_names |= {self.model.config.present_key % i for i in range(len(p.layers))}
        kv_names |= {self.model.config.present_value % i for i in range(len(p.layers))}
        inputs, outputs = [_copy_vi(v) for v in old.input], [_copy_vi(v) for v in old.output]
        for vi in inputs + outputs:
            dims = vi.type.tensor_type.shape.dim
            if vi.name in kv_names and dims[1].HasField("dim_value"):
                dims[1].dim_value = p.num_kv_heads // p.ranks
            if vi.name == "logits" and dims[2].HasField("dim_value"):
                dims[2].dim_value = end - start
        graph = helper.make_graph(nodes, f"{old.name}_tp{self.rank}of{p.ranks}", inputs, outputs, stubs)
        config = attrs.evolve(self.model.config, num_heads=p.num_heads // p.ranks,
                              num_kv_heads=p.num_kv_heads // p.ranks)
        return Model(self.model.folder, config, graph, values, self.model.io_dtype, self.model.tokenizer)


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    out = onnx.NodeProto()
    out.CopyFrom(node)
    return out


def _copy_vi(vi: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(vi)
    return out


def _set_attr(node: onnx.NodeProto, name: str, value: int) -> None:
    for a in node.attribute:
        if a.name == name:
            a.i = int(value)
            return
    node.attribute.append(helper.make_attribute(name, int(value)))


def _stub(name: str, array: np.ndarray) -> onnx.TensorProto:
    """An initializer entry with name, dtype and dims only (the Plan reads values from the dict)."""
    if array.dtype == np.bool_:
        return numpy_helper.from_array(array, name)
    t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
    t.dims.extend(array.shape)
    return t

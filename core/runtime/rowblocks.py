"""Row-block pages: a large projection streams as several pages of its output rows.

A node that computes ``Y[..., n] = reduce_k X[..., k] * W(k, n)`` (MatMul, MatMulNBits and the
gated forms :mod:`core.fusion` makes of them) can run on a block of output rows ``a:b`` of N
with the rows ``a:b`` of its weights: no output element's reduction over K changes. So a
streamed node whose weights are larger than the page size is split into pages of
``rows`` output rows each; the staging slot is the page size (:func:`page_bytes`), not the
largest node (the lm_head: vocab x hidden).

What splits, per op (:func:`onnx_rows`, the raw ONNX forms a provider's kernels read):

- ``MatMul``: B ``[K, N]`` along axis 1 (a block is columns ``a:b``, copied contiguous);
- ``MatMulNBits``: B ``[N, n_blocks, blob]``, scales ``[N, n_blocks]`` (or flat) and zero
  points ``[N, ...]`` (or flat) and the bias ``[N]`` along N, their axis 0: int4 codes pack
  along K, so a row block is whole rows of the packed weight and of its scales/zero points;
- ``lockstep.SiluGatedMatMul``: both weights ``[K, N]`` along axis 1;
- ``lockstep.SiluGatedMatMulNBits``: the six quantised inputs along axis 0.

Blocks are whole multiples of :data:`ROW_ALIGN` rows (the last may be shorter), so a kernel
whose products run in fixed column chunks of that many rows (cpu_reference's
``rowwise_matmul``) computes bitwise the same elements on a page as on the whole node; a GPU
provider declaring row blocks must pass the whole node's GEMM schedule to each page launch.

A provider says which of its nodes split through ``ProviderBase.row_blocks`` (None: none).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import attrs

#: Output rows per block are a multiple of this (the column chunk of cpu_reference's products).
ROW_ALIGN = 16
#: The default page size floor in bytes (``LOCKSTEP_PAGE_BYTES`` or ``page_bytes=`` set another).
DEFAULT_PAGE_BYTES = 64 * 2**20
#: Environment variable: the page size in bytes (or "256MiB"); the Runner's default.
PAGE_ENV = "LOCKSTEP_PAGE_BYTES"

_AXIS1_OPS = {("", "MatMul"): (1,), ("lockstep", "SiluGatedMatMul"): (1, 2)}
_NBITS_OPS = {("com.microsoft", "MatMulNBits"): (1, 2, 3, 5),
              ("lockstep", "SiluGatedMatMulNBits"): (1, 2, 3, 4, 5, 6)}


@attrs.frozen
class RowSplit:
    """How a node splits into row blocks: ``n`` output rows (N) and, per input position, the
    axis of that input that is indexed by N (0 for an N-major or flat ``[N * r]`` tensor, 1 for
    a ``[K, N]`` matrix)."""

    n: int
    axes: dict[int, int]


def onnx_rows(node, shape_of: Callable[[str], tuple[int, ...] | None]) -> RowSplit | None:
    """The :class:`RowSplit` of ``node`` in its raw ONNX form (module docstring), or None when it
    does not split (another op, a non-constant weight, shapes that do not match N).

    Args:
        node: a :class:`core.protocol.NodeInfo`.
        shape_of: constant name -> its shape, None when the input is not a constant.
    """
    key = (node.domain, node.op_type)
    inputs = node.inputs
    if key in _AXIS1_OPS:
        shapes = [shape_of(inputs[i]) if i < len(inputs) and inputs[i] else None for i in _AXIS1_OPS[key]]
        if any(s is None or len(s) != 2 for s in shapes) or len({s[1] for s in shapes}) != 1:  # type: ignore[index]
            return None
        return RowSplit(int(shapes[0][1]), {i: 1 for i in _AXIS1_OPS[key]})  # type: ignore[index]
    if key in _NBITS_OPS and "N" in node.attrs:
        n = int(node.attrs["N"])
        axes = {}
        for i in _NBITS_OPS[key]:
            if i >= len(inputs) or not inputs[i]:
                continue
            shape = shape_of(inputs[i])
            if shape is None or not shape or (shape[0] != n and (len(shape) != 1 or shape[0] % n)):
                return None
            axes[i] = 0
        return RowSplit(n, axes) if 1 in axes else None
    return None


def block_rows(n: int, nbytes: Sequence[int], page: int, align: int = 256) -> int:
    """Output rows per block so that the blocks of tensors of ``nbytes`` (whole-node bytes,
    each proportional to N), each rounded up to ``align`` bytes, fit ``page`` bytes: the largest
    multiple of :data:`ROW_ALIGN` that fits, at least ROW_ALIGN, at most ``n``."""
    per_row = sum(nbytes) / n
    rows = max(ROW_ALIGN, int((page - align * len(nbytes)) // max(per_row, 1)) // ROW_ALIGN * ROW_ALIGN)
    return min(rows, n)


def blocks(n: int, rows: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` row ranges of blocks of ``rows`` rows over ``n`` rows."""
    return [(a, min(a + rows, n)) for a in range(0, n, rows)]


def block_of(value: Any, axis: int, n: int, a: int, b: int) -> Any:
    """Rows ``a:b`` of N of ``value`` (a NumPy or CuPy array, a view where it can be): along
    ``axis`` when that axis has N entries, else (a flat ``[N * r]`` tensor) elements
    ``a*r : b*r``."""
    if value.shape[axis] == n:
        return value[a:b] if axis == 0 else value[:, a:b]
    r = value.shape[0] // n
    return value[a * r:b * r]


def page_bytes(value: Any = None) -> int | None:
    """The page size in bytes from ``value`` (an int, a size string "64MiB"), else from
    :data:`PAGE_ENV`, else None (the planner's default, :func:`default_page_bytes`).

    Raises:
        core.runtime.residency.BudgetError: a value that is not a positive size.
    """
    from core.runtime.residency import BudgetError, parse_budget

    value = os.environ.get(PAGE_ENV) if value is None else value
    if value is None or value == "":
        return None
    try:
        return parse_budget(value, 0, fractions=False)
    except BudgetError as exc:
        raise BudgetError(f"page size: {exc}") from None


def default_page_bytes(unsplittable: Sequence[int]) -> int:
    """The default page size: the largest page that cannot split (it sets the slot anyway), at
    least :data:`DEFAULT_PAGE_BYTES`."""
    return max([DEFAULT_PAGE_BYTES, *unsplittable])


class PageContext:
    """The context one row block of a node runs on: the node as the kernel sees it with
    ``N = b - a`` (``node``), a cache of its own that starts with what the node's prepare hook
    recorded there (the plan-time entries: keys not starting with "_", no run memos; a
    prepared kernel reads its layout there, and its N from the node), and outputs in scratch
    slots of the node's context (``output(slot, ...)`` is ``parent.output(("rows", p, slot),
    ...)``), so the block writes into persistent buffers of the node (frozen during capture,
    poisoned by the kit)."""

    __slots__ = ("cache", "index", "node", "parent")

    def __init__(self, parent: Any, index: int, rows: int):
        from core.ops import RUN_MEMO

        self.parent, self.index = parent, index
        node = parent.node
        self.node = attrs.evolve(node, attrs={**node.attrs, "N": rows}) if "N" in node.attrs else node
        self.cache: dict = {k: v for k, v in parent.cache.items()
                            if not str(k).startswith("_") and k not in (RUN_MEMO, CONTEXTS)}

    def output(self, slot: Any, shape: Sequence[int], dtype: Any) -> Any:
        """The node's persistent buffer for scratch slot ``("rows", index, slot)``."""
        return self.parent.output(("rows", self.index, slot), shape, dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parent, name)


#: ``ctx.cache`` key of a row-blocked node's per-block contexts (:class:`PageContext`).
CONTEXTS = "row_block_contexts"


class RowBlockKernel:
    """A node run once per row block (module docstring): block ``p`` gets the staged weights'
    slot views ``views[p]`` (input position -> view) and the other N-indexed inputs cut to its
    rows, writes its ``[..., b - a]`` output into a scratch buffer, which is copied into rows
    ``a:b`` of the node's output (``ctx.output(0, [..., N])``). ``before[p]`` / ``after[p]``:
    the streaming actions around block p (:mod:`core.runtime.streaming`).

    Attributes:
        run: the wrapped kernel.
        split: the node's :class:`RowSplit`.
        ranges: the blocks' ``(start, stop)`` rows.
        launches: blocks run so far (a counter the tests read).
    """

    def __init__(self, kernel: Any, split: RowSplit, ranges: Sequence[tuple[int, int]],
                 views: Sequence[dict[int, Any]], before: Sequence[Sequence[Callable[[], None]]],
                 after: Sequence[Sequence[Callable[[], None]]]):
        self.run, self.split, self.ranges = kernel, split, tuple(ranges)
        self.views = tuple(views)
        self.before, self.after = tuple(map(tuple, before)), tuple(map(tuple, after))
        self.launches = 0

    def __call__(self, ctx, *args):
        contexts = ctx.cache.get(CONTEXTS)
        if contexts is None or len(contexts) != len(self.ranges):
            contexts = ctx.cache[CONTEXTS] = [PageContext(ctx, p, b - a) for p, (a, b) in enumerate(self.ranges)]
        n, full = self.split.n, None
        for p, (a, b) in enumerate(self.ranges):
            for action in self.before[p]:
                action()
            block = list(args)
            for i, axis in self.split.axes.items():
                if i in self.views[p]:
                    block[i] = self.views[p][i]
                elif i < len(block) and block[i] is not None:
                    block[i] = block_of(block[i], axis, n, a, b)
            (part,) = self.run(contexts[p], *block)
            if full is None:
                full = ctx.output(0, (*part.shape[:-1], n), part.dtype)
            full[..., a:b] = part
            self.launches += 1
            for action in self.after[p]:
                action()
        return (full,)


def node_splits(nodes: Sequence[Any], steps: Sequence[int], row_blocks: Callable[..., RowSplit | None] | None,
                shape_of: Callable[[str], tuple[int, ...] | None]) -> dict[str, tuple[int, dict[str, int]]]:
    """Per-step node name -> (N, {constant name: axis}) for the nodes that split into row blocks
    (``row_blocks(node, shape_of)``: the provider's declaration, None: no node splits)."""
    if row_blocks is None:
        return {}
    out = {}
    for i in steps:
        node = nodes[i]
        split = row_blocks(node, shape_of)
        if split is not None:
            out[node.name] = (split.n, {node.inputs[i]: axis for i, axis in split.axes.items()})
    return out


def split_weights(weights: Sequence[Any], splits: dict[str, tuple[int, dict[str, int]]], page: int | None,
                  pinned: Callable[[Any], bool]) -> tuple[tuple[Any, ...], int]:
    """``weights`` (:class:`core.runtime.residency.Weight`, execution order) with the streamable
    weights of every splitting node larger than the page size replaced by their row blocks,
    and the page size used (``page`` or :func:`default_page_bytes`).

    A node splits when all its streamable weights (``not pinned(w)``) split along N; its block
    ``a:b`` of weight ``w`` is ``Weight(f"{w.name}[a:b]", w.nbytes * (b - a) // N,
    page=f"{node}[a:b]", source=w.name, rows=(a, b), node=node)``.
    """
    by_page: dict[str, list[Any]] = {}
    for w in weights:
        if not pinned(w):
            by_page.setdefault(w.page or w.name, []).append(w)
    splittable = {p for p, ws in by_page.items() if p in splits and all(w.name in splits[p][1] for w in ws)}
    if page is None:
        page = default_page_bytes([sum(w.nbytes for w in ws) for p, ws in by_page.items() if p not in splittable])
    cut = {p: block_rows(splits[p][0], [w.nbytes for w in by_page[p]], page)
           for p in splittable if sum(w.nbytes for w in by_page[p]) > page}
    out: list[Any] = []
    for w in weights:
        if pinned(w) or w.page not in cut:
            out.append(w)
            continue
        n = splits[w.page][0]
        out += [attrs.evolve(w, name=f"{w.name}[{a}:{b}]", nbytes=w.nbytes * (b - a) // n, page=f"{w.page}[{a}:{b}]",
                             source=w.name, rows=(a, b), node=w.page) for a, b in blocks(n, cut[w.page])]
    return tuple(out), page


def plan_splits(plan) -> dict[str, tuple[int, dict[str, int]]]:
    """:func:`node_splits` of an executor plan (or the placer's view of one being loaded): the
    shapes of its constants (a staged weight's host copy where it has one), the declaration of
    its provider (``row_blocks``)."""
    def shape_of(name: str) -> tuple[int, ...] | None:
        value = plan.staged_weights.get(name, plan.constants.get(name))
        return None if value is None else tuple(value.shape)

    return node_splits(plan.nodes, plan.steps, plan.provider.row_blocks, shape_of)

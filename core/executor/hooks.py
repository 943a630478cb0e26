"""Node hooks: work a plan declares around a node's kernel, and row-block launches.

A plan may declare, per node, a :class:`NodeHooks` (:meth:`core.executor.plan.Plan.set_hooks`,
which replaces every earlier declaration; ``set_hooks({})`` clears them). The executor's
dispatch runs them (:meth:`core.executor.dispatch.Dispatch._call_hooked`): for each
:class:`Launch` of the node, its ``before`` actions, the node's own kernel, its ``after``
actions. Weight streaming (:mod:`core.runtime.streaming`) declares its copy schedule this way:
``stream.begin``, ``ready``, ``release``, the copies and ``end`` around the nodes that read
streamed pages. The hooks hold no kernel: ``plan.kernels`` stays what the provider gave, and
dispatch is the one place a kernel is called.

Row blocks (:mod:`core.runtime.rowblocks`). A node whose streamed weights are row blocks runs
one launch per block: launch ``p`` covers output rows ``rows = (a, b)`` of N and reads
``views`` (input position -> the staging-slot view of that block) in place of those inputs;
the node's other N-indexed inputs (``NodeHooks.axes``) are cut to rows ``a:b``
(:func:`block_of`). Each block runs on its own :class:`PageContext` and writes a ``[..., b - a]``
output, which dispatch copies into rows ``a:b`` of the node's ``[..., N]`` output
(``ctx.output(0, ...)``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import attrs

#: An action of a hook: no arguments, no result (a copy, an event record or wait).
Action = Callable[[], None]

#: ``ctx.cache`` key of a row-blocked node's per-block contexts (:class:`PageContext`).
CONTEXTS = "row_block_contexts"


@attrs.frozen(eq=False)
class Launch:
    """One launch of a hooked node's kernel (module docstring).

    Attributes:
        before: actions run, in order, right before the kernel.
        after: actions run, in order, right after it.
        rows: ``(a, b)``, the output rows of N this launch computes (a row block), or None:
            the whole node.
        views: input position -> the value the kernel reads there instead (a row block's
            staging-slot views); empty for a whole-node launch.
    """

    before: tuple[Action, ...] = ()
    after: tuple[Action, ...] = ()
    rows: tuple[int, int] | None = None
    views: Mapping[int, Any] = attrs.field(factory=dict)


class NodeHooks:
    """What a plan runs around one node's kernel (module docstring).

    Args:
        launches: one :class:`Launch` for a whole node; one per row block, in row order, for a
            row-blocked node (each with its ``rows``).
        n: a row-blocked node's output rows N (None: a whole node).
        axes: a row-blocked node's N-indexed inputs, input position -> the axis indexed by N.

    Attributes:
        launches, n, axes: as given.
        ranges: the row blocks' ``(a, b)`` rows; empty for a whole node.
        count: launches run so far through these hooks (a counter the tests read).

    Raises:
        ValueError: a whole node with other than one launch, or a row-blocked node with a
            launch without rows.
    """

    __slots__ = ("axes", "count", "launches", "n", "ranges")

    def __init__(self, launches: Sequence[Launch], n: int | None = None, axes: Mapping[int, int] | None = None):
        self.launches = tuple(launches)
        self.n, self.axes = n, dict(axes or {})
        if n is None and len(self.launches) != 1:
            raise ValueError(f"a whole node's hooks have one launch, not {len(self.launches)}")
        if n is not None and any(launch.rows is None for launch in self.launches):
            raise ValueError("every launch of a row-blocked node names its rows")
        self.ranges: tuple[tuple[int, int], ...] = () if n is None else tuple(
            launch.rows for launch in self.launches if launch.rows is not None)
        self.count = 0


def block_of(value: Any, axis: int, n: int, a: int, b: int) -> Any:
    """Rows ``a:b`` of N of ``value`` (a NumPy or CuPy array, a view where it can be): along
    ``axis`` when that axis has N entries, else (a flat ``[N * r]`` tensor) elements
    ``a*r : b*r``."""
    if value.shape[axis] == n:
        return value[a:b] if axis == 0 else value[:, a:b]
    r = value.shape[0] // n
    return value[a * r:b * r]


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


def page_contexts(ctx: Any, hooks: NodeHooks) -> list[PageContext]:
    """The per-block contexts of a row-blocked node (kept in ``ctx.cache[CONTEXTS]``, made
    again when the number of blocks changed)."""
    contexts = ctx.cache.get(CONTEXTS)
    if contexts is None or len(contexts) != len(hooks.ranges):
        contexts = ctx.cache[CONTEXTS] = [PageContext(ctx, p, b - a) for p, (a, b) in enumerate(hooks.ranges)]
    return contexts


def block_args(args: Sequence[Any], hooks: NodeHooks, launch: Launch) -> list[Any]:
    """A row block's arguments: ``launch.views`` in place of those inputs, the node's other
    N-indexed inputs cut to ``launch.rows`` (:func:`block_of`), the rest as given."""
    assert hooks.n is not None and launch.rows is not None
    a, b = launch.rows
    block = list(args)
    for i, axis in hooks.axes.items():
        if i in launch.views:
            block[i] = launch.views[i]
        elif i < len(block) and block[i] is not None:
            block[i] = block_of(block[i], axis, hooks.n, a, b)
    return block

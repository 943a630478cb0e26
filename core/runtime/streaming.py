"""The streaming schedule: a residency plan applied to an executor plan.

:func:`apply` moves every streamed weight to the provider's staged host memory (pinned on a
GPU) and replaces the plan's constant by a view of its staging slot, so a kernel reads the
slot as if it were the weight. It then declares the plan's hooks
(:meth:`core.executor.Plan.set_hooks`, :mod:`core.executor.hooks`): the actions the executor
runs around the launches of the nodes that must act, in execution order over ``plan.steps``:

- the first node that reads a device weight starts the step: ``stream.begin()`` and the
  copies of the first ``slots`` streamed pages;
- before the first reader of page j: ``stream.ready(slot j)``;
- after the last reader of page j: ``stream.release(slot j)``, then the copy of page
  ``j + slots`` into the same slot (it waits for that release);
- after the last reader of the last page: ``stream.end()``.

The schedule is static, so every prefill and decode step copies the same bytes in the same
order, and a captured step records the copies with the kernels. A copy is always issued
before the ``ready`` that waits for it: :func:`apply` checks that the last reader of page j
comes before the first reader of page ``j + slots``. A node whose weights stream as row
blocks has one launch per block, each with its own actions (``(position, block)`` above).
The kernels stay the provider's: a re-plan (:func:`evict`, :func:`apply` again) replaces the
hooks, and nothing else of the plan's dispatch.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from typing import Any, Callable

import numpy as np

from core.executor.hooks import CONTEXTS, Launch, NodeHooks, block_of
from core.ops import RUN_MEMO
from core.runtime import rowblocks
from core.runtime.residency import BudgetError, ResidencyPlan


def evict(plan, residency: ResidencyPlan) -> None:
    """Move the device copies of the weights ``residency`` streams or maps to their staged
    host copies (:meth:`ProviderBase.stage`, made once), and give their device memory back,
    before anything new is allocated: a change of plan shrinks the device before it grows."""
    provider, staged = plan.provider, plan.staged_weights
    moved: set[str] = set()
    for name in (*residency.streamed_tensors, *residency.mapped):
        if name in staged:
            continue
        staged[name] = provider.stage(provider.download(plan.constants[name]))
        plan.constants[name] = staged[name]
        moved.add(name)
    if moved:
        plan.set_hooks({})  # the hooks keep nothing, but the dispatch may have chosen by the old values
        forget(plan, moved)
        provider.reset_peak()


def apply(plan, residency: ResidencyPlan, stream, splits: dict | None = None) -> None:
    """Stream ``residency.pages`` through ``stream`` on every run of ``plan`` and read the
    mapped tables in place from their staged host copies (again after a re-plan: weights kept
    in host memory that the plan keeps resident now are uploaded back, newly streamed ones
    staged; :func:`evict` first gives the device copies of those back). A node whose weights
    stream as row blocks runs once per block (:mod:`core.executor.hooks`).

    Args:
        plan: a :class:`core.executor.Plan`.
        residency: what streams (:func:`core.runtime.residency.plan_residency`).
        stream: the provider's :class:`core.provider.WeightStream` (``slots`` slots), or None
            when nothing streams.
        splits: the row splits the plan was made with (:func:`core.runtime.rowblocks.node_splits`).

    Raises:
        BudgetError: a page is read again after the page ``slots`` later needs its slot
            (a larger ring, or those weights resident, is needed).
    """
    provider, slots = plan.provider, residency.slots
    weight = {w.name: w for w in residency.weights}
    page_of = {name: j for j, page in enumerate(residency.pages) for name in page}
    block_pages: defaultdict[str, list[int]] = defaultdict(list)  # row-blocked constant -> its pages
    for name, j in page_of.items():
        if weight[name].rows is not None:
            block_pages[weight[name].source].append(j)
    readers = defaultdict(list)  # page -> (position in plan.steps, block) of the nodes reading it
    first_device = None
    for pos, i in enumerate(plan.steps):
        for x in plan.nodes[i].inputs:
            if x in page_of:
                readers[page_of[x]].append((pos, 0))
            for k, j in enumerate(block_pages.get(x, ())):
                readers[j].append((pos, k))
            if first_device is None and x in plan.constants and not isinstance(plan.constants[x], np.ndarray):
                first_device = (pos, 0)
    pages = len(residency.pages)
    for j in range(pages - slots):
        if max(readers[j]) >= min(readers[j + slots]):
            raise BudgetError(f"page {residency.pages[j]} is still read after page {residency.pages[j + slots]} "
                              f"needs its staging slot; use more staging slots than {slots}")
    plan.set_hooks({})
    was = dict(plan.constants)
    staged: dict = plan.staged_weights  # name -> staged host copy, kept while it streams or is mapped
    mapped = set(residency.mapped)
    streaming = set(residency.streamed_tensors)
    away = set(getattr(plan, "streamed_names", ())) | set(getattr(plan, "mapped_names", ()))
    away |= {name for name, host in staged.items() if plan.constants.get(name) is host}
    for name in sorted(away - streaming - mapped):
        # resident again: its host copy goes (a later re-plan that streams it stages it anew)
        plan.constants[name] = provider.upload(staged.pop(name))
    for name in sorted(mapped - set(getattr(plan, "mapped_names", ()))):
        if name not in staged:
            staged[name] = provider.stage(provider.download(plan.constants[name]))
        plan.constants[name] = provider.map_host(staged[name])
    plan.mapped_names = mapped
    place = residency.placement()
    items: list[list] = [[] for _ in range(pages)]
    blocked: dict[str, dict[tuple[int, int], Any]] = defaultdict(dict)  # constant -> rows -> slot view
    for name, j in page_of.items():
        w = weight[name]
        value = plan.constants[w.tensor]
        if w.tensor not in staged:
            staged[w.tensor] = provider.stage(provider.download(value))
        host = staged[w.tensor]
        if w.rows is not None:
            n, axes = (splits or {})[w.node]
            host = block_of(host, axes[w.source], n, *w.rows)
        slot, offset = place[name]
        view = stream.view(slot, offset, tuple(host.shape), host.dtype)
        items[j].append((host, view))
        if w.rows is None:
            plan.constants[name] = view
        else:
            blocked[w.source][w.rows] = view
    for name, views in blocked.items():
        plan.constants[name] = views[min(views)]  # what the node reads is a slot view (block 0's)
    plan.streamed_names = streaming
    forget(plan, {name for name, value in plan.constants.items() if was.get(name) is not value})
    if pages:
        plan.set_hooks(_hooks(plan, stream, items, readers, slots, first_device,
                              _row_blocks(plan, blocked, splits or {})))
    provider.reset_peak()  # give the device copies of the streamed weights back to the device


def _row_blocks(plan, blocked: dict, splits: dict) -> dict[int, tuple]:
    """Position in ``plan.steps`` -> (RowSplit, ranges, per-block views by input position) of the
    nodes that run in row blocks."""
    out = {}
    for pos, i in enumerate(plan.steps):
        node = plan.nodes[i]
        inputs = [x for x in node.inputs if x in blocked]
        if not inputs:
            continue
        n, axes = splits[node.name]
        ranges = sorted(blocked[inputs[0]])
        split = rowblocks.RowSplit(n, {k: axes[x] for k, x in enumerate(node.inputs) if x in axes})
        views = [{k: blocked[x][r] for k, x in enumerate(node.inputs) if x in blocked} for r in ranges]
        out[pos] = (split, ranges, views)
    return out


def forget(plan, names: set[str]) -> None:
    """Drop the run memos (:data:`core.ops.RUN_MEMO`, and the row-block contexts, whose caches
    hold their own) of the nodes that read a constant of ``names`` (one that moved: evicted,
    streamed, mapped or resident again).

    A memo keeps a node's last arguments: the cuda eager replay's (providers/cuda/replay.py)
    would hold a moved weight's old device copy until the node next ran with other inputs, and
    the pool block after that: after a KV growth re-plan the driver saw the evicted weights'
    bytes on top of the new plan (1.6 GiB over an 8 GiB device budget at batch 32). The rest of
    a node's cache stays: its prepare hook's record of the weight's layout (a packed fp16 or
    int4 weight's geometry) describes the streamed copy too.
    """
    if not names:
        return
    for i, node in enumerate(plan.nodes):
        if any(x in names for x in node.inputs):
            cache = plan.contexts[i].cache
            cache.pop(RUN_MEMO, None)
            cache.pop(CONTEXTS, None)


def streamed(plan, name: str) -> bool:
    """True when constant ``name`` of ``plan`` streams (reads a staging slot)."""
    return name in getattr(plan, "streamed_names", ())


def mapped(plan, name: str) -> bool:
    """True when constant ``name`` of ``plan`` is read in place from host memory (a mapped table)."""
    return name in getattr(plan, "mapped_names", ())


def _hooks(plan, stream, items, readers, slots: int, first_device,
           row_blocks: dict[int, tuple]) -> dict[int, NodeHooks]:
    """Node index -> its :class:`NodeHooks`: the schedule of the module docstring, as actions
    around the launches of the nodes that act (per row block for those in ``row_blocks``)."""
    pages = len(items)

    def copier(j: int) -> Callable[[], None]:
        return lambda: stream.copy(j % slots, items[j])

    # actions keyed by (position, block): a row-blocked node runs them around each block
    before: defaultdict[tuple[int, int], list[Callable[[], None]]] = defaultdict(list)
    after: defaultdict[tuple[int, int], list[Callable[[], None]]] = defaultdict(list)
    start = min(first_device if first_device is not None else (0, 0), min(readers[0]))
    before[start].append(stream.begin)
    before[start].extend(copier(j) for j in range(min(slots, pages)))
    for j in range(pages):
        slot = j % slots
        before[min(readers[j])].append(partial(stream.ready, slot))
        after[max(readers[j])].append(partial(stream.release, slot))
        if j + slots < pages:
            after[max(readers[j])].append(copier(j + slots))
    after[max(readers[pages - 1])].append(stream.end)
    hooks = {}
    for pos in {p for p, _ in (*before, *after)}:
        i = plan.steps[pos]
        if pos in row_blocks:
            split, ranges, views = row_blocks[pos]
            launches = [Launch(tuple(before[(pos, k)]), tuple(after[(pos, k)]), rows, views[k])
                        for k, rows in enumerate(ranges)]
            hooks[i] = NodeHooks(launches, split.n, split.axes)
        else:
            hooks[i] = NodeHooks([Launch(tuple(before[(pos, 0)]), tuple(after[(pos, 0)]))])
    return hooks

"""``lockstep profile MODEL --kernels``: where the time of one decode step and of one prefill
goes, node by node.

A :class:`NodeObserver` set as :attr:`core.executor.Plan.observer` is told about every node a
plan run executes. It counts, per node: calls, the positions its first input holds (rows of
``[B, S, ...]``: what a prefill computed, padding included), the bytes it reads and writes,
the FLOPs of projections, and, with a provider's node timer, the time between a mark recorded
before the kernel and one after it (CUDA events on the provider's stream on ``cuda``, so GPU
time; ``time.perf_counter`` on ``cpu_reference``, whose kernels run synchronously).

Node timer (an optional provider member, docs/providers.md): ``node_timer()`` returns an
object with ``mark() -> token`` (a point in the provider's stream of work) and
``seconds(start, end) -> float`` (the time between two marks, valid after
``provider.synchronize()``), or None when the provider cannot time its nodes.

Bytes: a constant input is a weight (its full size, except a gather table and its scales: the
rows gathered; and a rotary cache of attention: the rows of the positions run); a KV cache
buffer counts its live positions only (the profile's live fraction: positions held /
capacity) and, as an output written in place, the new positions; every other input and
output counts its size. The floor of a row is
``max(bytes / bandwidth, flops / tensor rate)`` with the provider's measured
``device_bandwidth()`` and a tensor rate the user states (``--tensor-tflops``); "% of floor"
is floor / measured time.

Decode steps run eagerly (no capture: a replayed graph cannot be timed per node); the
``decode_advance`` and ``device_argmax`` launches that surround the plan are timed once each
after the measured steps and shown as rows of their own.

Prefill (:func:`profile_prefill`): after the decode steps, one prefill of the point's rows
(batch x prompt length, all of one length: one padded plan run, core.runtime.prompts) is timed
whole (wall, device-complete) and then one more node by node with the same observer, both after
the point's first prefill of that shape (the warm-up: allocations, compiles). Its KV buffers
count the prompt's positions read and written (prompt length / capacity of each). Its table
covers the plan's nodes (the uploads of the prompt and the argmax after the plan are not in it);
a node's positions are the rows of its first input per call: batch x prompt length for the
projections of the layers, batch for those after the last-position gather (the lm_head).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from typing import Any

import attrs
import numpy as np

from core.executor import GATHER_OPS, kernel_name
from core.protocol import NodeInfo

#: Ops whose FLOPs are counted: ``2 * rows * K * N`` (the gated ones: two projections).
PROJECTION_OPS = {"MatMul": 1, "MatMulNBits": 1, "SiluGatedMatMul": 2, "SiluGatedMatMulNBits": 2}


class HostNodeTimer:
    """A node timer from the host clock (``time.perf_counter``), for providers whose kernels
    have finished when they return (cpu_reference)."""

    def mark(self) -> float:
        """The host clock now, in seconds."""
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        """Seconds between two marks."""
        return end - start


@attrs.define
class NodeStats:
    """What one node did over the observed runs (totals; divide by steps for per step).

    Attributes:
        name, op, kernel: the node, its op type and its kernel's name.
        calls: runs of the node observed.
        positions: positions (rows of its first input, all axes but the last) it processed.
        seconds: time between its marks (0 without a timer).
        bytes_read, bytes_written: see the module docstring.
        flops: floating-point operations of a projection (0 for other ops).
    """

    name: str
    op: str
    kernel: str
    calls: int = 0
    positions: int = 0
    seconds: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    flops: float = 0.0


def _nbytes(value: Any) -> int:
    return int(getattr(value, "nbytes", 0) or 0)


def _short_kernel(kernel: Any) -> str:
    """The kernel's module and function, without wrapper notes."""
    inner = getattr(kernel, "run", None)
    while inner is not None and not hasattr(kernel, "__qualname__"):
        kernel, inner = inner, getattr(inner, "run", None)
    name = kernel_name(kernel).split(" (wrapped", 1)[0]
    return name.removeprefix("providers.")


class NodeObserver:
    """A :attr:`core.executor.Plan.observer` that counts (and optionally times) every node.
    ``hold_next``: set it to make the timer's ``hold()`` (where it has one) wait the GPU just
    before the next node's first mark (after the run's uploads), once.

    Args:
        plan: the plan observed (its constants tell weights from activations).
        timer: a node timer (module docstring), or None to count without timing.
        kv_buffers: the KV cache buffers (their live fraction is counted, not their size).

    Attributes:
        stats: node name -> :class:`NodeStats`, in first-run order.
        kv_read_fraction, kv_write_fraction: the fraction of each KV buffer a step reads
            (positions held / capacity) and writes (new positions / capacity); set by the
            caller before each run.
    """

    def __init__(self, plan, timer: Any = None, kv_buffers: list | tuple = ()):
        self.plan, self.timer = plan, timer
        self.kv = {id(t) for t in kv_buffers}
        self.kv_read_fraction = self.kv_write_fraction = 1.0
        self.hold_next = False
        self.stats: dict[str, NodeStats] = {}
        self._pending: list[tuple[NodeStats, Any, Any]] = []
        self._start: Any = None
        self._kernels = {plan.nodes[i].name: plan.kernels[i] for i in range(len(plan.nodes))}

    def begin(self, node: NodeInfo) -> None:
        """Called by the plan before ``node``'s kernel."""
        if self.hold_next and hasattr(self.timer, "hold"):
            self.timer.hold()
        self.hold_next = False
        if self.timer is not None:
            self._start = self.timer.mark()

    def end(self, node: NodeInfo, args: list, results: Any) -> None:
        """Called by the plan after ``node``'s kernel with its arguments and results."""
        end = self.timer.mark() if self.timer is not None else None
        st = self.stats.get(node.name)
        if st is None:
            st = self.stats[node.name] = NodeStats(node.name, node.op_type,
                                                   _short_kernel(self._kernels.get(node.name)))
        st.calls += 1
        first = args[0] if args else None
        shape = tuple(getattr(first, "shape", ()))
        rows = int(np.prod(shape[:-1])) if len(shape) >= 2 else 1
        st.positions += rows
        out_bytes = sum(_nbytes(r) for r in results if r is not None and id(r) not in self.kv)
        constants = self.plan.constants
        for name, value in zip(node.inputs, args):
            if value is None:
                continue
            if id(value) in self.kv:
                st.bytes_read += _nbytes(value) * self.kv_read_fraction
            elif name in constants and node.op_type == "GroupQueryAttention" and getattr(value, "ndim", 0) == 2:
                st.bytes_read += _nbytes(value) * min(1.0, rows / max(1, value.shape[0]))  # cos/sin rows read
            elif name in constants and node.op_type == "GatherColumns" and name == node.inputs[0]:
                st.bytes_read += out_bytes  # a copy of the columns gathered (the table may be packed)
            elif name in constants and node.op_type in GATHER_OPS and name != node.inputs[1]:
                # a table (or its scales): the rows gathered, not the whole tensor
                picked = int(getattr(args[1], "size", 1))
                st.bytes_read += _nbytes(value) / max(1, value.shape[0]) * picked
            else:
                st.bytes_read += _nbytes(value)
        st.bytes_written += out_bytes + sum(_nbytes(r) * self.kv_write_fraction for r in results
                                            if r is not None and id(r) in self.kv)
        mult = PROJECTION_OPS.get(node.op_type)
        if mult and results and results[0] is not None and len(shape) >= 2:
            st.flops += 2.0 * rows * int(shape[-1]) * int(results[0].shape[-1]) * mult
        if end is not None:
            self._pending.append((st, self._start, end))

    def collect(self) -> None:
        """Add the pending marks' times to :attr:`stats` (synchronises the provider first)."""
        if not self._pending:
            return
        self.plan.provider.synchronize()
        for st, start, end in self._pending:
            st.seconds += self.timer.seconds(start, end)
        self._pending.clear()


def role(name: str) -> str:
    """A node name with its layer index replaced by ``*`` (``/model/layers.3/attn/...`` ->
    ``/model/layers.*/attn/...``): the rows of the table group a node across layers."""
    return re.sub(r"layers\.\d+", "layers.*", name)


@attrs.frozen
class KernelRow:
    """One row of the kernel table (per decode step or per prefill; times in microseconds,
    sizes in bytes; ``positions``: rows of the first input per call, 0 in the totals row)."""

    node: str
    op: str
    kernel: str
    calls: float
    us: float
    bytes: float
    flops: float
    floor_us: float | None
    pct_of_floor: float | None
    positions: float = 0.0


def table_rows(stats: list[NodeStats], steps: int, bandwidth: float | None,
               tensor_flops: float | None) -> list[KernelRow]:
    """Group node stats by (layer-free node name, op, kernel), per step, sorted by time (the
    longest first); the floor as in the module docstring (None when neither rate is known)."""
    groups: dict[tuple, list[NodeStats]] = defaultdict(list)
    for st in stats:
        groups[(role(st.name), st.op, st.kernel)].append(st)
    rows = []
    for (node, op, kernel), sts in groups.items():
        us = sum(s.seconds for s in sts) / steps * 1e6
        nbytes = sum(s.bytes_read + s.bytes_written for s in sts) / steps
        flops = sum(s.flops for s in sts) / steps
        floor = _floor(nbytes, flops, bandwidth, tensor_flops)
        calls = sum(s.calls for s in sts)
        rows.append(KernelRow(node, op, kernel, calls / steps, us, nbytes, flops, floor,
                              None if floor is None or us <= 0 else 100.0 * floor / us,
                              sum(s.positions for s in sts) / max(1, calls)))
    rows.sort(key=lambda r: -r.us)
    return rows


def _floor(nbytes: float, flops: float, bandwidth: float | None, tensor_flops: float | None) -> float | None:
    parts = []
    if bandwidth:
        parts.append(nbytes / bandwidth * 1e6)
    if tensor_flops and flops:
        parts.append(flops / tensor_flops * 1e6)
    return max(parts) if parts else None


def totals(rows: list[KernelRow], bandwidth: float | None, tensor_flops: float | None) -> KernelRow:
    """The totals row: sums of calls, time, bytes and FLOPs; the floor of the sums."""
    us = sum(r.us for r in rows)
    nbytes, flops = sum(r.bytes for r in rows), sum(r.flops for r in rows)
    floor = _floor(nbytes, flops, bandwidth, tensor_flops)
    return KernelRow("total", "", "", sum(r.calls for r in rows), us, nbytes, flops, floor,
                     None if floor is None or us <= 0 else 100.0 * floor / us)


def _timer(provider) -> Any:
    return provider.node_timer()


def profile_kernels(model_dir, provider, batches: list[int], args, progress=None) -> list[dict]:
    """Time every node of ``args.tokens`` eager decode steps per prompt length and batch size.

    Args:
        model_dir: a builder model folder.
        provider: a provider name or object (it must offer ``node_timer()``).
        batches: batch sizes.
        args: the ``lockstep profile`` options (prompt_len, context, warmup, tokens, layout,
            tensor_tflops, weight_budget, device_budget).
        progress: ``progress(done, total)`` after each batch size.

    Returns:
        One dict per (prompt length, batch): ``prompt_len``, ``batch``, ``capacity``,
        ``steps``, ``step_ms`` (eager wall time per step, median), ``bandwidth`` (bytes/s or
        None), ``tensor_flops`` (FLOP/s or None), ``kernels`` (:class:`KernelRow` dicts, per
        step, the longest first), ``total`` (their totals) and ``prefill`` (one prefill of the
        point's rows node by node: :func:`profile_prefill`).

    Raises:
        core.session.RequestError: the provider cannot time its nodes, or a prompt length with
            its steps exceeds the model context.
    """
    from core.generation.loop import decode
    from core.models.model import load_model
    from core.profile import capacity_for, prompt_lengths, provider_settings
    from core.runtime.runner import Runner
    from core.session import RequestError, Session

    model = load_model(model_dir)
    lengths = prompt_lengths(args)
    capacities = [capacity_for(n, args, model.config.context_length) for n in lengths]
    runner = Runner(model, provider, args.layout, weight_budget=getattr(args, "weight_budget", None),
                    device_budget=getattr(args, "device_budget", None))
    p = runner.provider
    timer = _timer(p)
    if timer is None:
        raise RequestError(f"provider {p.name!r} cannot time its nodes (it has no node_timer(); "
                           "docs/providers.md \"Optional: node timing\"), so --kernels cannot run on it")
    bandwidth = p.device_bandwidth()
    tflops = getattr(args, "tensor_tflops", None)
    rate = tflops * 1e12 if tflops else None
    rng = np.random.default_rng(0)
    out = []
    for length, capacity in zip(lengths, capacities):
        for batch in batches:
            rows = [list(rng.integers(3, model.config.vocab_size, length)) for _ in range(batch)]
            session = Session(runner, batch=batch, capacity=capacity, kv_layout=args.layout, kv_policy="fixed",
                              capture=False)
            state, plan = session.state, runner.plan
            decode(session, rows, args.warmup)
            walls = []
            for _ in range(max(1, args.tokens // 2)):  # the eager wall time, without the observer
                t0 = time.perf_counter()
                session.step()
                walls.append(time.perf_counter() - t0)
            obs = NodeObserver(plan, timer, state.kv.buffers())
            hold = getattr(timer, "hold", None)
            plan.observer = obs
            try:
                for _ in range(args.tokens):
                    obs.kv_read_fraction = float(state.lengths.mean() + 1) / state.kv.geometry.capacity
                    obs.kv_write_fraction = 1.0 / state.kv.geometry.capacity
                    if hold is not None:  # the GPU waits while the host enqueues the step
                        hold()
                    session.step()
                    obs.collect()
            finally:
                plan.observer = None
            stats = list(obs.stats.values()) + _loop_stats(p, timer, state, args.tokens)
            kernels = table_rows(stats, args.tokens, bandwidth, rate)
            out.append({"prompt_len": length, "batch": batch, "capacity": capacity, "steps": args.tokens,
                        "step_ms": float(np.median(walls)) * 1e3, "bandwidth": bandwidth, "tensor_flops": rate,
                        "kernels": [attrs.asdict(r) for r in kernels],
                        "total": attrs.asdict(totals(kernels, bandwidth, rate)), "settings": provider_settings(p),
                        "prefill": profile_prefill(session, rows, timer, bandwidth, rate)})
            session.close()
            if progress is not None:
                progress(len(out), len(lengths) * len(batches))
    return out


def profile_prefill(session, rows: list, timer, bandwidth: float | None, tensor_flops: float | None) -> dict:
    """One prefill of ``rows`` (equal lengths) on ``session``, which ran one of that shape
    already (the warm-up), timed whole and then node by node (module docstring, "Prefill").

    Returns:
        ``positions`` (batch x prompt length), ``prefill_ms`` (wall, device-complete: the device
        synchronised before, the ``[B, 2]`` result downloaded at the end), ``tokens_per_s``
        (positions / that time), ``kernels`` (:class:`KernelRow` dicts for the one prefill, the
        longest first) and ``total``.
    """
    p, state = session.provider, session.state
    p.synchronize()
    t0 = time.perf_counter()
    session.prefill(rows)
    wall = time.perf_counter() - t0
    obs = NodeObserver(session.plan, timer, state.kv.buffers())
    obs.kv_read_fraction = obs.kv_write_fraction = len(rows[0]) / state.kv.geometry.capacity
    obs.hold_next = True  # the GPU waits while the host enqueues the prefill's nodes
    session.plan.observer = obs
    try:
        session.prefill(rows)
        obs.collect()
    finally:
        session.plan.observer = None
    kernels = table_rows(list(obs.stats.values()), 1, bandwidth, tensor_flops)
    positions = len(rows) * len(rows[0])
    return {"positions": positions, "prefill_ms": wall * 1e3, "tokens_per_s": positions / wall,
            "kernels": [attrs.asdict(r) for r in kernels],
            "total": attrs.asdict(totals(kernels, bandwidth, tensor_flops))}


def _loop_stats(p, timer, state, steps: int) -> list[NodeStats]:
    """The two launches around the plan in a decode step, timed once each after the measured
    steps and counted as ``steps`` calls: ``device_argmax`` (it rewrites ``result`` from the
    same logits) and then ``decode_advance`` (it moves the state on; the session is closed
    after it, and the next prefill rewrites lengths and mask). Where the timer can hold the GPU
    (``hold()``), the GPU waits while the host enqueues both, so the events time GPU work and not
    the host's launch gaps (as for the plan's nodes)."""
    hold = getattr(timer, "hold", None)
    if hold is not None:
        hold()
    marks = [timer.mark()]
    p.device_argmax(state.logits, state.positions, state.result)
    marks.append(timer.mark())
    p.decode_advance(state.result, state.input_ids, state.attention_mask, state.lengths_dev)
    marks.append(timer.mark())
    p.synchronize()
    logits = _nbytes(state.logits)
    small = _nbytes(state.result) + _nbytes(state.input_ids) + 2 * _nbytes(state.lengths_dev)
    names = [("device_argmax", logits + _nbytes(state.positions), _nbytes(state.result)),
             ("decode_advance", small, _nbytes(state.input_ids) + _nbytes(state.lengths_dev))]
    out = []
    for (name, read, written), a, b in zip(names, marks, marks[1:]):
        out.append(NodeStats(f"({name})", name, type(p).__name__ + "." + name, steps, 0, timer.seconds(a, b) * steps,
                             read * steps, written * steps))
    return out


def render(result: dict, title: str, prefill: bool = False):
    """A rich Table of one :func:`profile_kernels` entry (the totals row last): its decode step,
    or with ``prefill`` its prefill (per prefill, with the positions and GFLOPs of each row)."""
    from rich.table import Table

    head = f"{title}: prompt {result['prompt_len']}, batch {result['batch']}, "
    if prefill:
        result = result["prefill"]
        table = Table(title=f"{head}prefill of {result['positions']:,} positions, {result['prefill_ms']:,.3f} ms "
                            f"wall ({result['tokens_per_s']:,.0f} tok/s)")
    else:
        table = Table(title=f"{head}per decode step, eager step {result['step_ms']:.3f} ms wall")
    for col in ("node", "op", "kernel"):
        table.add_column(col, overflow="fold")
    cols = ("calls", "positions", "us", "MB", "GFLOP") if prefill else ("calls", "us/step", "MB/step")
    for col in (*cols, "floor us", "% of floor"):
        table.add_column(col, justify="right")

    def line(r: dict, style: str = "") -> None:
        extra = ([f"{r['positions']:,.0f}" if r["positions"] else "-"] if prefill else [])
        cells = [r["node"], r["op"], r["kernel"], f"{r['calls']:g}", *extra, f"{r['us']:,.1f}",
                 f"{r['bytes'] / 1e6:,.3f}", *([f"{r['flops'] / 1e9:,.3f}"] if prefill else []),
                 "-" if r["floor_us"] is None else f"{r['floor_us']:,.1f}",
                 "-" if r["pct_of_floor"] is None else f"{r['pct_of_floor']:.0f}%"]
        table.add_row(*cells, style=style)

    for r in result["kernels"]:
        line(r)
    line(result["total"], "bold")
    return table


def kernels_main(args, console, table_console) -> int:
    """``lockstep profile MODEL --kernels``: print one kernel table per prompt length and
    batch size (and ``--json``: every table as data).

    Raises:
        core.session.RequestError: see :func:`profile_kernels`; an output folder that does not
            exist (checked first).
    """
    import json
    from pathlib import Path

    from rich.progress import Progress

    from core.session import RequestError

    if args.json_out and not Path(args.json_out).expanduser().resolve().parent.is_dir():
        raise RequestError(f"cannot write {args.json_out}: its folder does not exist")
    if getattr(args, "plot_out", None):
        raise RequestError("--plot draws the throughput sweep; it does not combine with --kernels")
    if args.tensor_tflops is not None and not args.tensor_tflops > 0:
        raise RequestError(f"--tensor-tflops must be a positive number, got {args.tensor_tflops}")
    batches = list(args.batch_sweep)
    title = f"{args.model} on {args.provider}, {args.layout}, eager"
    with Progress(console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("timing nodes", total=len(batches))
        results = profile_kernels(args.model, args.provider, batches, args,
                                  progress=lambda done, total: bar.update(task, completed=done, total=total))
    if results and results[0]["settings"]:
        from core.profile import settings_text

        title += f"; {settings_text(results[0]['settings'])}"
    for result in results:
        table_console.print(render(result, title))
        table_console.print(render(result, title, prefill=True))
    bw = results[0]["bandwidth"] if results else None
    rate = results[0]["tensor_flops"] if results else None
    clock = "CUDA events (GPU time)" if args.provider == "cuda" else "the provider's node timer"
    if bw is None and rate is None:
        floor = "no floor: the provider measures no bandwidth and no --tensor-tflops was given"
    else:
        parts = ([] if bw is None else [f"bytes over {bw / 1e9:,.0f} GB/s measured"]) + (
            [] if rate is None else [f"FLOPs over {rate / 1e12:,.0f} TFLOP/s stated"])
        floor = f"floor: {' or '.join(parts)} (the larger); % of floor = floor / time"
    table_console.print(f"us/step: {clock}, per node per decode step; prefill tables: per node of one prefill "
                        f"(after a warm-up prefill of its shape); {floor}")
    if args.json_out:
        with open(Path(args.json_out).expanduser(), "w") as f:
            json.dump({"title": title, "results": results}, f, indent=2)
    return 0

"""``lockstep profile``: decode throughput over a sweep of batch sizes and prompt lengths.

For each prompt length L of ``--prompt-len`` (one or a comma-separated list) and each batch
size B: a session whose KV capacity is ``--context`` or, when L + warm-up + measured steps do
not fit it, that many positions rounded up to 64 (at most the model context); B prompts of L
random tokens (row 0 the same prompt at every B), ``--warmup`` decode steps (these include the
capture warm-up and the capture), then ``--tokens`` measured steps. Each step ends when its
``[B, 2]`` argmax result is on the host, so step times are wall times of complete steps: the
time between two reads, which with the session's run-ahead (the default; ``--no-run-ahead``
turns it off) includes queueing the steps after it while the device runs. The "device ms" column
is the median device time of a measured step (the provider's node timer around the step's work,
:attr:`core.session.PendingStep.device_s`): ms/step minus it is what the host added.
The check column compares row 0's token stream with the batch-1 stream of the same L, bitwise.
The prefill is timed in steady state: each point first runs one untimed prefill of the same
shape (same rows, prompt length and capacity: the shape's allocations, plan buffers and, on
cuda, its kernel compiles happen there), then the timed one, whose wall time ends when the
``[B, 2]`` result is on the host (``download`` synchronises; the device is synchronised before it
starts), so it is device-complete. "prefill ms" is that time, "prefill tok/s" is batch x prompt
length / that time, beside the decode tok/s; the JSON keeps the untimed first prefill's wall time
as ``first_prefill_ms`` (what ``benchmarks/ort_genai_decode.py`` reports for the anchor). The warm-up
prefill is the only extra cost (one prefill a point; the batch-1 reference run of a sweep without
batch 1 runs none), and it is counted where the session counts prefills (``prefill_runs``, the
expert counters of a paged MoE model).
The peak column is the provider's peak device bytes (``provider.peak_bytes()`` after
``reset_peak()``, when it can tell) over the row's prefills and steps ("peak MiB"). Beside it,
what holds those bytes at the end of the row (:meth:`core.runtime.runner.Runner.memory`), so
that peak = weights + KV + work + other: the resident weights in the kernels' layout (the
staging ring included when weights stream), the KV cache, the workspace (activation buffers, the
provider's shared kernel scratch, the decode state's buffers) and "other", the peak minus those
three: pool blocks freed during the row and cached (a prefill's activations, freed node by node
as the run goes, its temporaries, a grouped prefill's KV scratch). The JSON's
``prefill_activation_bytes`` is the most bytes the prefill's node buffers held at once
(:attr:`core.executor.Plan.transient_peak_bytes`): the part of "other" the prefill's activations
explain.

What a run really took: "driver MiB" is the driver's figure of device bytes in use
(``provider.device_used_bytes()``: cudaMemGetInfo, the CUDA context and every pool included),
polled every 2 ms by :class:`core.runtime.meter.DriverMeter`, at most during the row; the title
gives the load time (planning and placing the weights, :attr:`Runner.load_seconds`), the same
figure at most while loading and before it; "host RSS MiB" is the process's peak resident set
(the page-cache pages of the memory-mapped weight files it touched included), "anon MiB" its
anonymous resident bytes at the row's end (heap and pinned staging: the streamed weights' one
host copy).
With weights streaming, "plan tok/s" is what ``lockstep plan`` expects at that batch
(:func:`core.plan.expected_rate`), beside the measured rate.

The floor column is the time to read once every weight byte a step reads (gather tables
excluded) at the provider's measured device bandwidth (``provider.device_bandwidth()`` in
bytes/s, when the provider offers it).
"""

from __future__ import annotations

import json
import time

import attrs
import numpy as np

from core.errors import BudgetError
from core.generation.loop import decode
from core.models.model import load_model
from core.plan import expected_rate
from core.plugins import get_provider
from core.runtime.kv import cache_bytes, round_capacity
from core.runtime.meter import DriverMeter, host_anon_bytes, host_rss_peak_bytes
from core.runtime.runner import Runner
from core.session import RequestError, Session


@attrs.frozen
class ProfileRow:
    """One batch size of a sweep (times in milliseconds, sizes in bytes)."""

    batch: int
    tokens_per_s: float
    step_ms_p50: float
    step_ms_p95: float
    floor_ms: float | None
    captures: int
    replays: int
    fallbacks: int
    invalidations: int
    kv_bytes_moved: int
    peak_device_bytes: int | None
    kv_bytes: int
    row0_matches_batch1: bool | None  # None: the point was refused (did not run)
    fallback_reasons: list = attrs.field(factory=list)
    weight_bytes_streamed_per_step: int = 0
    htod_bytes_per_token: float = 0.0
    page_ins_per_token: float = 0.0
    hit_rate: float = 1.0
    byte_hit_rate: float = 1.0
    copy_floor_ms: float | None = None
    prompt_len: int = 0
    capacity: int = 0
    prefill_ms: float = 0.0  # the steady-state prefill (the second of its shape; module docstring)
    anchor_tokens_per_s: float | None = None
    anchor_note: str = ""
    refused: str = ""  # why this point did not run (out of memory); its numbers are 0
    weight_device_bytes: int = 0  # resident weights + staging ring (Runner.memory)
    kv_device_bytes: int = 0
    workspace_bytes: int = 0
    prefill_activation_bytes: int = 0  # the prefill's node buffers held at once (Plan.transient_peak_bytes)
    settings: dict = attrs.field(factory=dict)  # the provider's switches (ExecutionProvider settings())
    device_ms_p50: float | None = None  # median device time of a measured step (PendingStep.device_s)
    run_ahead: bool = True  # the loop queued steps before reading the last (Session.run_ahead)
    driver_peak_bytes: int | None = None  # the driver's device bytes in use at most during the row (polled)
    driver_baseline_bytes: int | None = None  # the same figure before the model was loaded (context, other work)
    load_driver_peak_bytes: int | None = None  # the driver's figure at most while the Runner loaded
    load_s: float = 0.0  # seconds to plan and place the weights (Runner construction)
    host_rss_peak_bytes: int = 0  # the process's peak resident set size so far (mapped weight pages included)
    host_anon_bytes: int | None = None  # anonymous resident bytes at the row's end (heap, pinned staging)
    predicted_tok_s: float | None = None  # the plan's expected rate at this batch (core.plan.expected_rate)
    experts: dict | None = None  # the expert_* counters of a paged MoE model (docs/moe.md, "Expert budgets")
    workspace_reserved_bytes: int = 0  # the workspace a device budget reserved (Runner.workspace_reserved)
    prefill_tokens_per_s: float = 0.0  # batch x prompt length / prefill_ms
    first_prefill_ms: float = 0.0  # the shape's first prefill (allocations, compiles), untimed in the rates
    anchor_prefill_ms: float | None = None  # the anchor's steady-state prefill_ms at this point

    @property
    def other_bytes(self) -> int | None:
        """The peak minus weights, KV and workspace (pool blocks freed and cached), or None."""
        if self.peak_device_bytes is None:
            return None
        return self.peak_device_bytes - self.weight_device_bytes - self.kv_device_bytes - self.workspace_bytes


def provider_settings(provider) -> dict[str, str]:
    """``provider.settings()`` (the switches that change how it runs) as strings ({} by
    default: :class:`core.provider.ProviderBase`)."""
    return {str(k): str(v) for k, v in provider.settings().items()}


def settings_text(settings: dict[str, str]) -> str:
    """``"name=value, ..."`` for a title, or "" without settings."""
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def _stream(runner: Runner, batch, args, prompt, rng, bandwidth, h2d=None, capacity=None, meter=None,
            warm_prefill=True):
    """One sweep point: (its row, row 0's tokens). ``warm_prefill``: run the untimed first prefill
    of the shape before :func:`decode` (module docstring; off for the batch-1 reference run)."""
    vocab = runner.model.config.vocab_size
    rows = [prompt] + [list(rng.integers(3, vocab, len(prompt))) for _ in range(batch - 1)]
    capacity = capacity or args.context
    session = Session(runner, batch=batch, capacity=capacity, kv_layout=args.layout,
                      kv_policy="fixed", capture=False if args.no_capture else None,
                      run_ahead=not getattr(args, "no_run_ahead", False))
    p = runner.provider
    runner.plan.release_buffers()  # the last point's activations: not this point's peak
    p.reset_peak()
    if meter is not None:
        meter.reset()
    first_s = 0.0
    if warm_prefill:  # the shape's first prefill: the timed one (decode's) is the second
        t0 = time.perf_counter()
        session.prefill(rows)
        first_s = time.perf_counter() - t0
        p.synchronize()
    trace = decode(session, rows, args.warmup + args.tokens)
    times_ms = np.array(trace.seconds[1 + args.warmup:]) * 1e3
    device = [d for d in trace.device_seconds[args.warmup:] if d is not None]
    c = session.counters
    memory = runner.memory(session.state)
    floor = None if bandwidth is None else runner.plan.step_weight_bytes() / bandwidth * 1e3
    streamed = c.weight_bytes_streamed_per_step
    row = ProfileRow(batch, batch * len(times_ms) / (times_ms.sum() / 1e3), float(np.percentile(times_ms, 50)),
                     float(np.percentile(times_ms, 95)), floor, c.captures, c.replays,
                     len(c.fallbacks), c.invalidations, c.kv_bytes_moved, p.peak_bytes(), c.kv_bytes,
                     False, list(c.fallbacks), streamed, c.htod_bytes_per_token, c.page_ins_per_token,
                     c.hit_rate, c.byte_hit_rate, None if not (h2d and streamed) else streamed / h2d * 1e3,
                     len(prompt), capacity, trace.seconds[0] * 1e3, weight_device_bytes=memory.weights + memory.staging,
                     kv_device_bytes=memory.kv, workspace_bytes=memory.workspace,
                     prefill_activation_bytes=runner.plan.transient_peak_bytes, settings=provider_settings(p),
                     device_ms_p50=float(np.percentile(device, 50)) * 1e3 if device else None,
                     run_ahead=session.run_ahead, host_rss_peak_bytes=host_rss_peak_bytes(),
                     host_anon_bytes=host_anon_bytes(), workspace_reserved_bytes=runner.workspace_reserved,
                     predicted_tok_s=expected_rate(streamed, runner.residency.weight_bytes_resident, batch, None,
                                                   h2d, bandwidth) if streamed else None,
                     experts={k: v for k, v in c.to_dict().items() if k.startswith("expert_")}
                     if getattr(runner, "expert_residency", None) is not None else None,
                     prefill_tokens_per_s=batch * len(prompt) / trace.seconds[0], first_prefill_ms=first_s * 1e3)
    if meter is not None:
        meter._sample()
        row = attrs.evolve(row, driver_peak_bytes=meter.peak_bytes, driver_baseline_bytes=meter.baseline_bytes)
    session.close()
    return row, trace.tokens[:, 0].tolist()


def prompt_lengths(args) -> list[int]:
    """``args.prompt_len`` as a list (one int or a list of ints)."""
    value = args.prompt_len
    return list(value) if isinstance(value, (list, tuple)) else [int(value)]


def capacity_for(prompt_len: int, args, context_length: int) -> int:
    """The KV capacity a sweep row uses (module docstring).

    Raises:
        core.session.RequestError: prompt + warm-up + measured steps exceed the model context.
    """
    need = prompt_len + args.warmup + args.tokens + 1
    if need > context_length:
        raise RequestError(f"--prompt-len {prompt_len} with {args.warmup} warm-up and {args.tokens} measured "
                           f"steps needs {need} positions; the model context is {context_length}")
    context = min(args.context, context_length)  # --context past the model's context: the model's
    return context if need <= context else round_capacity(need, context_length)


def _announce(runner: Runner, batches: list[int], lengths: list[int], capacity: int, args, announce) -> None:
    """Time a batch-1 prefill and three decode steps, and pass ``announce`` the sweep's size and
    expected duration (:mod:`core.sweep`) before it starts."""
    from core import sweep

    prompt = [3] * lengths[0]
    session = Session(runner, batch=1, capacity=capacity, kv_layout=args.layout, kv_policy="fixed",
                      capture=False if args.no_capture else None, run_ahead=False)  # each step timed whole
    trace = decode(session, [prompt], 3)
    session.close()
    runner.release_states()
    step_s = min(trace.seconds[1:])  # the first steps may include a capture or a kernel compile
    total = sweep.estimate_s(args.provider, batches, lengths, args.warmup, args.tokens, step_s, trace.seconds[0])
    steps = sweep.planned_steps(batches, lengths, args.warmup, args.tokens)
    announce(f"profile: batches {','.join(map(str, batches))} x prompt length {','.join(map(str, lengths))}: "
             f"{steps} decode steps ({args.warmup} warm-up + {args.tokens} measured a point); about "
             f"{sweep.duration(total)} (a batch-1 step takes {step_s * 1e3:.0f} ms here; --batch-sweep and "
             "--tokens make it shorter)")


def profile(model_dir, provider, batches: list[int], args, progress=None, announce=None) -> list[ProfileRow]:
    """Run the sweep on one Runner (the weights are uploaded once); returns one
    :class:`ProfileRow` per prompt length and batch size (prompt lengths outermost).
    ``announce``, when given, gets one line with the sweep's size and expected duration first.
    Each point runs one untimed prefill of its shape before the timed one (the steady-state
    prefill, module docstring): one prefill more a point than it reports.

    Raises:
        core.session.RequestError: a prompt length with its steps exceeds the model context.
    """
    model = load_model(model_dir)
    lengths = prompt_lengths(args)
    capacities = [capacity_for(n, args, model.config.context_length) for n in lengths]
    rng = np.random.default_rng(0)
    provider = get_provider(provider)
    # the bandwidth probes take device memory of their own: measured before the model is there
    bandwidth = provider.device_bandwidth()
    h2d = provider.host_to_device_bandwidth()
    meter = DriverMeter(provider)
    with meter:
        runner = Runner(model, provider, args.layout, weight_budget=getattr(args, "weight_budget", None),
                        device_budget=getattr(args, "device_budget", None),
                        expert_budget=getattr(args, "expert_budget", None),
                        reserve_for=(max(batches), max(capacities)))  # the sweep's largest state
    load = {"load_s": runner.load_seconds, "load_driver_peak_bytes": meter.peak_bytes}
    h2d = h2d if runner.residency.streams else None
    if announce is not None:
        _announce(runner, batches, lengths, capacities[0], args, announce)
    with meter:
        rows = _sweep(runner, model, batches, args, lengths, capacities, rng, bandwidth, h2d, meter, progress)
    return [attrs.evolve(r, **load) for r in rows]


def _sweep(runner, model, batches, args, lengths, capacities, rng, bandwidth, h2d, meter, progress):
    """:func:`profile`'s loop over prompt lengths and batch sizes on one Runner."""
    rows: list[ProfileRow] = []
    total = len(lengths) * len(batches)
    for length, capacity in zip(lengths, capacities):
        prompt = list(rng.integers(3, model.config.vocab_size, length))
        reference = None
        for batch in batches:
            too_big = _does_not_fit(model, runner.provider, batch, capacity)
            if too_big:  # refused before it runs: a host provider would meet the OOM killer, not MemoryError
                rows.append(_refused(batch, length, capacity, too_big))
                if progress is not None:
                    progress(len(rows), total, rows[-1])
                continue
            try:
                row, stream = _stream(runner, batch, args, prompt, rng, bandwidth, h2d, capacity, meter)
            except (MemoryError, BudgetError) as exc:  # this point does not fit: say so, keep the sweep going
                why = f"over the budget ({exc})" if isinstance(exc, BudgetError) else f"out of memory ({exc})"
                rows.append(_refused(batch, length, capacity, why))
                runner.release_states()
                if progress is not None:
                    progress(len(rows), total, rows[-1])
                continue
            if reference is None:
                reference = stream if batch == 1 else _stream(runner, 1, args, prompt, rng, None, None,
                                                              capacity, warm_prefill=False)[1]
            rows.append(attrs.evolve(row, row0_matches_batch1=stream == reference))
            runner.release_states()  # no later point has this shape: free its KV before the next
            if progress is not None:
                progress(len(rows), total, rows[-1])
    return rows


def _refused(batch: int, length: int, capacity: int, why: str) -> ProfileRow:
    return ProfileRow(batch=batch, tokens_per_s=0.0, step_ms_p50=0.0, step_ms_p95=0.0, floor_ms=None, captures=0,
                      replays=0, fallbacks=0, invalidations=0, kv_bytes_moved=0, peak_device_bytes=None,
                      kv_bytes=0, row0_matches_batch1=None, prompt_len=length, capacity=capacity, refused=why)


def _does_not_fit(model, provider, batch: int, capacity: int) -> str:
    """Why a sweep point would not fit in memory, or "" when it does (or nothing is known): its KV
    cache (2 x layers x batch x kv heads x capacity x head size x the KV dtype's bytes) and its
    last-position logits (batch x vocab x 4 bytes) against the provider's free device memory
    (``free_device_bytes()``), or, for a provider that reports none (a host provider), the host's
    available memory. The KV estimate is the cache's exact size; the step's other buffers are not
    counted, so a point just under the limit can still fail, with MemoryError where the provider
    raises it."""
    from core.runtime import residency

    cfg = model.config
    need = cache_bytes(cfg, batch, capacity, np.dtype(model.io_dtype).itemsize) + batch * cfg.vocab_size * 4
    free = provider.free_device_bytes()
    where = f"{getattr(provider, 'name', 'the provider')} has" if free is not None else "the host has"
    if free is None:
        free = residency.available_host_bytes()
    if free is None or need <= free:
        return ""
    gib = 2 ** 30
    return f"out of memory (needs ~{need / gib:,.1f} GiB of KV cache and logits; {where} {free / gib:,.1f} GiB free)"


def load_anchor(path: str) -> dict[tuple[int, int], dict]:
    """The rows of an anchor file (``benchmarks/ort_genai_decode.py --json``) by
    (prompt length, batch).

    Raises:
        core.session.RequestError: the file is missing, not JSON, or has no such rows.
    """
    from pathlib import Path

    try:
        data = json.loads(Path(path).expanduser().read_text())
        return {(int(r["prompt_len"]), int(r["batch"])): r for r in data["rows"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RequestError(f"cannot read the anchor file {path}: {exc} (expected the --json output of "
                           "benchmarks/ort_genai_decode.py)") from None


def with_anchor(rows: list[ProfileRow], anchor: dict[tuple[int, int], dict]) -> list[ProfileRow]:
    """``rows`` with the anchor's tokens/s and prefill ms (or why it has none) at the same
    prompt length and batch."""
    out = []
    for r in rows:
        a = anchor.get((r.prompt_len, r.batch))
        if a is None:
            out.append(attrs.evolve(r, anchor_note="not run"))
        elif a.get("tokens_per_s") is None:
            out.append(attrs.evolve(r, anchor_note=f"refused: {a.get('refused') or '?'}"))
        else:
            prefill = a.get("prefill_ms")
            out.append(attrs.evolve(r, anchor_tokens_per_s=float(a["tokens_per_s"]),
                                    anchor_prefill_ms=None if prefill is None else float(prefill),
                                    anchor_note="graph" if a.get("graph") else ""))
    return out


def render(rows: list[ProfileRow], title: str):
    """The sweep as two rich Tables in a Group, one row per batch size: speed (decode and prefill
    tok/s, step times, floor, prefill ms, batch invariance, the weight-stream and anchor columns
    when present; the anchor's prefill ms when its file has them), then
    capture and device memory (captures, replays, fallbacks, KV bytes moved, the peak and its
    parts). Two tables of about 100 columns each rather than one of 220."""
    from rich.console import Group
    from rich.table import Table

    streams = any(r.weight_bytes_streamed_per_step for r in rows)
    anchored = any(r.anchor_note or r.anchor_tokens_per_s is not None for r in rows)
    timed = any(r.device_ms_p50 is not None for r in rows)
    anchor_prefill = any(r.anchor_prefill_ms is not None for r in rows)
    speed_cols = ["prompt", "batch", "decode tok/s", "prefill tok/s", "ms/step p50", "p95",
                  *(["device ms"] if timed else []), "floor ms", "prefill ms", "row0==b1"]
    if streams:
        speed_cols += ["copy floor ms", "plan tok/s", "htod MiB/tok", "page-ins/tok", "byte hit"]
    if anchored:
        speed_cols += ["anchor tok/s", "x anchor", *(["anchor prefill ms"] if anchor_prefill else [])]
    memory_cols = ["prompt", "batch", "captures", "replays", "fallbacks", "invalid.", "kv moved", "peak MiB",
                   "= weights", "+ KV", "+ work", "+ other", "driver MiB", "host RSS MiB", "anon MiB"]
    speed, memory = Table(title=title), Table(title="capture and device memory")
    for table, cols in ((speed, speed_cols), (memory, memory_cols)):
        for col in cols:
            table.add_column(col, justify="right")
    mib = lambda x: "-" if x is None else f"{x / 2**20:,.1f}"  # noqa: E731
    for r in rows:
        head = (str(r.prompt_len), str(r.batch))
        if r.refused:
            note = f"[yellow]{r.refused.split(' (')[0]}[/yellow]"
            speed.add_row(*head, note, *["-"] * (len(speed_cols) - 3))
            memory.add_row(*head, note, *["-"] * (len(memory_cols) - 3))
            continue
        speed.add_row(*head, _rate(r.tokens_per_s), _rate(r.prefill_tokens_per_s), f"{r.step_ms_p50:.3f}",
                      f"{r.step_ms_p95:.3f}",
                      *(["-" if r.device_ms_p50 is None else f"{r.device_ms_p50:.3f}"] if timed else []),
                      "-" if r.floor_ms is None else f"{r.floor_ms:.3f}", f"{r.prefill_ms:,.1f}",
                      "yes" if r.row0_matches_batch1 else "[red]NO[/red]",
                      *(["-" if r.copy_floor_ms is None else f"{r.copy_floor_ms:.3f}",
                         "-" if r.predicted_tok_s is None else _rate(r.predicted_tok_s),
                         f"{r.htod_bytes_per_token / 2**20:,.2f}", f"{r.page_ins_per_token:.1f}",
                         f"{r.byte_hit_rate:.2f}"] if streams else []),
                      *([_anchor_cell(r), "-" if not r.anchor_tokens_per_s else
                         f"{r.tokens_per_s / r.anchor_tokens_per_s:.2f}"] if anchored else []),
                      *(["-" if r.anchor_prefill_ms is None else f"{r.anchor_prefill_ms:,.1f}"]
                        if anchor_prefill else []))
        memory.add_row(*head, str(r.captures), str(r.replays), str(r.fallbacks), str(r.invalidations),
                       str(r.kv_bytes_moved), mib(r.peak_device_bytes), mib(r.weight_device_bytes),
                       mib(r.kv_device_bytes or r.kv_bytes), mib(r.workspace_bytes), mib(r.other_bytes),
                       mib(r.driver_peak_bytes), mib(r.host_rss_peak_bytes), mib(r.host_anon_bytes))
    return Group(speed, memory)


def _anchor_cell(r: ProfileRow) -> str:
    if r.anchor_tokens_per_s is None:
        return r.anchor_note or "-"
    return _rate(r.anchor_tokens_per_s) + (f" ({r.anchor_note})" if r.anchor_note else "")


def plot(rows: list[ProfileRow], path: str, title: str) -> None:
    """Write tokens/s against batch (log-log), one line per prompt length, to a PNG at
    ``path`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    lengths = sorted({r.prompt_len for r in rows})
    for length in lengths:
        mine = [r for r in rows if r.prompt_len == length and not r.refused]
        line = ax.plot([r.batch for r in mine], [r.tokens_per_s for r in mine], marker="o",
                       label=f"prompt {length}")[0]
        anchored = [r for r in mine if r.anchor_tokens_per_s]
        if anchored:
            ax.plot([r.batch for r in anchored], [r.anchor_tokens_per_s for r in anchored], marker="x",
                    linestyle="--", color=line.get_color(), label=f"anchor, prompt {length}")
    batch_axes(ax, title)
    if len(lengths) > 1 or any(r.anchor_tokens_per_s for r in rows):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def batch_axes(ax, title: str) -> None:
    """Tokens/s against batch on log-log axes (base-2 batch), titled, with a grid. The title is
    wrapped to the figure's width (a model path is long), so it never runs off the figure."""
    import textwrap

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tokens/s")
    size = 9.0
    width_pt = ax.figure.get_figwidth() * 72 * 0.85
    chars = max(20, int(width_pt / (size * 0.6)))  # 0.6 em: a wide average glyph of the default font
    ax.set_title(textwrap.fill(title, chars, break_long_words=True, break_on_hyphens=False), fontsize=size)
    ax.grid(True, which="both", alpha=0.3)


def check_outputs(args) -> dict[tuple[int, int], dict] | None:
    """Check the sweep's files before any work: ``--plot`` needs matplotlib, the folders of
    ``--json`` and ``--plot`` must exist, and ``--anchor`` must be readable. The command runs this
    before it resolves (and perhaps builds) the model.

    Returns:
        The anchor's rows (:func:`load_anchor`), or None without ``--anchor``.

    Raises:
        core.session.RequestError: the first of those that fails.
    """
    from pathlib import Path

    from core.session import RequestError

    if args.plot_out:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise RequestError("--plot needs matplotlib: pip install -e \".[plot]\"") from None
    for out in (args.json_out, args.plot_out):
        if out and not Path(out).expanduser().resolve().parent.is_dir():
            raise RequestError(f"cannot write {out}: its folder does not exist")
    return load_anchor(args.anchor) if getattr(args, "anchor", None) else None


def profile_main(args, console, table_console) -> int:
    """The ``lockstep profile`` command: checks outputs first, sweeps, prints, writes files.

    Raises:
        core.session.RequestError: --plot without matplotlib, an output folder that does not
            exist or an unreadable --anchor (:func:`check_outputs`, before the sweep).
    """
    from pathlib import Path

    from rich.progress import Progress

    anchor = check_outputs(args)
    batches = list(args.batch_sweep)
    title = (f"{args.model} on {args.provider}, {args.layout}, "
             f"{'eager' if args.no_capture else 'capture when supported'}, "
             f"{'no run-ahead' if getattr(args, 'no_run_ahead', False) else 'run-ahead'}, capacity >= {args.context}")
    with Progress(console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("profiling", total=len(batches))

        def progress(done: int, total: int, row: ProfileRow) -> None:
            bar.update(task, completed=done, total=total)
            if not console.is_terminal:  # a log: one plain line per batch x prompt length
                console.print(f"profile: batch {row.batch} x {row.prompt_len} prompt tokens done ({done}/{total}), "
                              f"{row.tokens_per_s:,.0f} tok/s", markup=False)

        rows = profile(args.model, args.provider, batches, args, progress=progress,
                       announce=lambda line: console.print(line, markup=False))
    if anchor is not None:
        rows = with_anchor(rows, anchor)
    if rows:
        mib = 2**20
        load_peak = rows[0].load_driver_peak_bytes
        title += (f"; load {rows[0].load_s:.1f} s" + (
                  f", no driver figure ({args.provider} cannot tell its device bytes)" if load_peak is None else
                  f", driver peak {load_peak / mib:,.0f} MiB while loading "
                  f"({(rows[0].driver_baseline_bytes or 0) / mib:,.0f} MiB before)"))
    settings = next((r.settings for r in rows if r.settings), {})
    if settings:  # last: a reader finds the switches at the end of the title
        title += f"; {settings_text(settings)}"
    table_console.print(render(rows, title))
    if args.json_out:
        with open(Path(args.json_out).expanduser(), "w") as f:
            json.dump({"title": title, "rows": [attrs.asdict(r) | {"other_bytes": r.other_bytes} for r in rows]},
                      f, indent=2)
    if args.plot_out:
        plot(rows, str(Path(args.plot_out).expanduser()), title)
    measured = [r for r in rows if not r.refused]
    # 1: a row 0 that differed from its batch-1 run, or nothing measured at all (every point refused)
    return 0 if measured and all(r.row0_matches_batch1 for r in measured) else 1


def _rate(tokens_per_s: float) -> str:
    """tok/s for the table: whole numbers with thousands separators, one decimal under 100
    (a CPU reference runs a few tokens a second)."""
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.1f}"

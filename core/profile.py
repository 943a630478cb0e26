"""``lockstep profile``: decode throughput over a sweep of batch sizes.

For each batch size B: a session with the given KV capacity, B prompts of ``--prompt-len``
random tokens (row 0 the same prompt at every B), ``--warmup`` decode steps (these include the
capture warm-up and the capture), then ``--tokens`` measured steps. Each step ends when its
``[B, 2]`` argmax result is on the host, so step times are wall times of complete steps.
The check column compares row 0's token stream with the batch-1 stream, bitwise.

The floor column is the time to read once every weight byte a step reads (gather tables
excluded) at the provider's measured device bandwidth (``provider.device_bandwidth()`` in
bytes/s, when the provider offers it).
"""

from __future__ import annotations

import json

import attrs
import numpy as np

from core.generation.loop import decode
from core.models.model import load_model
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
    row0_matches_batch1: bool
    fallback_reasons: list = attrs.field(factory=list)
    weight_bytes_streamed_per_step: int = 0
    htod_bytes_per_token: float = 0.0
    page_ins_per_token: float = 0.0
    hit_rate: float = 1.0
    byte_hit_rate: float = 1.0
    copy_floor_ms: float | None = None


def _stream(runner: Runner, batch, args, prompt, rng, bandwidth, h2d=None):
    vocab = runner.model.config.vocab_size
    rows = [prompt] + [list(rng.integers(3, vocab, len(prompt))) for _ in range(batch - 1)]
    session = Session(runner, batch=batch, capacity=args.context, kv_layout=args.layout,
                      kv_policy="fixed", capture=False if args.no_capture else None)
    p = runner.provider
    p.reset_peak()
    trace = decode(session, rows, args.warmup + args.tokens)
    times_ms = np.array(trace.seconds[1 + args.warmup:]) * 1e3
    c = session.counters
    floor = None if bandwidth is None else runner.plan.step_weight_bytes() / bandwidth * 1e3
    streamed = c.weight_bytes_streamed_per_step
    row = ProfileRow(batch, batch * len(times_ms) / (times_ms.sum() / 1e3), float(np.percentile(times_ms, 50)),
                     float(np.percentile(times_ms, 95)), floor, c.captures, c.replays,
                     len(c.fallbacks), c.invalidations, c.kv_bytes_moved, p.peak_bytes(), c.kv_bytes,
                     False, list(c.fallbacks), streamed, c.htod_bytes_per_token, c.page_ins_per_token,
                     c.hit_rate, c.byte_hit_rate, None if not (h2d and streamed) else streamed / h2d * 1e3)
    session.close()
    return row, trace.tokens[:, 0].tolist()


def profile(model_dir, provider, batches: list[int], args, progress=None) -> list[ProfileRow]:
    """Run the sweep on one Runner (the weights are uploaded once); returns one
    :class:`ProfileRow` per batch size.

    Raises:
        core.session.RequestError: the context cannot hold prompt + warm-up + measured steps.
    """
    model = load_model(model_dir)
    need = args.prompt_len + args.warmup + args.tokens + 1
    if need > args.context:
        raise RequestError(f"--context {args.context} is too small: prompt + warm-up + measured "
                           f"steps need {need} positions")
    rng = np.random.default_rng(0)
    prompt = list(rng.integers(3, model.config.vocab_size, args.prompt_len))
    runner = Runner(model, provider, args.layout, weight_budget=getattr(args, "weight_budget", None),
                    device_budget=getattr(args, "device_budget", None))
    bandwidth = runner.provider.device_bandwidth()
    h2d = runner.provider.host_to_device_bandwidth() if runner.residency.streams else None
    rows, reference = [], None
    for i, batch in enumerate(batches):
        row, stream = _stream(runner, batch, args, prompt, rng, bandwidth, h2d)
        if reference is None:
            reference = stream if batch == 1 else _stream(runner, 1, args, prompt, rng, None)[1]
        rows.append(attrs.evolve(row, row0_matches_batch1=stream == reference))
        if progress is not None:
            progress(i + 1, len(batches), rows[-1])
    return rows


def render(rows: list[ProfileRow], title: str):
    """A rich Table of the sweep, one row per batch size."""
    from rich.table import Table

    table = Table(title=title)
    streams = any(r.weight_bytes_streamed_per_step for r in rows)
    cols = ["batch", "tok/s", "ms/step p50", "p95", "floor ms", "captures", "replays",
            "fallbacks", "invalid.", "kv moved", "peak dev MiB", "KV MiB", "row0==b1"]
    if streams:
        cols += ["copy floor ms", "htod MiB/tok", "page-ins/tok", "byte hit"]
    for col in cols:
        table.add_column(col, justify="right")
    mib = lambda x: "-" if x is None else f"{x / 2**20:,.1f}"  # noqa: E731
    for r in rows:
        table.add_row(str(r.batch), f"{r.tokens_per_s:,.0f}", f"{r.step_ms_p50:.3f}", f"{r.step_ms_p95:.3f}",
                      "-" if r.floor_ms is None else f"{r.floor_ms:.3f}", str(r.captures), str(r.replays),
                      str(r.fallbacks), str(r.invalidations), str(r.kv_bytes_moved), mib(r.peak_device_bytes),
                      mib(r.kv_bytes), "yes" if r.row0_matches_batch1 else "[red]NO[/red]",
                      *(["-" if r.copy_floor_ms is None else f"{r.copy_floor_ms:.3f}",
                         f"{r.htod_bytes_per_token / 2**20:,.2f}", f"{r.page_ins_per_token:.1f}",
                         f"{r.byte_hit_rate:.2f}"] if streams else []))
    return table


def plot(rows: list[ProfileRow], path: str, title: str) -> None:
    """Write tokens/s against batch (log-log) to a PNG at ``path`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r.batch for r in rows], [r.tokens_per_s for r in rows], marker="o")
    batch_axes(ax, title)
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


def profile_main(args, console, table_console) -> int:
    """The ``lockstep profile`` command: checks outputs first, sweeps, prints, writes files.

    Raises:
        core.session.RequestError: --plot without matplotlib, or an output folder that does
            not exist (both checked before the sweep).
    """
    from pathlib import Path

    from rich.progress import Progress

    from core.session import RequestError

    if args.plot_out:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise RequestError("--plot needs matplotlib: pip install -e \".[plot]\"") from None
    for out in (args.json_out, args.plot_out):
        if out and not Path(out).expanduser().resolve().parent.is_dir():
            raise RequestError(f"cannot write {out}: its folder does not exist")
    batches = list(args.batch_sweep)
    title = (f"{args.model} on {args.provider}, {args.layout}, "
             f"{'eager' if args.no_capture else 'capture when supported'}, context {args.context}")
    with Progress(console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("profiling", total=len(batches))

        def progress(done: int, total: int, row: ProfileRow) -> None:
            bar.update(task, completed=done)
            if not console.is_terminal:  # a log: one plain line per batch size
                console.print(f"profile: batch {row.batch} done ({done}/{total}), {row.tokens_per_s:,.0f} tok/s",
                              markup=False)

        rows = profile(args.model, args.provider, batches, args, progress=progress)
    table_console.print(render(rows, title))
    if args.json_out:
        with open(Path(args.json_out).expanduser(), "w") as f:
            json.dump({"title": title, "rows": [attrs.asdict(r) for r in rows]}, f, indent=2)
    if args.plot_out:
        plot(rows, str(Path(args.plot_out).expanduser()), title)
    return 0 if all(r.row0_matches_batch1 for r in rows) else 1

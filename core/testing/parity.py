"""Decode gates of the parity kit: a provider against cpu_reference, and against itself.

:func:`run_parity` decodes a model on the provider under test and returns a
:class:`ParityReport` of these gates (docs/design.md "Parity kit"):

- ``logits``: teacher-forced logits per step (every row fed the reference's tokens) against
  cpu_reference: max abs error, max rel error (abs error / the row's max |logit|), top-1
  agreement of the provider's device argmax (over all (step, row) pairs, and over the decisive
  ones: the reference's top-2 margin above the tolerance), first divergence; passes when the
  rel error stays within the tolerance of the model dtype (:data:`LOGIT_RTOL`);
- ``greedy``: free-running greedy decoding (:func:`core.generation.generate.generate`) at the largest
  batch gives the reference's tokens; a divergence passes only where the reference's top-2
  margin is within the logits tolerance (a near tie), and is reported;
- ``batch_invariance``: row i of a batch of mixed-length prompts is bitwise its batch-1 run;
- ``row_identity``: N copies of one prompt give N bitwise-equal rows;
- ``reuse``: a second request on the same session is bitwise the first;
- ``poison``: NaN in every KV slot before the request changes no logit;
- ``layout``: seq_major == head_major, bitwise (when the provider has both layouts);
- ``growth``: a growing KV cache (at least two growth events when the request is long enough)
  == a fixed one, bitwise;
- ``prompt``: the logits at every prompt position (``Session(all_logits=True)``) against
  cpu_reference, within the logits tolerance: prefill attention at every position, not only
  the last;
- ``prefill_groups``: a prefill in length groups (``prefill_groups="always"``: scratch KV
  buffers per group, their rows copied into the cache) == the padded prefill, bitwise;
- ``capture``: graph capture on == off, bitwise, with a fixed and with a growing cache (only
  when the provider declares ``graph_capture``).

Bitwise gates compare a digest of every row's fp32 logits at every step plus the tokens.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Collection, Sequence

import attrs
import numpy as np

from core.generation.generate import generate
from core.generation.loop import decode
from core.models.model import Model, load_model
from core.plugins import get_provider
from core.runtime import residency
from core.runtime.kv import cache_bytes, round_capacity
from core.runtime.runner import Runner
from core.session import RequestError, Session

#: Max |provider - reference| / max |reference logit| per row and step, by model dtype.
LOGIT_RTOL = {"float32": 1e-3, "float16": 3e-2}
#: Lengths of the default prompts (row i uses entry i mod 8): mixed, with a 1-token prompt.
DEFAULT_LENGTHS = (7, 3, 12, 1, 9, 5, 16, 2)
PASS, FAIL, SKIP = "pass", "fail", "skip"
#: Every gate, in report order.
GATES = ("logits", "greedy", "batch_invariance", "row_identity", "reuse", "poison", "layout", "growth",
         "prompt", "prefill_groups", "capture", "streaming")


@attrs.define
class Gate:
    """One gate's outcome: ``status`` is "pass", "fail" or "skip"; ``detail`` says why."""

    name: str
    status: str
    detail: str = ""
    metrics: dict = attrs.field(factory=dict)


@attrs.define
class ParityReport:
    """What :func:`run_parity` found.

    Attributes:
        model: model folder; provider, reference: provider names.
        dtype: the model's KV/logits dtype; batches, steps: what was run.
        gates: one :class:`Gate` per gate, in the order of the module docstring (a gate left
            out by ``gates=`` is a skip saying so).
        per_step: teacher-forced logit errors, one dict per (batch, step): max_abs, max_rel,
            top1 (fraction of rows whose device argmax equals the reference token).
        mode: what kind of run this report is part of (see :func:`run_kit`): "full", or in the
            quick mode "quick: tiny model" / "quick: short check".
    """

    model: str
    provider: str
    reference: str
    dtype: str
    batches: list[int]
    steps: int
    gates: list[Gate] = attrs.field(factory=list)
    per_step: list[dict] = attrs.field(factory=list)
    mode: str = "full"

    @property
    def passed(self) -> bool:
        """True when no gate failed (skipped gates do not fail the report)."""
        return all(g.status != FAIL for g in self.gates)

    def gate(self, name: str) -> Gate:
        """The gate called ``name`` (KeyError if it was not run)."""
        for g in self.gates:
            if g.name == name:
                return g
        raise KeyError(name)

    def to_dict(self) -> dict:
        """Plain data for ``--json``."""
        return {**attrs.asdict(self), "passed": self.passed}

    def render(self) -> str:
        """The report as printable text: a header, the gate table and the per-batch logit errors."""
        from rich.console import Console
        from rich.table import Table

        gates = Table(title=f"parity ({self.mode}): {self.provider} vs {self.reference} on {self.model} "
                            f"({self.dtype}, batches {','.join(map(str, self.batches))}, {self.steps} steps)")
        for col in ("gate", "status", "detail"):
            gates.add_column(col, overflow="fold")
        for g in self.gates:
            style = {PASS: "green", FAIL: "bold red", SKIP: "yellow"}[g.status]
            gates.add_row(g.name, f"[{style}]{g.status}[/{style}]", g.detail)
        errors = Table(title="teacher-forced logits per batch (worst step)")
        for col in ("batch", "max abs", "max rel", "top-1 agreement", "worst step"):
            errors.add_column(col, justify="right")
        for b in self.batches:
            rows = [s for s in self.per_step if s["batch"] == b]
            if not rows:
                continue
            worst = max(rows, key=lambda s: s["max_rel"])
            top1 = float(np.mean([s["top1"] for s in rows]))
            errors.add_row(str(b), f"{max(s['max_abs'] for s in rows):.3g}", f"{worst['max_rel']:.3g}",
                           f"{100 * top1:.2f}%", str(worst["step"]))
        console = Console(width=120, record=True, force_terminal=False, color_system=None)
        with console.capture() as cap:
            console.print(gates)
            console.print(errors)
            console.print(f"overall: {'PASS' if self.passed else 'FAIL'}")
        return cap.get()


@attrs.define
class _Run:
    tokens: np.ndarray   # int64 [steps + 1, B], the device argmax of each step
    digests: np.ndarray  # object [steps + 1, B], blake2b of each row's fp32 logits
    logits: list | None  # fp32 [B, V] per step when kept
    growth_events: int = 0
    counters: dict = attrs.field(factory=dict)


def _digest(row: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=12).hexdigest()


def _decode(session: Session, prompts: list[list[int]], steps: int, forced: list[list[int]] | None,
            keep_logits: bool) -> _Run:
    digests, logits = [], []

    def record(_t, _out, _seconds):
        lg = session.last_logits()
        digests.append([_digest(r) for r in lg])
        if keep_logits:
            logits.append(lg)

    trace = decode(session, prompts, steps, force=forced, observer=record)
    return _Run(trace.tokens, np.array(digests, dtype=object), logits if keep_logits else None,
                session.counters.growth_events, session.counters.to_dict())


def _prefill_gates(report: ParityReport, runner: Runner, ref_runner: Runner, rows: list[list[int]], steps: int,
                   need: int, forced_all: list[list[int]], big: _Run, rtol: float) -> None:
    """The ``prompt`` and ``prefill_groups`` gates (module docstring)."""
    s = _session(runner, len(rows), need, all_logits=True)
    s.prefill(rows)
    got = s.prompt_logits()
    r = _session(ref_runner, len(rows), need, all_logits=True)
    r.prefill(rows)
    want = r.prompt_logits()
    worst, where = 0.0, (0, 0)
    for b, row in enumerate(rows):
        g, w = got[b, :len(row)].astype(np.float64), want[b, :len(row)].astype(np.float64)
        rel = np.abs(g - w) / np.maximum(np.abs(w).max(axis=-1, keepdims=True), 1e-30)
        rel = np.where(np.isfinite(rel), rel, np.inf).max(axis=-1)
        if rel.max() > worst:
            worst, where = float(rel.max()), (b, int(rel.argmax()))
    positions = sum(map(len, rows))
    detail = (f"logits at all {positions} prompt positions (all_logits=True) within {rtol:g} of "
              f"{ref_runner.provider.name}; worst {worst:.3g} at row {where[0]} position {where[1]}")
    report.gates.append(Gate("prompt", PASS if worst <= rtol else FAIL, detail,
                             {"max_rel": worst, "row": where[0], "position": where[1]}))
    if runner.plan.last_position_steps is None:
        report.gates.append(Gate("prefill_groups", SKIP, "the plan has no last-position program (the provider "
                                                         "refused its Reshape or Gather), so prefill never groups"))
        return
    s = _session(runner, len(rows), need, prefill_groups="always")
    grouped = _decode(s, rows, steps, forced_all, False)
    runs = grouped.counters["prefill_runs"]
    report.gates.append(_bitwise("prefill_groups", grouped, big, what=f"length groups ({runs} runs) vs padded")
                        or Gate("prefill_groups", PASS, f"a prefill in {runs} length groups (scratch KV copied "
                                "into the cache) == the padded prefill, bitwise", {"prefill_runs": runs}))


def _session(runner: Runner, batch: int, need: int, **kw) -> Session:
    kw.setdefault("capacity", round_capacity(need, runner.model.config.context_length))
    kw.setdefault("kv_policy", "fixed")
    kw.setdefault("capture", False)
    return Session(runner, batch=batch, kv_layout=runner.kv_layout, **kw)


def default_prompts(model: Model, count: int, seed: int = 1234) -> list[list[int]]:
    """``count`` deterministic random token-id prompts of mixed lengths (:data:`DEFAULT_LENGTHS`)."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    return [rng.integers(3, vocab, DEFAULT_LENGTHS[i % len(DEFAULT_LENGTHS)]).tolist() for i in range(count)]


def _bitwise(name: str, a: _Run, b: _Run, rows_a=None, rows_b=None, what: str = "") -> Gate | None:
    """None when equal, else a failing Gate naming the first differing (step, row)."""
    da = a.digests if rows_a is None else a.digests[:, rows_a]
    db = b.digests if rows_b is None else b.digests[:, rows_b]
    ta = a.tokens if rows_a is None else a.tokens[:, rows_a]
    tb = b.tokens if rows_b is None else b.tokens[:, rows_b]
    diff = np.argwhere((da != db) | (ta != tb))
    if diff.size == 0:
        return None
    step, row = diff[0]
    return Gate(name, FAIL, f"{what}: first difference at step {step}, row {row} "
                            f"({len(diff)} (step, row) pairs differ)", {"first_divergence": [int(step), int(row)]})


def _prompt_ids(model: Model, prompt: Sequence[int] | str) -> list[int]:
    """A prompt's token ids (a string is encoded without chat template)."""
    if not isinstance(prompt, str):
        return list(map(int, prompt))
    if model.tokenizer is None:
        raise RequestError(f"text prompts need a tokenizer; {model.folder} has no tokenizer.json")
    return model.tokenizer.encode(prompt)


def run_parity(model: str | Path | Model, provider: Any, batches: Sequence[int] = (1, 2, 8),
               steps: int = 64, prompts: Sequence[Sequence[int] | str] | None = None,
               reference: Any = "cpu_reference", weight_budget: int | float | str | None = None,
               gates: Collection[str] | None = None, progress: Callable[[str], None] | None = None,
               mode: str = "full") -> ParityReport:
    """Run the decode gates of ``provider`` on ``model``; see the module docstring.

    Args:
        model: a builder model folder or a loaded Model.
        provider: provider name or object under test.
        batches: batch sizes of the teacher-forced logits gate; the invariance gates use the
            largest.
        steps: decode steps after prefill (teacher-forced and free-running).
        prompts: token-id lists, or strings (encoded without chat template; needs a tokenizer);
            default :func:`default_prompts`. At least max(batches) prompts are used (cycled).
        reference: the oracle provider (name or object).
        weight_budget: the provider under test streams the weights past this budget
            (:mod:`core.runtime.residency`); the reference keeps everything resident. The
            ``streaming`` gate then checks that weights streamed and stayed within the budget.
        gates: the gates to run (names from :data:`GATES`; default all); ``logits`` and
            ``batch_invariance`` always run (the other gates compare against their runs). A
            gate left out is reported as a skip saying so.
        progress: called with a line naming the gate and batch about to run.
        mode: recorded in the report (:attr:`ParityReport.mode`).

    Raises:
        core.session.RequestError (a ValueError): empty batches, steps < 1, an unknown gate,
            a prompt plus ``steps`` beyond the model context, or a run whose logits and KV
            cache would not fit in the memory available now (checked before any run).
    """
    model = model if isinstance(model, Model) else load_model(model)
    wanted = set(GATES if gates is None else gates)
    if wanted - set(GATES):
        raise RequestError(f"unknown gates {sorted(wanted - set(GATES))}; the gates are {', '.join(GATES)}")
    say = progress or (lambda _line: None)
    provider, reference = get_provider(provider), get_provider(reference)
    batches, rows, need = check_request(model, provider, batches, steps, prompts)
    n_max = batches[-1]
    dtype = np.dtype(model.io_dtype).name
    rtol = LOGIT_RTOL.get(dtype, LOGIT_RTOL["float16"])
    report = ParityReport(str(model.folder), provider.name, reference.name, dtype, batches, steps, mode=mode)
    caps = provider.capabilities()

    # reference: free-running greedy, batch 1 per prompt (cpu_reference is batch-invariant)
    ref_runner, runner = Runner(model, reference), Runner(model, provider, weight_budget=weight_budget)
    say(f"reference ({reference.name}): {n_max} batch-1 runs of {steps} steps")
    refs = [_decode(_session(ref_runner, 1, need), [p], steps, None, True) for p in rows]
    ref_tokens = [r.tokens[:, 0] for r in refs]
    forced_all = [t[:steps].tolist() for t in ref_tokens]

    # provider: teacher-forced batch-1 runs (the invariance baseline) and batch-N runs
    say(f"logits gate: {n_max} batch-1 runs on {provider.name}")
    singles = [_decode(_session(runner, 1, need), [p], steps, [f], True)
               for p, f in zip(rows, forced_all)]
    batch_runs = {1: singles[0]}
    for n in batches:
        if n > 1:
            say(f"logits gate: batch {n}")
            batch_runs[n] = _decode(_session(runner, n, need), rows[:n], steps, forced_all[:n], True)
    _logits_gate(report, batch_runs, singles, refs, rtol)
    if "greedy" in wanted:
        say(f"greedy gate: batch {n_max}, {steps + 1} tokens per row")
        _greedy_gate(report, model, runner, rows, refs, steps, need, rtol)
    else:
        report.gates.append(_left_out("greedy", mode))

    big = batch_runs[n_max]
    fails = [g for n in batches if n > 1
             for g in [_bitwise("batch_invariance", batch_runs[n], singles[i], [i], [0],
                                f"batch {n} row {i} vs batch 1") for i in range(n)] if g]
    report.gates.append(fails[0] if fails else Gate(
        "batch_invariance", PASS if n_max > 1 else SKIP,
        f"every row of batches {[n for n in batches if n > 1]} is bitwise its batch-1 run" if n_max > 1
        else "needs a batch > 1"))

    for name in GATES[3:]:
        if name not in wanted:
            report.gates.append(_left_out(name, mode))
    if "streaming" in wanted:
        report.gates.append(_streaming_gate(runner, big, weight_budget))
    _more_gates(report, wanted, say, runner, provider, caps, rows, forced_all, big, steps, need, n_max)
    if wanted & {"prompt", "prefill_groups"}:
        say(f"{' and '.join(g for g in ('prompt', 'prefill_groups') if g in wanted)} gate: batch {n_max}")
        before = len(report.gates)
        _prefill_gates(report, runner, ref_runner, rows, steps, need, forced_all, big, rtol)
        report.gates[before:] = [g for g in report.gates[before:] if g.name in wanted]
    report.gates.sort(key=lambda g: GATES.index(g.name))
    return report


def _left_out(name: str, mode: str) -> Gate:
    return Gate(name, SKIP, f"not run in this check ({mode})")


def _more_gates(report: ParityReport, wanted: set, say, runner: Runner, provider, caps, rows, forced_all,
                big: _Run, steps: int, need: int, n_max: int) -> None:
    """The gates after batch_invariance (row_identity ... capture), each only when wanted."""
    if "row_identity" in wanted:
        say(f"row_identity gate: batch {n_max}")
        _row_identity(report, runner, rows, forced_all, steps, need, n_max)
    if "reuse" in wanted:
        say(f"reuse gate: batch {n_max}, two requests")
        s = _session(runner, n_max, need)
        first = _decode(s, rows, steps, forced_all, False)
        second = _decode(s, rows, steps, forced_all, False)
        report.gates.append(_bitwise("reuse", first, second, what="second request on one session") or Gate(
            "reuse", PASS, "a second request on the same session is bitwise the first"))
    if "poison" in wanted:
        say(f"poison gate: batch {n_max}")
        _poison(report, runner, provider, rows, forced_all, big, steps, need, n_max)
    if "layout" in wanted:
        say(f"layout gate: batch {n_max}")
        _layout(report, runner, caps, rows, forced_all, big, steps, need, n_max)
    if "growth" in wanted:
        say(f"growth gate: batch {n_max}")
        start = max(len(p) for p in rows)
        grow = _decode(_session(runner, n_max, need, capacity=start, kv_policy="growing"),
                       rows, steps, forced_all, False)
        report.gates.append(_bitwise("growth", grow, big, what=f"growing ({grow.growth_events} growth events) "
                                     "vs fixed") or Gate(
            "growth", PASS, f"growing == fixed, bitwise, across {grow.growth_events} growth event(s)",
            {"growth_events": grow.growth_events}))
    if "capture" in wanted:
        say(f"capture gate: batch {n_max}")
        _capture(report, runner, caps, rows, forced_all, big, steps, need, n_max)


def _row_identity(report, runner, rows, forced_all, steps, need, n_max) -> None:
    same = _decode(_session(runner, n_max, need), [rows[0]] * n_max, steps, [forced_all[0]] * n_max, False)
    diff = [i for i in range(1, n_max) if not (np.array_equal(same.digests[:, i], same.digests[:, 0])
                                                and np.array_equal(same.tokens[:, i], same.tokens[:, 0]))]
    report.gates.append(Gate("row_identity", FAIL, f"rows {diff} differ from row 0") if diff else Gate(
        "row_identity", PASS if n_max > 1 else SKIP, f"{n_max} copies of prompt 0 are bitwise equal"))


def _poison(report, runner, provider, rows, forced_all, big, steps, need, n_max) -> None:
    s = _session(runner, n_max, need)
    for t in s.state.kv.buffers():  # fill is a required member (core.protocol.REQUIRED_MEMBERS)
        provider.fill(t, np.nan)
    run = _decode(s, rows, steps, forced_all, False)
    report.gates.append(_bitwise("poison", run, big, what="NaN-filled KV vs clean") or Gate(
        "poison", PASS, "NaN in every KV slot before the request changes no logit"))


def _layout(report, runner, caps, rows, forced_all, big, steps, need, n_max) -> None:
    if "seq_major" in caps.kv_layouts and "head_major" in caps.kv_layouts:
        seq_major = runner.with_layout("seq_major")  # the same weights: nothing uploaded again
        run = _decode(_session(seq_major, n_max, need), rows, steps, forced_all, False)
        report.gates.append(_bitwise("layout", run, big, what="seq_major vs head_major") or Gate(
            "layout", PASS, "seq_major == head_major, bitwise"))
    else:
        report.gates.append(Gate("layout", SKIP, f"provider has KV layouts {caps.kv_layouts} only"))


def _capture(report, runner, caps, rows, forced_all, big, steps, need, n_max) -> None:
    start = max(len(p) for p in rows)
    if caps.graph_capture:
        on = _decode(_session(runner, n_max, need, capture=True), rows, steps, forced_all, False)
        on_grow = _decode(_session(runner, n_max, need, capture=True, capacity=start, kv_policy="growing"),
                          rows, steps, forced_all, False)
        gate = (_bitwise("capture", on, big, what="capture on vs off (fixed)")
                or _bitwise("capture", on_grow, big, what="capture on vs off (growing)"))
        c = on.counters
        report.gates.append(gate or Gate(
            "capture", PASS, f"capture on == off, bitwise (fixed: {c.get('captures')} captures, "
                             f"{c.get('replays')} replays; growing: {on_grow.counters.get('invalidations')} "
                             f"invalidations)", {"fixed": c, "growing": on_grow.counters}))
        if on.counters.get("fallbacks"):
            report.gates[-1].detail += f"; fallbacks: {on.counters['fallbacks']}"
    else:
        report.gates.append(Gate("capture", SKIP, "provider declares no graph capture"))


def check_request(model: Model, provider: Any, batches: Sequence[int], steps: int,
                  prompts: Sequence[Sequence[int] | str] | None = None) -> tuple[list[int], list[list[int]], int]:
    """Validate a parity request before any run: returns (sorted batches, the ``max(batches)``
    prompt rows, KV positions needed).

    Raises:
        core.session.RequestError: empty or non-positive batches, steps < 1, a prompt plus
            ``steps`` beyond the model context, or not enough memory (:func:`check_memory`).
    """
    batches = sorted({int(b) for b in batches})
    if not batches or batches[0] < 1 or steps < 1:
        raise RequestError(f"batches must be positive and steps >= 1, got {batches}, {steps}")
    n_max = batches[-1]
    encoded = [_prompt_ids(model, p) for p in (default_prompts(model, n_max) if prompts is None else prompts)]
    if not encoded:
        raise RequestError("prompts is empty")
    rows = [encoded[i % len(encoded)] for i in range(n_max)]
    need = max(len(p) for p in rows) + steps
    if need > model.config.context_length:
        raise RequestError(f"rows of up to {need - steps} tokens plus {steps} steps need {need} positions; "
                           f"the model context is {model.config.context_length}")
    check_memory(model, provider, batches, steps, max(len(p) for p in rows), need)
    return batches, rows, need


def check_memory(model: Model, provider: Any, batches: Sequence[int], steps: int, prompt_len: int,
                 need: int) -> None:
    """Refuse a parity run whose kept logits and largest KV cache exceed the memory free now.

    Host: the fp32 logits the gates keep (every batch-1 run of the reference and the provider,
    and each batch of the logits gate: ``(2 max(batches) + sum(batches)) * (steps + 1) * V * 4``
    bytes) plus the reference's largest session (KV and prefill logits). Device: the provider's
    largest session, when it reports ``free_device_bytes()``.

    Raises:
        core.session.RequestError: the estimate and what is available, in GiB.
    """
    cfg = model.config
    n_max = max(batches)
    item = np.dtype(model.io_dtype).itemsize
    capacity = round_capacity(need, cfg.context_length)
    session = cache_bytes(cfg, n_max, capacity, item) + n_max * prompt_len * cfg.vocab_size * max(item, 4)
    kept = (2 * n_max + sum(b for b in batches if b > 1)) * (steps + 1) * cfg.vocab_size * 4
    gib = 2 ** 30
    host = residency.available_host_bytes()
    if host is not None and kept + session > host:
        raise RequestError(f"parity at batches up to {n_max} with {steps} steps keeps ~{(kept + session) / gib:,.1f} "
                           f"GiB of logits and KV cache in host memory; {host / gib:,.1f} GiB is available. "
                           "Use smaller --batch or --steps")
    free = provider.free_device_bytes()
    if free is not None and session > free:
        raise RequestError(f"parity at batch {n_max} needs ~{session / gib:,.1f} GiB of device memory for the KV "
                           f"cache and logits; {provider.name} has {free / gib:,.1f} GiB free. Use a smaller --batch")


def _streaming_gate(runner: Runner, run: _Run, weight_budget) -> Gate:
    """With a budget: weights streamed (bytes copied every step) within the budget; the logits
    and tokens gates above were run streamed, so they compare streamed against the reference."""
    if weight_budget is None:
        return Gate("streaming", SKIP, "no weight budget given")
    r, c = runner.residency, run.counters
    resident = runner.weight_bytes + r.staging_bytes
    if not r.streams or c.get("htod_bytes", 0) <= 0:
        return Gate("streaming", FAIL, f"a budget of {r.budget:,} bytes streamed nothing "
                                       f"(htod bytes {c.get('htod_bytes')})")
    assert r.budget is not None  # a weight budget was given
    if resident > r.budget:
        return Gate("streaming", FAIL, f"{resident:,} device weight bytes exceed the budget {r.budget:,}")
    return Gate("streaming", PASS, f"{r.weight_bytes_streamed_per_step:,} bytes streamed per step through "
                                   f"{r.slots} slots; {resident:,} device bytes within the {r.budget:,} budget; "
                                   f"htod {c['htod_bytes_per_token']:,.0f} bytes per token",
                {k: c.get(k) for k in ("htod_bytes", "htod_bytes_per_token", "page_ins", "hit_rate",
                                       "byte_hit_rate")})


def _logits_gate(report: ParityReport, batch_runs: dict, singles: list, refs: list, rtol: float) -> None:
    worst_rel, first_div, decisive = 0.0, None, []
    runs = dict(batch_runs)
    for n, run in sorted(runs.items()):
        for step in range(run.tokens.shape[0]):
            errs, rels, agree = [], [], []
            for row in range(run.tokens.shape[1]):
                got, want = run.logits[step][row], refs[row].logits[step][0]
                err = float(np.max(np.abs(got.astype(np.float64) - want)))
                scale = max(float(np.max(np.abs(want))), 1e-30)
                errs.append(err)
                rels.append(err / scale)
                ok = int(run.tokens[step, row]) == int(refs[row].tokens[step, 0])
                agree.append(ok)
                top2 = np.partition(np.asarray(want, np.float64).reshape(-1), -2)[-2:]
                if top2[1] - top2[0] > rtol * scale:  # the reference's top-1 is decisive
                    decisive.append(ok)
                if not ok and first_div is None:
                    first_div = {"batch": n, "step": step, "row": row}
            report.per_step.append({"batch": n, "step": step, "max_abs": max(errs), "max_rel": max(rels),
                                    "top1": float(np.mean(agree))})
            worst_rel = max(worst_rel, max(rels))
    for i, run in enumerate(singles[1:], start=1):  # the other batch-1 rows count too
        for step in range(run.tokens.shape[0]):
            want = refs[i].logits[step][0]
            err = float(np.max(np.abs(run.logits[step][0].astype(np.float64) - want)))
            worst_rel = max(worst_rel, err / max(float(np.max(np.abs(want))), 1e-30))
    top1 = float(np.mean([s["top1"] for s in report.per_step]))
    top1_decisive = float(np.mean(decisive)) if decisive else 1.0
    metrics = {"max_abs": max(s["max_abs"] for s in report.per_step), "max_rel": worst_rel,
               "top1_agreement": top1, "top1_decisive": top1_decisive, "decisive_steps": len(decisive),
               "first_divergence": first_div, "rtol": rtol}
    detail = (f"max abs {metrics['max_abs']:.3g}, max rel {worst_rel:.3g} (tolerance {rtol:g}), "
              f"top-1 agreement {100 * top1:.2f}% ({100 * top1_decisive:.2f}% of the {len(decisive)} "
              f"(step, row) pairs whose reference top-2 margin exceeds the tolerance), first divergence "
              + (f"batch {first_div['batch']} step {first_div['step']} row {first_div['row']}" if first_div
                 else "none"))
    report.gates.append(Gate("logits", PASS if worst_rel <= rtol else FAIL, detail, metrics))


def _greedy_gate(report: ParityReport, model: Model, runner: Runner, prompts, refs, steps: int, need: int,
                 rtol: float) -> None:
    session = _session(runner, len(prompts), need)
    results = generate(session, prompts, steps + 1)
    eos = set(model.config.eos_token_ids)
    near_ties: list[tuple[int, int, float]] = []
    hard: list[tuple[int, int, float]] = []
    for row, ((out, _reason), ref) in enumerate(zip(results, refs)):
        want = []
        for tok in ref.tokens[:, 0].tolist():
            if tok < 0:
                break
            want.append(tok)
            if tok in eos:
                break
        if out == want:
            continue
        step = next((t for t, (a, b) in enumerate(zip(out, want)) if a != b), min(len(out), len(want)))
        if step < len(out) and step < len(want):
            lg = refs[row].logits[step][0]
            margin = float(lg[want[step]] - lg[out[step]])
            tol = rtol * float(np.max(np.abs(lg)))
            (near_ties if margin <= tol else hard).append((row, step, margin))
        else:
            hard.append((row, step, float("nan")))
    if hard:
        row, step, margin = hard[0]
        report.gates.append(Gate("greedy", FAIL, f"row {row} diverges at step {step} (reference top-2 margin "
                                                 f"{margin:.3g}); {len(hard)} rows diverge", {"divergences": hard}))
    else:
        detail = f"batch {len(prompts)}: every row's greedy tokens equal the reference"
        if near_ties:
            detail += f" up to near ties at (row, step) {[(r, s) for r, s, _ in near_ties]}"
        report.gates.append(Gate("greedy", PASS, detail, {"near_ties": near_ties}))


@attrs.frozen
class KitMode:
    """Batches and steps of a :func:`run_kit` mode: the model's, and the tiny model's (None: no
    tiny model); ``gates`` run on the model (None: all)."""

    batches: tuple[int, ...]
    steps: int
    gates: tuple[str, ...] | None = None
    tiny_batches: tuple[int, ...] | None = None
    tiny_steps: int = 0


#: The quick mode: every gate on a tiny model shaped like the real one, and a short check of the
#: real model (logits, greedy decoding, batch invariance and the prompt logits).
QUICK = KitMode((1, 2), 4, ("logits", "greedy", "batch_invariance", "prompt"), (1, 2, 8), 16)
#: The full mode: every gate on the real model.
FULL = KitMode((1, 2, 8), 64)
MODES = ("quick", "full")


@attrs.define
class KitReport:
    """What :func:`run_kit` found: the mode that ran and one :class:`ParityReport` per model."""

    mode: str
    reports: list[ParityReport]

    @property
    def passed(self) -> bool:
        """True when no gate of any report failed."""
        return all(r.passed for r in self.reports)

    def to_dict(self) -> dict:
        """Plain data for ``--json``: mode, passed and the reports."""
        return {"mode": self.mode, "passed": self.passed, "reports": [r.to_dict() for r in self.reports]}

    def render(self) -> str:
        """Every report, then one line saying which mode ran and the overall outcome."""
        what = ("quick: every gate on a tiny model of the same dtype, then a short check of the model "
                "(--full runs every gate on the model)" if self.mode == "quick"
                else "full: every gate on the model")
        text = "".join(r.render() for r in self.reports)
        return text + f"mode {what}\nkit overall: {'PASS' if self.passed else 'FAIL'}\n"


def _tiny_like(model: Model, folder: Path) -> Path:
    """A tiny random model of ``model``'s dtype and quantization (int4 when it has MatMulNBits)."""
    from core.testing.tiny_model import make_tiny_model

    quant = "int4" if any(n.op_type == "MatMulNBits" for n in model.graph.node) else None
    return make_tiny_model(folder, dtype=np.dtype(model.io_dtype).name, quant=quant)


def run_kit(model: str | Path | Model, provider: Any, mode: str = "quick", batches: Sequence[int] | None = None,
            steps: int | None = None, weight_budget: int | float | str | None = None,
            progress: Callable[[str], None] | None = None, reference: Any = "cpu_reference") -> KitReport:
    """The decode gates as ``lockstep parity`` runs them.

    ``mode="quick"`` (about a minute for a CPU provider on SmolLM2-135M on 2 cores): every gate
    on a tiny random model of the model's dtype (:data:`QUICK` batches and steps), then the
    logits, greedy, batch-invariance and prompt gates on the model itself, batches 1,2 for 4
    steps.
    ``mode="full"``: every gate on the model, batches 1,2,8 for 64 steps (:data:`FULL`).
    ``batches`` and ``steps`` replace the model's defaults in either mode. A ``weight_budget``
    in bytes applies to the model only; a fraction or percentage to the tiny model too.

    Raises:
        core.session.RequestError: an unknown mode, or see :func:`run_parity`.
    """
    import tempfile

    if mode not in MODES:
        raise RequestError(f"mode must be one of {MODES}, got {mode!r}")
    model = model if isinstance(model, Model) else load_model(model)
    provider, reference = get_provider(provider), get_provider(reference)
    say = progress or (lambda _line: None)
    mine = FULL if mode == "full" else QUICK
    check_request(model, provider, batches or mine.batches, steps or mine.steps)  # before the tiny model runs
    if mode == "full":
        return KitReport(mode, [run_parity(model, provider, batches or FULL.batches, steps or FULL.steps,
                                           reference=reference, weight_budget=weight_budget, progress=say)])
    reports = []
    with tempfile.TemporaryDirectory(prefix="lockstep-parity-") as tmp:
        tiny = _tiny_like(model, Path(tmp) / "tiny")
        relative = isinstance(weight_budget, float) or (isinstance(weight_budget, str) and "%" in weight_budget)
        reports.append(run_parity(tiny, provider, QUICK.tiny_batches or (), QUICK.tiny_steps, reference=reference,
                                  weight_budget=weight_budget if relative else None, mode="quick: tiny model",
                                  progress=lambda line: say(f"tiny model: {line}")))
    reports.append(run_parity(model, provider, batches or QUICK.batches, steps or QUICK.steps,
                              reference=reference, weight_budget=weight_budget,
                              gates=(*(QUICK.gates or ()), *(("streaming",) if weight_budget is not None else ())),
                              mode="quick: short check", progress=lambda line: say(f"model: {line}")))
    return KitReport(mode, reports)

"""The arrival fuzzer: random requests join and leave an engine; each must equal its solo run.

:func:`fuzz_arrivals` draws, from one seed, requests with random arrival iterations, prompt
lengths, ``max_tokens``, stop strings and stop token ids, greedy or seeded sampling, and aborts
after a random number of iterations. It runs them on an :class:`~core.engine.Engine` driven
iteration by iteration, then runs each one alone on a batch-1 :class:`~core.session.Session` of
the same capacity, replays the solo tokens through a fresh request's stop rules, and compares
token ids, text and finish reason (an aborted request: its tokens a prefix of the solo run's).
With ``solo="engine"`` the solo run is the request alone on a one-slot engine with the same
``prefill_chunk`` instead (the chunked prefill's reference: the same chunks, no neighbours).
Used by tests/unit/test_engine_fuzz.py on cpu_reference and tests/cuda on a GPU.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from core.engine import Engine, Event, Request


@attrs.define
class FuzzReport:
    """What :func:`fuzz_arrivals` ran and found.

    Attributes:
        requests: requests run.
        mismatches: one line per request whose output differs from its solo run.
        buckets: decode batch sizes the engine ran.
        max_running: the most requests that held a slot at once.
        aborted, sampled, stopped: requests aborted, sampling, ended by a stop rule.
        captures, replays: decode graphs the engine captured and replayed (a provider that captures).
        rows_moved: rows the engine moved down to a lower slot (compaction).
        prefill_chunks: prompt chunks the engine's chunked prefill ran.
    """

    requests: int = 0
    mismatches: list[str] = attrs.Factory(list)
    buckets: set[int] = attrs.Factory(set)
    max_running: int = 0
    aborted: int = 0
    sampled: int = 0
    stopped: int = 0
    captures: int = 0
    replays: int = 0
    rows_moved: int = 0
    prefill_chunks: int = 0


def _draw(rng: np.random.Generator, vocab: int, capacity: int, text: bool, longest: int,
          prompt_share: float = 1 / 3) -> dict[str, Any]:
    prompt = rng.integers(3, vocab, int(rng.integers(1, max(2, int(capacity * prompt_share))))).tolist()
    # up to a slot filled to its last position: prompt + max_tokens - 1 = capacity (a Session's count)
    opts: dict[str, Any] = {"max_tokens": int(rng.integers(1, min(capacity - len(prompt) + 1, longest) + 1))}
    if rng.random() < 0.5:
        opts["sampling"] = {"do_sample": True, "temperature": float(rng.choice([0.5, 1.0, 1.5])),
                            "top_k": int(rng.choice([0, 5, 50])), "top_p": float(rng.choice([1.0, 0.9])),
                            "seed": int(rng.integers(0, 2**63))}
    if rng.random() < 0.3:
        opts["stop_token_ids"] = rng.integers(3, vocab, 3).tolist()
    if text and rng.random() < 0.3:
        opts["stop"] = [bytes(rng.integers(97, 100, int(rng.integers(1, 3))).tolist()).decode()]
    return {"prompt": prompt, "options": opts}


def solo_tokens(session, request: Request) -> list[int]:
    """``request``'s tokens run alone on ``session`` (batch 1), ``max_tokens`` of them (no stop
    rule applied; ``[-1]`` marks non-finite logits)."""
    out = session.prefill([request.prompt_ids], [request.sampling])
    tokens = [int(out.tokens[0]) if not out.errors[0] else -1]
    while len(tokens) < request.max_tokens and tokens[-1] >= 0:
        out = session.step()
        tokens.append(int(out.tokens[0]) if not out.errors[0] else -1)
    return tokens


def solo_engine_tokens(engine: Engine, request: Request) -> list[int]:
    """``request``'s tokens run alone on ``engine`` (one slot, no other request): up to
    ``max_tokens`` of them, no stop rule but the model's EOS ids applied (``[-1]`` marks
    non-finite logits)."""
    events: list[Event] = []
    engine.add(engine.request(request.prompt_ids, request.max_tokens, request.sampling, sink=events.append))
    engine.run_until_idle()
    tokens = [t for e in events for t in e.token_ids]
    return tokens + [-1] if events[-1].finish_reason == "error" else tokens


def expected_events(engine: Engine, request: Request, tokens: list[int]) -> list[Event]:
    """The events a fresh copy of ``request`` gives when fed ``tokens`` (until it finishes)."""
    twin = engine.request(request.prompt_ids, request.max_tokens, request.sampling, list(request.stop_strings) or None,
                          sorted(request.stop_token_ids) or None)
    events = []
    for tok in tokens:
        events.append(twin.feed(max(tok, 0), tok < 0))
        if events[-1].finish_reason is not None:
            break
    return events


def fuzz_arrivals(runner, seed: int, requests: int = 300, max_batch: int = 8, capacity: int = 48,
                  arrival_span: int | None = None, abort_rate: float = 0.1, longest: int | None = None,
                  run_ahead: bool = True, compact: bool = True, prefill_chunk: int | None = None,
                  prompt_share: float = 1 / 3, solo: str = "session", prefill_tokens: int = 2048) -> FuzzReport:
    """Run ``requests`` random requests on an engine and compare each with its solo run.

    Args:
        runner: the :class:`~core.runtime.runner.Runner` (any provider).
        seed: every draw comes from it.
        requests, max_batch, capacity: how many requests; the engine's slots and positions.
        arrival_span: iterations over which arrivals spread (default: keeps the slots busy).
        abort_rate: the share of requests aborted after a random number of iterations.
        longest: the most ``max_tokens`` drawn (default: what the capacity allows).
        run_ahead: the engine's ``run_ahead``.
        compact: the engine's ``compact``.
        prefill_chunk: the engine's ``prefill_chunk`` (None: whole prompts).
        prefill_tokens: the engine's ``prefill_tokens`` (a few chunks: long prompts take several
            iterations, rows mid-prefill stepping as padded lanes between them).
        prompt_share: prompts are drawn up to this share of ``capacity`` tokens long.
        solo: "session" (a batch-1 Session, unchunked) or "engine" (a one-slot engine with the
            same ``prefill_chunk``) as each request's solo run.

    Raises:
        ValueError: an unknown ``solo``.
    """
    from core.session import Session

    if solo not in ("session", "engine"):
        raise ValueError(f"solo must be 'session' or 'engine', got {solo!r}")
    rng = np.random.default_rng(seed)
    engine = Engine(runner, max_batch=max_batch, capacity=capacity, max_waiting=requests, capture=None,
                    run_ahead=run_ahead, compact=compact, prefill_chunk=prefill_chunk, prefill_tokens=prefill_tokens)
    vocab = runner.model.config.vocab_size
    text = runner.model.tokenizer is not None
    span = arrival_span or max(1, requests * capacity // (3 * max_batch))
    draws = [(int(rng.integers(0, span)), i, _draw(rng, vocab, capacity, text, longest or capacity, prompt_share))
             for i in range(requests)]
    plan = sorted(draws, key=lambda x: (x[0], x[1]))
    aborts = {i: int(rng.integers(0, 12)) for i in range(requests) if rng.random() < abort_rate}
    report = FuzzReport(requests)
    got: dict[str, list[Event]] = {}
    made: list[Request] = []
    abort_at: dict[int, list[str]] = {}
    it, k = 0, 0
    while k < len(plan) or engine.busy():
        while k < len(plan) and plan[k][0] <= it:
            _, i, draw = plan[k]
            k += 1
            events: list[Event] = []
            req = engine.request(draw["prompt"], sink=events.append, **draw["options"])
            got[req.id] = events
            made.append(req)
            engine.add(req)
            if i in aborts:
                abort_at.setdefault(it + aborts[i], []).append(req.id)
        for rid in abort_at.pop(it, []):
            engine.abort(rid)
        bucket = engine.scheduler.bucket()
        engine.run_once()
        if bucket:
            report.buckets.add(bucket)
        report.max_running = max(report.max_running, engine.running)
        it += 1
    engine.shutdown()
    report.captures, report.replays = engine.counters.captures, engine.counters.replays
    report.rows_moved, report.prefill_chunks = engine.counters.rows_moved, engine.counters.prefill_chunks
    alone = Engine(runner, max_batch=1, capacity=capacity, capture=None, prefill_chunk=prefill_chunk) \
        if solo == "engine" else None
    session = Session(runner, batch=1, capacity=capacity, kv_policy="fixed") if alone is None else None
    try:
        for req in made:
            events = got[req.id]
            mine = [t for e in events for t in e.token_ids]
            solo_ids = solo_tokens(session, req) if alone is None else solo_engine_tokens(alone, req)
            report.sampled += req.sampling.samples
            if req.finish_reason == "abort":
                report.aborted += 1
                if mine != solo_ids[:len(mine)]:
                    report.mismatches.append(f"{req.id} (aborted): {mine} is not a prefix of {solo_ids}")
                continue
            want = expected_events(engine, req, solo_ids)
            report.stopped += want[-1].finish_reason == "stop"
            have = [(e.token_ids, e.text, e.finish_reason) for e in events]
            solo_events = [(e.token_ids, e.text, e.finish_reason) for e in want]
            if have != solo_events:
                report.mismatches.append(f"{req.id}: engine {have} != solo {solo_events}")
    finally:
        if session is not None:
            session.close()
        if alone is not None:
            alone.shutdown()
    return report

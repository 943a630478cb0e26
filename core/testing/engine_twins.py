"""The same rows through the fixed-batch :class:`~core.session.Session` and through the
:class:`~core.engine.Engine`, with the logits each token was chosen from (for the tests that
hold them bitwise equal: tests/unit/test_engine_logprobs.py and its cuda twin)."""

from __future__ import annotations

from typing import Any, Sequence
from unittest import mock

import numpy as np

import core.engine.engine as engine_mod
import core.engine.prefill as prefill_mod
from core.engine import Engine
from core.engine.logprobs import chosen
from core.session import Session


def session_rows(runner, prompts: Sequence[list[int]], max_tokens: int, capacity: int,
                 sampling: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokens int64 ``[B, max_tokens]`` and fp32 logits ``[B, max_tokens, V]`` of ``prompts``
    decoded as one fixed batch (a ``kv_policy="fixed"`` Session of ``capacity`` positions)."""
    s = Session(runner, batch=len(prompts), capacity=capacity, kv_policy="fixed")
    out = s.prefill([list(p) for p in prompts], sampling)
    tokens, logits = [out.tokens], [s.last_logits()]
    for _ in range(max_tokens - 1):
        tokens.append(s.step().tokens)
        logits.append(s.last_logits())
    return np.stack(tokens, 1), np.stack(logits, 1)


def engine_rows(runner, prompts: Sequence[list[int]], max_tokens: int, capacity: int, sampling: Any = None,
                max_batch: int = 4, prefill_chunk: int | None = None
                ) -> tuple[list[list[int]], list[list[np.ndarray]], list[list[Any]]]:
    """Per request of ``prompts`` submitted together to an engine (``logprobs=True``): its
    tokens, the fp32 logits ``[V]`` it chose each from, and its events' logprobs (prompts
    prefilled in chunks of ``prefill_chunk`` positions; None: whole).

    The logits are those :func:`core.engine.logprobs.chosen` is given, recorded by wrapping it
    (the engine computes a row's logprob just before it feeds the row its token)."""
    last: list = [None]

    def recording(logits, token):
        last[0] = np.asarray(logits).reshape(-1).astype(np.float32)
        return chosen(logits, token)

    engine = Engine(runner, max_batch=max_batch, capacity=capacity, prefill_chunk=prefill_chunk)
    handles = [engine.submit(list(ids), max_tokens=max_tokens, sampling=sampling[i] if sampling else None,
                             logprobs=True) for i, ids in enumerate(prompts)]
    logits_of: list[list[np.ndarray]] = [[] for _ in prompts]
    for i, h in enumerate(handles):
        assert h.request is not None

        def fed(token, error, logprob=None, i=i, feed=h.request.feed):
            if logprob is not None:
                logits_of[i].append(last[0])
            return feed(token, error, logprob)
        h.request.feed = fed  # type: ignore[method-assign]
    with mock.patch.object(engine_mod, "chosen", recording), mock.patch.object(prefill_mod, "chosen", recording):
        engine.run_until_idle()
    engine.shutdown()
    events = [list(h) for h in handles]
    tokens = [[t for e in ev for t in e.token_ids] for ev in events]
    logprobs = [[lp for e in ev for lp in (e.logprobs or [])] for ev in events]
    return tokens, logits_of, logprobs


def assert_rows_agree(runner, e_tokens: list[list[int]], e_logits: list[list[np.ndarray]],
                      s_tokens: np.ndarray, s_logits: np.ndarray, label: Any = None) -> None:
    """Each engine request's tokens and logits are the fixed-batch Session row's, bitwise, up to
    where the request ended: all ``max_tokens`` tokens, or fewer ending on one of the model's EOS
    ids (the engine finishes a request there; the Session row decodes on).

    Raises:
        AssertionError: a row differs, or ended early on a token that is no EOS id.
    """
    from core.generation.stream import eos_ids

    eos = eos_ids(runner.model)
    for b, row in enumerate(e_tokens):
        n = len(row)
        assert n == s_tokens.shape[1] or (n > 0 and row[-1] in eos), (label, b, row)
        assert row == s_tokens[b, :n].tolist(), (label, b)
        assert all(np.array_equal(e_logits[b][t], s_logits[b, t]) for t in range(n)), (label, b)


def assert_tight_capacity_rows(runner, ids: list[list[int]], news: list[int], capacity: int,
                               sampling: list | None = None) -> None:
    """``core.run`` of ``ids`` on the engine at a ``capacity`` as tight as a Session's row (some
    row needs exactly ``capacity`` positions, its last token's KV never written, while another
    decodes on, so steps queued ahead run it past its last token): each row must equal its
    batch-1 Session run at that capacity, text and finish reason included."""
    import core

    got = core.run(runner, input_ids=ids, max_new_tokens=news, capacity=capacity, sampling=sampling)
    assert got.counters["engine_requests"] == len(ids) and got.counters["run_ahead_steps"] > 0
    for b in range(len(ids)):
        session = Session(runner, batch=1, capacity=capacity, kv_policy="fixed")
        want = session.stream([ids[b]], [news[b]], sampling=[sampling[b]] if sampling else None).run()[0]
        session.close()
        assert got.rows[b].output_ids == want.output_ids and len(want.output_ids) == news[b]
        assert (got.rows[b].text, got.rows[b].finish_reason) == (want.text, want.finish_reason)

"""Per-row generation as a stream of deltas: stop rules, incremental text, continuation.

:class:`Generation` drives a :class:`~core.session.Session` row by row on top of the lockstep
batch: every row has its own ``max_new_tokens``, stop token ids, stop strings and sampling
options; every EOS id the model declares ends a row. Iterating a Generation runs the prefill
and the decode steps and yields a :class:`Delta` per row and step that has news (a token, text,
or its end). ``core.run`` drains one, so streamed and non-streamed results are the same.

**Text.** Each row has an :class:`IncrementalDetokenizer`: the text of a row is always
``tokenizer.decode(output_ids)``; a delta is what became final since the last one. Text ending
in an incomplete UTF-8 sequence (U+FFFD at the end, e.g. the first byte tokens of an emoji) and,
for rows with stop strings, the last ``len(longest stop) - 1`` characters (they could begin a
stop string) are held back until later tokens settle them or the row ends. The concatenated
deltas of a row equal its final ``text``.

**Stop strings.** A row ends (finish_reason "stop") at the first token after which its text
contains one of its stop strings; the text is cut before the stop string, the tokens are kept.
A stop token id also ends the row with "stop" (the token kept), an EOS id with "eos".

**Continuing** (:meth:`Generation.extend`). Once every row has ended, rows can be given more
tokens (the next user turn) and decoded on, reusing their KV cache: each row is cut back to
its own history (a finished row kept stepping with the batch; those positions are dropped),
then its last token and the new tokens are fed by teacher forcing, one per decode step, and
the row decodes freely after its last forced token. Rows with fewer new tokens start
generating earlier; the batch stays in lockstep. The result equals a fresh run over the whole
history (sampling too: the random counter is the token's sequence position, docs/design.md).
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Sequence

import attrs
import numpy as np

from core.errors import RequestError, StaleGenerationError
from core.generation.tokens import token_row

#: finish reasons: an EOS id, a stop token id or stop string, max_new_tokens, non-finite logits,
#: or the caller stopped the generation between steps (:meth:`Generation.interrupt`, Ctrl-C)
FINISH_REASONS = ("eos", "stop", "length", "error", "interrupted")


@attrs.frozen
class Delta:
    """What one row produced at one step.

    Attributes:
        row: the row index in the request.
        token_ids: the tokens generated at this step (zero or one).
        text: newly final text of the row (may be "" while bytes of a character are pending).
        finish_reason: None while the row runs; then one of :data:`FINISH_REASONS`.
    """

    row: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


class IncrementalDetokenizer:
    """Text of a growing list of token ids, released as deltas that never change afterwards.

    Args:
        tokenizer: an object with ``decode(ids, skip_special_tokens=True) -> str`` (None: no text).
        holdback: characters to hold back while running (stop-string lookahead).

    The concatenation of every :meth:`push` result and :meth:`finish` equals
    ``tokenizer.decode(ids)`` of all ids pushed (tested with emoji and CJK, whose UTF-8 bytes
    arrive in separate byte-level tokens).
    """

    def __init__(self, tokenizer, holdback: int = 0):
        self.tokenizer = tokenizer
        self.holdback = holdback
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids) if self.tokenizer is not None else ""

    def push(self, token: int) -> str:
        """Add one token; returns the text that became final (:meth:`add` then :meth:`release`)."""
        self.add(token)
        return self.release()

    def add(self, token: int) -> None:
        """Add one token without releasing text (a stop-string check comes first)."""
        self.ids.append(int(token))
        self.text = self._decode()

    def release(self) -> str:
        """The text that became final: all but a trailing incomplete character and the holdback."""
        return self._release(len(self.text.rstrip("\ufffd")) - self.holdback)

    def finish(self, cut: int | None = None) -> str:
        """The row ended: release the rest (up to ``cut`` characters of the text, if given)."""
        if cut is not None:
            self.text = self.text[:cut]
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted:end]
        self.emitted = end
        return out


@attrs.define
class RowState:
    """One row of a :class:`Generation` (``core.run`` turns it into a :class:`~core.generation.generate.Row`).

    Attributes:
        prompt_ids: the tokens before this turn's output (for a continued row: the whole history).
        output_ids: tokens generated this turn (the EOS or stop token included).
        text: the output's text (cut before a stop string).
        finish_reason: None while running, then one of :data:`FINISH_REASONS`.
        stop: the stop string or stop token that ended the row, or None.
        max_new_tokens, stop_strings, stop_token_ids: the row's limits.
    """

    prompt_ids: list[int]
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: frozenset = frozenset()
    output_ids: list[int] = attrs.field(factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop: str | int | None = None
    forced: list[int] = attrs.field(factory=list)
    detok: Any = None

    @property
    def history(self) -> list[int]:
        """Every token of the row: prompt and output."""
        return self.prompt_ids + self.output_ids


def _per_row(name: str, value: Any, batch: int, scalar_types: tuple) -> list:
    if value is None or isinstance(value, scalar_types):
        return [value] * batch
    if isinstance(value, Sequence) and len(value) == batch:
        return list(value)
    raise RequestError(f"{name} must be one value for every row or a list of {batch}, got {value!r:.60}")


def _max_new(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise RequestError(f"max_new_tokens must be a non-negative integer, got {value!r}")
    return int(value)


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if isinstance(items, (list, tuple)) and all(isinstance(s, str) for s in items) and not all(items):
        raise RequestError("stop must not be an empty string (it would end every row at once)")
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise RequestError(f"stop must be a non-empty string or a list of them, got {value!r:.60}")
    return tuple(items)


def per_row_stop_ids(stop_token_ids: Any, batch: int, vocab: int) -> list[frozenset]:
    """Each row's stop token ids: one list per row (a list of lists, one per row), or one list
    (or id) for every row.

    Raises:
        RequestError: a list of lists whose length is not the batch, or an id out of the vocabulary.
    """
    if stop_token_ids is not None and isinstance(stop_token_ids, (list, tuple)) and stop_token_ids \
            and all(isinstance(x, (list, tuple, set, frozenset)) for x in stop_token_ids):
        if len(stop_token_ids) != batch:
            raise RequestError(f"stop_token_ids has {len(stop_token_ids)} lists for {batch} rows")
        return [_stop_ids(list(x), vocab) for x in stop_token_ids]
    return [_stop_ids(stop_token_ids, vocab)] * batch


def _stop_ids(value: Any, vocab: int) -> frozenset:
    if value is None:
        return frozenset()
    items = [value] if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, (Sequence, set, frozenset, np.ndarray)) \
            or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < vocab
                       for t in items):
        raise RequestError(f"stop_token_ids must be token ids in [0, {vocab}), got {value!r:.60}")
    return frozenset(int(t) for t in items)


def eos_ids(model) -> frozenset:
    """Every EOS id the model declares: genai_config.json's ``eos_token_id`` (one or a list)
    and the tokenizer's ``eos_token``."""
    ids = set(model.config.eos_token_ids)
    tok = model.tokenizer
    if tok is not None:
        found = tok.token_id(tok.eos_token)
        if found is not None:
            ids.add(int(found))
    return frozenset(ids)


class Generation:
    """Per-row generation on a session, iterated as :class:`Delta` objects.

    Args:
        session: a :class:`~core.session.Session` of ``len(input_ids)`` rows.
        input_ids: one token-id list per row.
        max_new_tokens: per row (an int for all, or a list).
        sampling: per-row sampling options (:meth:`core.session.Session.check_sampling`).
        stop: stop strings (a str, a list for all rows, or a list of lists per row).
        stop_token_ids: ids ending a row besides the EOS ids (for all rows, or per row).
        progress: optional ``callable(step, total)``: (0, total) as the prefill starts, then
            after the prefill and after each decode step.

    Everything is validated here, before any kernel runs (RequestError; the session stays usable).
    After iteration, :attr:`rows` holds each row's :class:`RowState`.

    Raises:
        core.session.RequestError: bad options (see the helpers), or stop strings without a tokenizer.
    """

    def __init__(self, session, input_ids: Sequence[Sequence[int]], max_new_tokens: Any = 64,
                 sampling: Any = None, stop: Any = None, stop_token_ids: Any = None, progress=None):
        self.session = session
        if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, (Sequence, np.ndarray)) \
                or (isinstance(input_ids, np.ndarray) and input_ids.ndim == 0):
            raise RequestError(f"input_ids must be a list of token-id lists, got {type(input_ids).__name__}")
        if progress is not None and not callable(progress):
            raise RequestError(f"progress must be a callable (step, total), got {type(progress).__name__}")
        batch = len(input_ids)
        news = [_max_new(m) for m in _per_row("max_new_tokens", max_new_tokens, batch, (int, np.integer))]
        session.check_prompts(input_ids, news)  # each row against its own prompt
        self.sampling = session.check_sampling(sampling)
        stops = self._per_row_stops(stop, batch)
        vocab = session.model.config.vocab_size
        stop_ids = per_row_stop_ids(stop_token_ids, batch, vocab)
        self.tokenizer = session.model.tokenizer
        if self.tokenizer is None and any(stops):
            raise RequestError("stop strings need a tokenizer; this model has no tokenizer.json")
        self.eos = eos_ids(session.model)
        self.rows = [RowState([int(t) for t in ids], n, s, i) for ids, n, s, i in zip(input_ids, news, stops, stop_ids)]
        for r in self.rows:
            r.detok = self._detokenizer(r)
        self.progress = progress
        #: the prompts a prefill still has to run (None once it ran): a request whose rows all
        #: ask for 0 tokens runs none, and an extend() of it prefills them first
        self._input_ids: list[list[int]] | None = [list(r.prompt_ids) for r in self.rows]
        self._extended = False
        #: the session's request_id this generation drives (None before its prefill)
        self._request: int | None = None
        self._pending = True
        self._last: np.ndarray | None = None

    @staticmethod
    def _per_row_stops(stop: Any, batch: int) -> list[tuple[str, ...]]:
        if isinstance(stop, (list, tuple)) and stop and all(isinstance(x, (list, tuple)) or x is None for x in stop):
            if len(stop) != batch:
                raise RequestError(f"stop has {len(stop)} lists for {batch} rows")
            return [_stop_strings(x) for x in stop]
        return [_stop_strings(stop)] * batch

    def _detokenizer(self, row: RowState) -> IncrementalDetokenizer:
        hold = max((len(s) for s in row.stop_strings), default=1) - 1
        return IncrementalDetokenizer(self.tokenizer, hold)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Delta]:
        if not self._pending:
            return
        self._pending = False
        s = self.session
        if self._input_ids is not None and not self._extended:  # a new request
            for b, r in enumerate(self.rows):
                if r.max_new_tokens == 0:
                    r.finish_reason = "length"
                    yield Delta(b, [], "", "length")
            if all(r.finish_reason is not None for r in self.rows):
                return  # no prefill: the prompts stay in _input_ids for an extend()
        if self._input_ids is not None:  # the prefill (of a continued 0-token turn too)
            ids, self._input_ids = self._input_ids, None
            if self.progress is not None:  # the prefill starts: (0, total)
                self.progress(0, max(r.max_new_tokens for r in self.rows))
            out = s.prefill(ids, self.sampling)
            self._request = s.request_id
        else:  # a continuation: the first forced step
            self._check_current()
            out = self._step()
        step = 0
        queued: list = []  # steps queued ahead (Session.run_ahead) and not read, oldest first
        try:
            while True:
                deltas = list(self._observe(out))
                while self._may_queue(len(queued)):  # the device runs them while the caller reads
                    queued.append(s.step_async())
                yield from deltas
                self._check_current()  # the caller may have started another request meanwhile
                step += 1
                if self.progress is not None:
                    self.progress(step, max(r.max_new_tokens for r in self.rows))
                if all(r.finish_reason is not None for r in self.rows):
                    return
                if queued and queued[0].discarded:  # the caller stepped the session during the yield
                    queued.clear()
                out = queued.pop(0).result() if queued else self._step()
        finally:  # ended (or abandoned) with steps queued for rows that are done: undo them
            unread = [q for q in queued if not q.discarded and not q.read]  # the caller may have read one
            if unread:
                s.discard(unread[0])

    def _step(self) -> Any:
        """One synchronous decode step. Rows that ended keep stepping with the batch, but
        when the next step would pass the KV limit they are cut back to their own history
        first (their positions past it hold nothing anyone reads), so each row needs only
        its own prompt + max_new_tokens - 1 positions (what :meth:`Session.check_prompts`
        checks per row). A finished row whose own history fills the limit steps in place, one
        position back: it can never be continued (no room for its last token), so the position
        it overwrites is never read."""
        s = self.session
        lengths = np.asarray(s.lengths, np.int64)
        limit = s.state.kv.limit
        if int(lengths.max()) + 1 > limit:
            own = [len(r.prompt_ids) + max(len(r.output_ids) - 1, 0) if r.finish_reason is not None else int(n)
                   for r, n in zip(self.rows, lengths)]
            s.rewind([max(min(o, int(n), limit - 1), 1) for o, n in zip(own, lengths)])
            self._request = s.request_id
        return s.step(force_tokens=self._forced())

    def _check_current(self) -> None:
        """Refuse to step the session for this generation once another request (a prefill or
        a continuation) started on it: its KV cache no longer holds these rows.

        Raises:
            core.session.StaleGenerationError: another request started since.
        """
        if self._request is not None and self.session.request_id != self._request:
            raise StaleGenerationError(
                "another request started on this session after this generation (a prefill, a "
                "stream or an extend); the session's KV cache no longer holds its rows, so it cannot "
                "go on. Give concurrent requests their own Session")

    def _may_queue(self, ahead: int) -> bool:
        """Whether to queue the step after the ``ahead`` steps already queued past the one just
        observed: the session can run ahead (:meth:`Session.can_run_ahead`), no row is being
        fed (a fed step needs the last step's tokens on the host), and some row still needs
        that step unless it ends early (EOS or a stop: then the step is discarded)."""
        return (not any(r.forced for r in self.rows)
                and any(r.finish_reason is None and len(r.output_ids) + ahead < r.max_new_tokens
                        for r in self.rows)
                and max(self.session.lengths) + 1 <= self.session.state.kv.limit  # else _step cuts back
                and self.session.can_run_ahead())  # False unless the session runs ahead

    def _forced(self) -> list[int] | None:
        """This step's tokens per row when some row still has tokens to be fed, else None."""
        if not any(r.forced for r in self.rows):
            return None
        last = self._last if self._last is not None else np.zeros(len(self.rows), np.int64)
        return [r.forced.pop(0) if r.forced else max(int(last[b]), 0) for b, r in enumerate(self.rows)]

    def _observe(self, out) -> Iterator[Delta]:
        self._last = out.tokens
        for b, r in enumerate(self.rows):
            if r.finish_reason is not None or r.forced:
                continue  # ended, or still being fed: this step's choice is not an output
            if out.errors[b]:
                yield self._end(b, r, "error")
                continue
            tok = int(out.tokens[b])
            r.output_ids.append(tok)
            r.detok.add(tok)
            reason, cut = None, None
            if tok in self.eos:
                reason = "eos"
            elif tok in r.stop_token_ids:
                reason, r.stop = "stop", tok
            else:
                cut = self._stop_at(r)
                if cut is not None:
                    reason = "stop"
                elif len(r.output_ids) >= r.max_new_tokens:
                    reason = "length"
            if reason is None:
                text = r.detok.release()
                r.text = r.detok.text[:r.detok.emitted]
                yield Delta(b, [tok], text)
            else:
                yield self._end(b, r, reason, [tok], cut)

    def _stop_at(self, r: RowState) -> int | None:
        if not r.stop_strings:
            return None
        text = r.detok.text
        hits = [(text.find(s), s) for s in r.stop_strings]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        i, s = min(hits)
        r.stop = s
        return i

    def _end(self, b: int, r: RowState, reason: str, ids: list[int] | None = None,
             cut: int | None = None) -> Delta:
        if cut is not None and cut < r.detok.emitted:  # cannot happen: held back (kept as a guard)
            raise AssertionError("a stop string began inside text already released")
        text = r.detok.finish(cut)
        r.text, r.finish_reason = r.detok.text, reason
        return Delta(b, list(ids or []), text, reason)

    def interrupt(self) -> list[Delta]:
        """End every running row now, between steps, keeping what it made: finish reason
        "interrupted", its tokens and their text (held-back characters released). Close the
        iterator first (a ``for`` loop left with ``break`` does not); the session then stands
        at a step boundary, so an interrupted row can be continued (:meth:`extend`) like an
        ended one. Returns the rows' last deltas.

        Raises:
            core.session.RequestError: the prefill has not run, or a row is still being fed its
                new tokens (its KV cache would not hold the history it records); nothing changes.
        """
        if self._input_ids is not None or any(r.forced for r in self.rows if r.finish_reason is None):
            raise RequestError("interrupt() stops rows between decode steps, after the prefill and the fed "
                               "tokens; iterate until a row yields a token first")
        out = []
        for b, r in enumerate(self.rows):
            if r.finish_reason is None:
                out.append(self._end(b, r, "interrupted"))
        self._pending = False
        return out

    def run(self) -> list[RowState]:
        """Iterate to the end; returns :attr:`rows`."""
        for _ in self:
            pass
        return self.rows

    # -- continuing ---------------------------------------------------------------------------
    def extend(self, new_tokens: Sequence[Sequence[int] | None], max_new_tokens: Any = 64,
               sampling: Any = None, stop: Any = None, stop_token_ids: Any = None) -> Generation:
        """Continue rows after every row has ended: row b gets ``new_tokens[b]`` appended to its
        history (None: the row stays ended) and decodes on. Returns self; iterate it again.

        Raises:
            core.session.RequestError: rows still running, a row that ended in error, nothing to
                feed to a row (no output and no new tokens), tokens outside the vocabulary, the
                history beyond the KV limit, or a row that ran further past its end than a ring
                KV cache keeps (:attr:`core.runtime.kv.KVCache.rewind_limit`). Checked before
                any kernel runs.
        """
        s = self.session
        if self._pending or any(r.finish_reason is None for r in self.rows):
            raise RequestError("extend() continues a finished generation; iterate it to the end first")
        prefill_pending = self._input_ids is not None  # a 0-token turn: its prompts were never run
        if not prefill_pending:
            self._check_current()
        batch = len(self.rows)
        if isinstance(new_tokens, (str, bytes)) or not isinstance(new_tokens, (Sequence, np.ndarray)) \
                or len(new_tokens) != batch:
            raise RequestError(f"extend needs {batch} rows of tokens (None for a row that stays ended)")
        news = [_max_new(m) for m in _per_row("max_new_tokens", max_new_tokens, batch, (int, np.integer))]
        vocab = s.model.config.vocab_size
        stops = self._per_row_stops(stop, batch)
        stop_ids = [_stop_ids(stop_token_ids, vocab)] * batch
        lengths: list[int] = []
        plans: list[list[int] | None] = []
        for b, (r, new) in enumerate(zip(self.rows, new_tokens)):
            kv = len(r.prompt_ids) + max(len(r.output_ids) - 1, 0)  # positions the row's KV holds
            lengths.append(kv)
            if new is None:
                plans.append(None)
                continue
            extra = token_row(b, new).tolist() if len(new) else []
            if r.finish_reason == "error":
                raise RequestError(f"row {b} ended with non-finite logits; it cannot be continued")
            if any(not 0 <= t < vocab for t in extra):
                raise RequestError(f"row {b}: new tokens outside [0, {vocab})")
            feed = r.output_ids[-1:] + extra
            if not feed:
                raise RequestError(f"row {b} has nothing to continue from (no output and no new tokens)")
            need = kv + len(feed) + news[b] - 1
            rewind = int(s.state.lengths[b]) - kv
            if s.state.kv.rewind_limit is not None and rewind > s.state.kv.rewind_limit:
                raise RequestError(f"row {b} ran {rewind} positions past its end while the batch decoded; the "
                                   f"model's sliding-window layers keep a ring that holds only "
                                   f"{s.state.kv.rewind_limit} of them (docs/kv-geometry.md): run it again with its "
                                   "history as the prompt, or use a folder built with windowed_kv_cache=false")
            if need > s.state.kv.limit:
                raise RequestError(f"row {b} needs {need} KV positions; the session's limit is {s.state.kv.limit}")
            plans.append(feed)
        if all(p is None for p in plans):
            raise RequestError("extend() got no row to continue")
        rows = s.check_sampling(sampling) if sampling is not None else self.sampling
        # everything is validated: the session changes first (it validates too), the rows after
        if prefill_pending:  # the rows' KV is what the prefill will hold: every row's prompt so far
            self._input_ids = [list(r.prompt_ids) for r in self.rows]
        else:
            s.rewind(lengths)
            self._request = s.request_id
            s.set_sampling(rows, [r.history[:lengths[b]] for b, r in enumerate(self.rows)])
        # the longest feed sets how many forced steps the batch runs; a row finished meanwhile idles
        for b, (r, plan) in enumerate(zip(self.rows, plans)):
            if plan is None:
                continue
            feed = plan
            r.prompt_ids = r.history + feed[1:] if r.output_ids else r.prompt_ids + feed
            r.output_ids, r.text, r.finish_reason, r.stop = [], "", None, None
            r.max_new_tokens, r.stop_strings, r.stop_token_ids = news[b], stops[b], stop_ids[b]
            r.forced = feed
            r.detok = self._detokenizer(r)
            if news[b] == 0:
                r.finish_reason, r.forced = "length", []
        self.sampling = rows
        self._extended = True
        self._pending = any(r.finish_reason is None for r in self.rows)
        return self


def timed(gen: Generation) -> tuple[list[RowState], float]:
    """Drain ``gen``; returns its rows and the wall seconds it took."""
    t0 = time.perf_counter()
    rows = gen.run()
    return rows, time.perf_counter() - t0

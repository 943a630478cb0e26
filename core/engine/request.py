"""One request of the engine: validated options, stop rules, streaming text and its events.

A :class:`Request` is batch-agnostic: it knows nothing of slots, buckets or the device. The
engine feeds it one chosen token at a time (:meth:`Request.feed`) and publishes what comes back
as :class:`Event` objects to the request's sink.

**Text.** The text of a request is ``tokenizer.decode(output_ids)``; an event carries what
became final since the last one (:class:`core.engine.detok.WindowDetokenizer`, a cost per token
that does not grow with the output): a trailing incomplete UTF-8 sequence is held back, and so
are the last ``len(longest stop) - 1`` characters while stop strings could still begin there.
Released text is never taken back, and the concatenated event texts equal the final text.

**Stop rules**, checked in this order after each token: an EOS id of the model ("stop", the token
kept, as OpenAI reports it), a stop token id ("stop"), a stop string anywhere in the text so far
(matched across token boundaries; "stop", the text cut before it), ``max_tokens`` ("length"),
non-finite logits ("error"). An aborted request ends with "abort".
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Sequence

import attrs
import numpy as np

from core.engine.detok import WindowDetokenizer
from core.engine.logprobs import Logprob
from core.errors import RequestError
from core.generation import sampling as sampling_mod
from core.generation.sampling import SamplingParams
from core.generation.tokens import token_row

#: How a request can end.
FINISH_REASONS = ("stop", "length", "abort", "error")

_ids = itertools.count()


@attrs.frozen
class Usage:
    """Token counts of a request (OpenAI's ``usage``)."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        """Prompt and completion tokens together."""
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class Event:
    """What one request produced at one engine step.

    Attributes:
        request_id: the request's id.
        token_ids: the tokens chosen at this step (zero or one).
        text: newly final text ("" while the bytes of a character or a possible stop string
            are pending).
        finish_reason: None while the request runs, then one of :data:`FINISH_REASONS`.
        usage: the token counts, on the finishing event only.
        error: what went wrong, for finish_reason "error" (or an abort's reason).
        logprobs: one :class:`~core.engine.logprobs.Logprob` per token of ``token_ids`` when the
            request asked for them (``logprobs=True``), else None.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    logprobs: list[Logprob] | None = None


Sink = Callable[[Event], None]


def _max_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise RequestError(f"max_tokens must be a positive integer, got {value!r:.60}")
    return int(value)


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise RequestError(f"stop must be a non-empty string or a list of them, got {value!r:.60}")
    return tuple(items)


def _stop_ids(value: Any, vocab: int) -> frozenset:
    if value is None:
        return frozenset()
    items = value if isinstance(value, (list, tuple, set, frozenset)) else [value]
    ids = [t for t in items if isinstance(t, (int, np.integer)) and not isinstance(t, bool)]
    if len(ids) != len(items) or any(not 0 <= t < vocab for t in ids):
        raise RequestError(f"stop_token_ids must be token ids in [0, {vocab}), got {value!r:.60}")
    return frozenset(int(t) for t in ids)


class Request:
    """One request: a prompt, its limits and sampling, and its progress.

    Made by :meth:`core.engine.Engine.request` (which validates against the engine's model and
    capacity); the engine alone changes it once added.

    Attributes:
        id: a unique id (given, or ``req-N``).
        prompt_ids: the prompt's token ids.
        max_tokens: the most tokens to generate (>= 1).
        sampling: the seeded :class:`~core.generation.sampling.SamplingParams`.
        stop_strings, stop_token_ids, eos_ids: the stop rules.
        output_ids: tokens generated so far (the stop or EOS token included).
        text: the released text so far; the whole text once finished.
        finish_reason: None while waiting or running, then one of :data:`FINISH_REASONS`.
        logprobs: whether each event carries its tokens' :class:`~core.engine.logprobs.Logprob`.
        arrived, first_token_at, finished_at: ``time.perf_counter()`` seconds (None until then).
    """

    def __init__(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, stop_strings: tuple[str, ...],
                 stop_token_ids: frozenset, eos_ids: frozenset, tokenizer: Any, sink: Sink | None = None,
                 request_id: str | None = None, logprobs: bool = False):
        self.id = request_id or f"req-{next(_ids)}"
        self.prompt_ids, self.max_tokens, self.sampling = prompt_ids, max_tokens, sampling
        self.stop_strings, self.stop_token_ids, self.eos_ids = stop_strings, stop_token_ids, eos_ids
        self.sink, self.logprobs = sink, logprobs
        hold = max((len(s) for s in stop_strings), default=1) - 1
        self.detok = WindowDetokenizer(tokenizer, hold)
        self.output_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop: str | int | None = None
        self.arrived = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    @property
    def positions(self) -> int:
        """KV positions the request may need: its prompt plus ``max_tokens``."""
        return len(self.prompt_ids) + self.max_tokens

    @property
    def usage(self) -> Usage:
        """Token counts so far."""
        return Usage(len(self.prompt_ids), len(self.output_ids))

    def feed(self, token: int, error: bool, logprob: Logprob | None = None) -> Event:
        """Record the token the model chose (or non-finite logits, ``error``) and, when the
        request asked for logprobs, its ``logprob``; returns the event, finishing the request
        when a stop rule says so."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if error:
            return self.finish("error", error="the model's logits held NaN or infinity")
        tok = int(token)
        lps = [logprob] if logprob is not None else None
        self.output_ids.append(tok)
        self.detok.add(tok)
        if tok in self.eos_ids or tok in self.stop_token_ids:
            self.stop = tok
            return self.finish("stop", [tok], logprobs=lps)
        cut = self._stop_at()
        if cut is not None:
            return self.finish("stop", [tok], cut, logprobs=lps)
        if len(self.output_ids) >= self.max_tokens:
            return self.finish("length", [tok], logprobs=lps)
        text = self.detok.release()
        self.text += text
        return Event(self.id, [tok], text, logprobs=lps)

    def finish(self, reason: str, token_ids: Sequence[int] = (), cut: int | None = None,
               error: str | None = None, logprobs: list[Logprob] | None = None) -> Event:
        """End the request with ``reason``: the rest of the text is released (cut at ``cut``
        characters, a stop string's start); returns the finishing event (with ``logprobs``,
        those of ``token_ids``)."""
        text = self.detok.finish(cut)
        self.text += text
        self.finish_reason = reason
        self.finished_at = time.perf_counter()
        return Event(self.id, list(token_ids), text, reason, self.usage, error, logprobs)

    def _stop_at(self) -> int | None:
        text = self.detok.text
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self.stop_strings) if i >= 0]
        if not hits:
            return None
        i, self.stop = min(hits)
        return i


def make_request(model: Any, prompt_ids: Any, max_tokens: Any, sampling: Any, stop: Any, stop_token_ids: Any,
                 capacity: int, sink: Sink | None = None, request_id: str | None = None,
                 can_sample: bool = True, logprobs: Any = False) -> Request:
    """A validated :class:`Request` for ``model`` on an engine of ``capacity`` positions a slot.

    Args:
        model: the :class:`~core.models.model.Model` (vocabulary, EOS ids, tokenizer, defaults).
        prompt_ids: a non-empty list of token ids.
        max_tokens: the most tokens to generate (>= 1).
        sampling: a dict of sampling options or a SamplingParams (None: the model's defaults).
        stop: a stop string or a list of them (None: none).
        stop_token_ids: token ids that end the request besides the model's EOS ids.
        capacity: KV positions of one slot: prompt plus ``max_tokens`` minus one must fit (the
            last token's KV is never written, as on a :class:`~core.session.Session`).
        sink: called with every :class:`Event` of the request, from the engine's thread.
        request_id: the request's id (default ``req-N``).
        can_sample: the provider has ``device_sample``.
        logprobs: True to have each event carry its tokens' log-probabilities.

    Raises:
        RequestError: any option out of range (the message names it); nothing is queued then.
    """
    from core.generation.stream import eos_ids

    ids = token_row(0, prompt_ids)
    vocab = model.config.vocab_size
    if ids.min() < 0 or ids.max() >= vocab:
        raise RequestError(f"the prompt has token ids outside [0, {vocab})")
    n = _max_tokens(max_tokens)
    if len(ids) + n - 1 > capacity:  # the last token's KV is never written (a Session's count)
        tokens = f"{len(ids)} token" + ("" if len(ids) == 1 else "s")
        room = (f"max_tokens can be at most {capacity - len(ids) + 1}" if len(ids) <= capacity
                else "shorten the prompt")
        raise RequestError(f"the prompt has {tokens}; with max_tokens={n} it needs {len(ids) + n - 1} "
                           f"positions, and a slot holds {capacity}: {room}")
    stops = _stop_strings(stop)
    if stops and model.tokenizer is None:
        raise RequestError("stop strings need a tokenizer; this model has no tokenizer.json")
    try:
        params = sampling_mod.make_params(sampling, sampling_mod.search_defaults(model.config.search)).with_seed()
    except sampling_mod.SamplingError as exc:
        raise RequestError(str(exc)) from None
    if not isinstance(logprobs, bool):
        raise RequestError(f"logprobs must be true or false, got {logprobs!r:.60}")
    if not params.greedy_plain and not can_sample:
        raise RequestError("this provider has no device_sample; it decodes greedily only")
    return Request([int(t) for t in ids], n, params, stops, _stop_ids(stop_token_ids, vocab), eos_ids(model),
                   model.tokenizer, sink, request_id, logprobs)

"""The OpenAI request fields the server accepts, validated into engine options, and the bodies
it answers with (completions, chat completions, their SSE chunks, errors).

Accepted: ``model``, ``prompt`` (completions: a string, or a list of one string or of token
ids), ``messages`` (chat: ``{"role", "content"}``, a content a string or a list of text parts), ``max_tokens``
(``max_completion_tokens`` for chat), ``stop`` (a string or up to 4), ``temperature``
(0: greedy; > 0: sampled; absent: the model's defaults), ``top_p``, ``top_k``, ``seed``,
``n`` (1 only), ``stream``, ``stream_options.include_usage``, and ``user``,
``presence_penalty`` / ``frequency_penalty`` at 0. Anything else is refused with an
OpenAI-style 400 body naming the field.

**Logprobs** of the chosen token (:mod:`core.engine.logprobs`): completions take ``logprobs``
0 or 1 (1 adds the most likely token in ``top_logprobs``; more is refused, naming the limit),
chat takes ``logprobs: true`` with ``top_logprobs`` 0 (or absent). The bodies follow OpenAI's:
completions ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, chat ``{"content":
[{"token", "logprob", "bytes", "top_logprobs"}]}``; a token's string is the tokenizer's
decoding of that token alone.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

import attrs

from core.engine import Usage
from core.engine.logprobs import Logprob

#: The most ``logprobs`` (completions) / ``top_logprobs`` (chat) a request may ask for.
MAX_TOP_LOGPROBS = {False: 1, True: 0}


class APIError(Exception):
    """A refused request: HTTP ``status`` and an OpenAI error body (:meth:`body`)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.kind = message, status, param, kind
        self.headers = headers or {}

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


#: Fields accepted with any value that has no effect here.
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
_COMMON = {"model", "max_tokens", "stop", "temperature", "top_p", "top_k", "seed", "n", "stream",
           "stream_options", "presence_penalty", "frequency_penalty", "logprobs"} | _IGNORED
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}


@attrs.frozen
class Parsed:
    """A validated request: engine options and how to answer."""

    prompt: Any  # a str (completions), token ids, or chat messages
    max_tokens: int | None
    sampling: dict | None
    stop: list[str] | None
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # None: off; else how many top tokens each entry lists (0 or 1)


def _number(body: dict, name: str, low: float, high: float, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (not integer and not math.isfinite(value)) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise APIError(f"{name} must be {kind} in [{low}, {high}], got {value!r:.60}", param=name)
    return value


def parse(body: Any, fields: set, served: str, chat: bool) -> Parsed:
    """Validate an OpenAI request ``body`` for the model named ``served``.

    Raises:
        APIError: 400 for anything malformed or unsupported, an unknown model included.
    """
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise APIError(f"unsupported field(s): {', '.join(unknown)}", param=unknown[0])
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError("model is required (a string; see /v1/models)", param="model")
    if model != served:
        raise APIError(f"the model {model!r} does not exist; this server serves {served!r}", param="model")
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise APIError(f"n must be 1 (one choice per request), got {body.get('n')!r:.20}", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or value != 0):  # 0 and 0.0 are accepted
            raise APIError(f"{name} is not supported (0 only), got {value!r:.60}", param=name)
    logprobs = _logprobs(body, chat)
    if body.get("echo") or body.get("best_of") not in (None, 1):
        raise APIError("echo and best_of are not supported", param="echo")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, 1, 1 << 31, integer=True)
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1)
    if top_p == 0:
        raise APIError("top_p must be in (0, 1]", param="top_p")
    top_k = _number(body, "top_k", -1, 1 << 31, integer=True)
    seed = _number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True)
    sampling: dict[str, Any] = {}
    if temperature is not None:
        sampling.update(do_sample=temperature > 0, temperature=float(temperature))
    if top_p is not None:
        sampling["top_p"] = float(top_p)
    if top_k is not None:
        sampling["top_k"] = max(int(top_k), 0)  # -1 (vLLM's "off") is 0 here
    if seed is not None:
        sampling["seed"] = seed % (1 << 64)
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise APIError("stop must be a non-empty string or a list of up to 4", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError("stream must be true or false", param="stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise APIError("stream_options takes include_usage only", param="stream_options")
    include_usage = (options or {}).get("include_usage")
    include_usage = False if include_usage is None else include_usage
    if not isinstance(include_usage, bool):
        raise APIError(f"stream_options.include_usage must be true or false, got {include_usage!r:.60}",
                       param="stream_options")
    prompt = _messages(body) if chat else _prompt(body)
    return Parsed(prompt, max_tokens, sampling or None, stop or None, stream, include_usage, logprobs)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top tokens each logprob entry lists (None: no logprobs), OpenAI's conventions."""
    limit = MAX_TOP_LOGPROBS[chat]
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise APIError(f"logprobs must be true or false, got {value!r:.60}", param="logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= limit):
            raise APIError(f"top_logprobs must be 0 (at most {limit}: this server returns the chosen token's "
                           f"logprob only), got {top!r:.20}", param="top_logprobs")
        if top is not None and not value:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        return 0 if value else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise APIError(f"logprobs must be an integer in [0, {limit}] (the chosen token's logprob, and with 1 the "
                       f"most likely token's), got {value!r:.20}", param="logprobs")
    return value


def logprobs_body(chat: bool, top: int, entries: list[Logprob], strings: list[str], tops: list[str],
                  offset: int = 0) -> dict:
    """OpenAI's ``logprobs`` object of ``entries`` (one per token; ``strings`` their token
    strings, ``tops`` the most likely tokens' strings; ``offset`` the text offset of the first
    token, for completions)."""
    if chat:
        return {"content": [{"token": s, "logprob": e.logprob, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
                            for e, s in zip(entries, strings)]}
    offsets = []
    for s in strings:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": strings, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: e.top_logprob} for e, t in zip(entries, tops)] if top else None,
            "text_offset": offsets}


def _prompt(body: dict) -> Any:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("prompt is empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise APIError("prompt must be a non-empty string or token-id list (one prompt: n=1)", param="prompt")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(f"messages[{i}] must be an object with a role and a content, got {m!r:.60}",
                           param="messages")
    return [{"role": m.get("role"), "content": _content(m)} for m in messages]


def _content(message) -> str:
    """A message's text: a string, or OpenAI's list of content parts when every part is text
    (``{"type": "text", "text": ...}``, joined in order); images and audio are refused."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError("each message needs a role and a content: a string or a list of text parts "
                   '({"type": "text", "text": ...}); this model reads text only', param="messages")


def new_id(chat: bool) -> str:
    """A response id (``chatcmpl-…`` or ``cmpl-…``)."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage_body(usage: Usage) -> dict:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def response(rid: str, model: str, chat: bool, text: str, reason: str | None, usage: Usage,
             logprobs: dict | None = None) -> dict:
    """A whole (non-streamed) completion or chat completion (``logprobs``: :func:`logprobs_body`)."""
    choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage_body(usage)}


def chunk(rid: str, model: str, chat: bool, text: str | None, reason: str | None, first: bool = False,
          usage: Usage | None = None, logprobs: dict | None = None) -> dict:
    """One streamed chunk; with ``usage`` the last one (no choices), as include_usage asks;
    ``logprobs`` (:func:`logprobs_body`) those of the tokens since the last chunk."""
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": int(time.time()), "model": model}
    if usage is not None:
        body["choices"] = []
        body["usage"] = usage_body(usage)
        return body
    choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": reason}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    body["choices"] = [choice]
    return body

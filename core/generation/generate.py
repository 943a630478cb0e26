"""The main job: greedy batch-N generation, as ``core.run`` and ``lockstep run``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import attrs
import numpy as np

from core.generation.loop import decode
from core.models.model import Model, load_model
from core.runtime import kv as kvgeo
from core.runtime.runner import Runner
from core.session import RequestError, Session, token_row


@attrs.frozen
class Row:
    """One sequence of a result.

    Attributes:
        prompt_ids: the prompt's token ids.
        output_ids: generated token ids (EOS included when the row ended on it).
        text: ``output_ids`` decoded (special tokens skipped); "" without a tokenizer.
        finish_reason: "eos", "length", or "error" (the row's logits held NaN/inf; docs/cases.md 12).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str


@attrs.frozen
class Result:
    """Rows in request order, the provider name and the session counters (a dict)."""

    rows: list[Row]
    provider: str
    counters: dict

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens (padding excluded) per second of prefill; None when nothing ran."""
        c = self.counters
        return c["prefill_tokens"] / c["prefill_s"] if c.get("prefill_s") else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens the decode steps generated (every row's output after the first token, which
        the prefill chooses) per second of decode; None without decode steps."""
        c = self.counters
        made = sum(max(len(r.output_ids) - 1, 0) for r in self.rows)
        return made / c["decode_s"] if c.get("decode_s") else None

    def to_dict(self) -> dict:
        """Rows, provider, counters and the two token rates as plain data (the CLI's ``--json``)."""
        return {**attrs.asdict(self), "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s}


def check_prompt_texts(prompts: Sequence[str]) -> None:
    """Refuse prompts that are not non-empty, valid Unicode strings (before any model work).

    Raises:
        RequestError: ``prompts`` is not a list, or prompt i is not a str (e.g. an int: pass
            token ids as ``input_ids``), is blank, or holds a lone surrogate (non-UTF-8 bytes
            on the command line, or a bad string from the caller).
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise RequestError(f"prompts must be a list of str, got {type(prompts).__name__}")
    for i, text in enumerate(prompts):
        if not isinstance(text, str):
            hint = "; token ids go in input_ids=" if isinstance(text, (int, list, tuple)) else ""
            raise RequestError(f"prompt {i} must be a str, got {type(text).__name__}{hint}")
        if not text.strip():
            raise RequestError(f"prompt {i} is empty")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(f"prompt {i} is not valid UTF-8 text (character {exc.start} is "
                               f"{text[exc.start]!r})") from None


def encode_prompts(model: Model, prompts: Sequence[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt, through the chat template unless ``chat`` is False.

    Raises:
        RequestError: a prompt that is not a str, is empty or is not valid Unicode (a lone
            surrogate, e.g. non-UTF-8 bytes on the command line), or the model has no tokenizer.
    """
    check_prompt_texts(prompts)
    if model.tokenizer is None:
        raise RequestError(f"model {model.folder} has no tokenizer.json; pass input_ids instead")
    out = []
    for text in prompts:
        out.append(model.tokenizer.encode(model.tokenizer.apply_chat_template(text) if chat else text))
    return out


def generate(session: Session, input_ids: Sequence[Sequence[int]], max_new_tokens: int,
             progress=None) -> list[tuple[list[int], str]]:
    """Greedy decoding of ``input_ids`` on ``session``: per row (output_ids, finish_reason).

    A row ends at an EOS token (kept in its output), after ``max_new_tokens`` tokens, or when
    its logits are non-finite ("error"); finished rows keep stepping in lockstep but their
    tokens are discarded. Validates the whole request first (RequestError, nothing run).
    """
    session.check_prompts(input_ids, max_new_tokens)
    B = len(input_ids)
    if max_new_tokens == 0:
        return [([], "length") for _ in range(B)]
    outputs: list[list[int]] = [[] for _ in range(B)]
    reasons: list[str | None] = [None] * B
    eos = set(session.model.config.eos_token_ids)

    def observe(t: int, out, _seconds: float) -> bool:
        for b in range(B):
            if reasons[b] is not None:
                continue
            if out.errors[b]:
                reasons[b] = "error"
                continue
            tok = int(out.tokens[b])
            outputs[b].append(tok)
            if tok in eos:
                reasons[b] = "eos"
            elif len(outputs[b]) >= max_new_tokens:
                reasons[b] = "length"
        if progress is not None:
            progress(t + 1, max_new_tokens)
        return all(r is not None for r in reasons)

    if progress is not None:
        progress(0, max_new_tokens)  # the prefill starts
    decode(session, input_ids, max_new_tokens - 1, observer=observe)
    return [(o, r or "length") for o, r in zip(outputs, reasons)]


def run(model: str | Path | Model | Runner | None = None, provider: Any = None,
        prompts: Sequence[str] | None = None, input_ids: Sequence[Sequence[int]] | None = None,
        max_new_tokens: int = 64, chat: bool = True, kv_layout: str | None = None,
        capacity: int | None = None, capture: bool | None = None, progress=None,
        weight_budget: int | float | str | None = None, device_budget: int | str | None = None) -> Result:
    """Run several prompts as one batch and decode greedily.

    Args:
        model: a builder model folder, a loaded Model, a Runner (weights already on the
            provider; ``provider`` is then ignored), or None for the default model
            (SmolLM2-135M-Instruct, prepared on first use; see :mod:`core.models.prepare`).
        provider: provider name or object (default "cpu_reference"; with a Runner, None or
            the runner's own provider).
        prompts: texts (one row each); or ``input_ids``: token-id lists. Exactly one is given.
        max_new_tokens: tokens to generate per row (>= 0).
        chat: apply the model's chat template to ``prompts`` (ignored for input_ids).
        kv_layout: "head_major" or "seq_major" (default: the Runner's, else "head_major").
        capacity: KV positions per row; default what the request needs, rounded up to 64,
            at most the model context.
        capture: graph capture for decode steps (None = when the provider supports it).
        progress: optional callable(done, total): (0, total) as the prefill starts, then
            (tokens per row so far, total) after the prefill and after each decode step.
        weight_budget: device bytes for the weights, staging included (bytes, a fraction of the
            weight bytes, or "2GiB" / "40%"); the rest stream every step (see
            :mod:`core.runtime.residency`). Default: everything resident when it fits.
        device_budget: device bytes for weights and KV together: KV growth takes from the
            weight budget (more weights stream) instead of running out of memory.

    Returns:
        :class:`Result` with one :class:`Row` per prompt.

    Raises:
        RequestError: bad request (no/both prompt kinds, empty prompt, negative
            max_new_tokens, prompt beyond the capacity); checked before any kernel runs.
        core.plugins.ProviderError, core.models.model.ModelError, core.executor.UnsupportedOpError.
    """
    if (prompts is None) == (input_ids is None):
        raise RequestError("pass exactly one of prompts= or input_ids=")
    if isinstance(prompts, str):
        prompts = [prompts]
    if prompts is not None:
        check_prompt_texts(prompts)
    elif isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence | np.ndarray):
        raise RequestError(f"input_ids must be a list of token-id lists, got {type(input_ids).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if model is None:
        from core.models.prepare import resolve_model

        model = resolve_model(None)
    runner = model if isinstance(model, Runner) else None
    if runner is not None and provider is not None and provider not in (runner.provider, runner.provider.name):
        raise RequestError(f"this Runner runs on provider {runner.provider.name!r}, not {provider!r}")
    provider = "cpu_reference" if provider is None else provider
    if isinstance(model, Runner):
        model = model.model
    elif not isinstance(model, Model):
        model = load_model(model)
    if prompts is not None:
        input_ids = encode_prompts(model, prompts, chat)
    assert input_ids is not None  # exactly one of prompts / input_ids (checked above)
    input_ids = [token_row(i, r).tolist() for i, r in enumerate(input_ids)]
    if not input_ids:
        raise RequestError("no prompts given")
    if capacity is None:
        need = max(len(r) for r in input_ids) + max(max_new_tokens - 1, 0)
        if need > model.config.context_length:
            raise RequestError(f"the request needs {need} KV positions; the model context is "
                               f"{model.config.context_length}")
        capacity = kvgeo.round_capacity(need, model.config.context_length)
    session = Session(runner or model, provider, batch=len(input_ids), capacity=capacity,
                      kv_layout=kv_layout or (runner.kv_layout if runner else "head_major"),
                      kv_policy="fixed", capture=capture, weight_budget=weight_budget,
                      device_budget=device_budget)
    results = generate(session, input_ids, max_new_tokens, progress)
    tok = model.tokenizer
    rows = [Row(list(p), out, tok.decode(out) if tok else "", reason)
            for p, (out, reason) in zip(input_ids, results)]
    return Result(rows, session.provider.name, session.counters.to_dict())

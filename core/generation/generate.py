"""The main job: batch-N generation, as ``core.run``, ``core.stream`` and ``lockstep run``.

Both drain a :class:`Stream`: the rows as engine requests
(:class:`~core.generation.engine_run.EngineStream`, one decode path), so a streamed request
and a plain one give the same rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import attrs
import numpy as np

from core.errors import RequestError
from core.generation.stream import Generation, RowState
from core.generation.tokens import token_row
from core.models.model import Model, load_model
from core.runtime import kv as kvgeo
from core.runtime.runner import Runner
from core.session import Session


@attrs.frozen
class Row:
    """One sequence of a result.

    Attributes:
        prompt_ids: the prompt's token ids.
        output_ids: generated token ids (EOS included when the row ended on it).
        text: ``output_ids`` decoded (special tokens skipped), cut before a stop string; ""
            without a tokenizer.
        finish_reason: "eos", "stop" (a stop string or stop token id), "length", "error" (the
            row's logits held NaN/inf; docs/cases.md 12), or "interrupted" (stopped by the
            caller between steps, e.g. Ctrl-C in ``lockstep run``; the tokens made are kept).
        stop: the stop string or stop token id that ended the row, else None.
        sampling: the row's sampling options as used (the seed drawn for it included).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    stop: str | int | None = None
    sampling: dict | None = None


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
        RequestError: see :func:`check_prompt_texts`, or the model has no tokenizer.
    """
    check_prompt_texts(prompts)
    if model.tokenizer is None:
        raise RequestError(f"model {model.folder} has no tokenizer.json; text prompts need one "
                           "(the Python API also takes input_ids=)")
    out = []
    for text in prompts:
        out.append(model.tokenizer.encode(model.tokenizer.apply_chat_template(text) if chat else text))
    return out


def check_messages(index: int, messages: Any) -> list[dict]:
    """One row's chat messages, validated: a list of ``{"role", "content"}`` dicts, roles
    "system" (first only), "user" or "assistant", contents non-empty str.

    Raises:
        RequestError: anything else (named by row and message).
    """
    if isinstance(messages, dict) or not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError(f"messages of row {index} must be a non-empty list of {{'role', 'content'}} dicts")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m or "content" not in m:
            raise RequestError(f"row {index} message {j} must be a dict with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ("system", "user", "assistant") or (m["role"] == "system" and j > 0):
            raise RequestError(f"row {index} message {j}: role must be 'user' or 'assistant' ('system' "
                               f"only first), got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise RequestError(f"row {index} message {j}: content must be a str")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(f"row {index} message {j} is not valid UTF-8 text") from None
    return [dict(m) for m in messages]


def encode_messages(model: Model, messages: Sequence[Any], system: str | None = None) -> list[list[int]]:
    """Token ids of each row's chat ``messages`` through the model's chat template, with a
    generation prompt. ``system`` (if given) is the system prompt of rows that have none.

    Raises:
        RequestError: malformed messages (:func:`check_messages`), or no tokenizer.
        core.models.model.ModelError: the model has no chat template.
    """
    if model.tokenizer is None:
        raise RequestError(f"model {model.folder} has no tokenizer.json; text prompts need one "
                           "(the Python API also takes input_ids=)")
    out = []
    for i, row in enumerate(messages):
        msgs = check_messages(i, row)
        if system is not None and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": system}] + msgs
        out.append(model.tokenizer.encode(model.tokenizer.render_chat(msgs)))
    return out


def generate(session: Session, input_ids: Sequence[Sequence[int]], max_new_tokens: Any,
             progress=None, sampling: Any = None, stop: Any = None,
             stop_token_ids: Any = None) -> list[tuple[list[int], str]]:
    """Decode ``input_ids`` on ``session``: per row (output_ids, finish_reason).

    A row ends at an EOS token (kept in its output), a stop token id or stop string ("stop"),
    after its ``max_new_tokens`` tokens, or when its logits are non-finite ("error"); finished
    rows keep stepping in lockstep but their tokens are discarded. Validates the whole request
    first (RequestError, nothing run). Options as :class:`~core.generation.stream.Generation`.
    """
    rows = Generation(session, input_ids, max_new_tokens, sampling, stop, stop_token_ids, progress).run()
    return [(r.output_ids, r.finish_reason or "length") for r in rows]


def _merge_sampling(sampling: Any, options: dict) -> Any:
    """Keyword sampling options (every row) under the per-row ``sampling`` entries."""
    from core.generation.sampling import OPTION_NAMES

    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise RequestError(f"unknown option {', '.join(map(repr, unknown))}; sampling options are "
                           f"{', '.join(OPTION_NAMES)}")
    if not options:
        return sampling
    if sampling is None:
        return dict(options)
    if isinstance(sampling, dict):
        return {**options, **sampling}
    if isinstance(sampling, (list, tuple)):
        return [{**options, **(row or {})} if isinstance(row, dict) or row is None else row for row in sampling]
    return sampling


def check_request(max_new_tokens: Any = 64, sampling: Any = None, stop: Any = None,
                  weight_budget: Any = None, device_budget: Any = None, tensor_parallel: Any = 1) -> None:
    """Check what a request can be checked for without the model: ``max_new_tokens`` (a
    non-negative int or a list of them), shared sampling options (a dict: every value in
    range; with ``tensor_parallel`` > 1, no sampling asked for), shared stop strings, and the
    form of the budgets (a device budget in bytes, never a fraction). :func:`start` and the CLI
    call it before any model is prepared or loaded.

    Raises:
        core.session.RequestError: any of those is bad.
    """
    from core.generation import sampling as sampling_mod
    from core.generation.stream import _max_new, _stop_strings
    from core.runtime.residency import BudgetError, parse_budget

    for m in max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens]:
        _max_new(m)
    if isinstance(sampling, dict):
        try:
            params = sampling_mod.make_params(sampling)
        except sampling_mod.SamplingError as exc:
            raise RequestError(str(exc)) from None
        # the options given ask for sampling (the model's defaults are checked with the model)
        if not params.greedy_plain and tensor_parallel != 1 and not isinstance(tensor_parallel, bool):
            from core.parallel.session import GREEDY_ONLY

            raise RequestError(GREEDY_ONLY)
    per_row = isinstance(stop, (list, tuple)) and any(x is None or isinstance(x, (list, tuple)) for x in stop)
    if not per_row:  # one set of stop strings for every row (per-row lists: checked with the batch)
        _stop_strings(stop)
    for name, value in (("weight_budget", weight_budget), ("device_budget", device_budget)):
        if value is not None:
            try:
                parse_budget(value, 1 << 40, fractions=name == "weight_budget")  # a device budget: sizes only
            except BudgetError as exc:
                raise RequestError(f"{name}: {exc}") from None


def start(model: str | Path | Model | Runner | None = None, provider: Any = None,
          prompts: Sequence[str] | None = None, input_ids: Sequence[Sequence[int]] | None = None,
          max_new_tokens: Any = 64, chat: bool = True, kv_layout: str | None = None,
          capacity: int | None = None, capture: bool | None = None, progress=None,
          weight_budget: int | float | str | None = None, device_budget: int | str | None = None,
          messages: Sequence[Any] | None = None, system: str | None = None, sampling: Any = None,
          stop: Any = None, stop_token_ids: Any = None, tensor_parallel: int = 1, **options) -> Stream:
    """Validate a request, make its session and return the (not yet started) :class:`Stream`.
    Arguments as :func:`run`."""
    given = [x is not None for x in (prompts, input_ids, messages)]
    if sum(given) != 1:
        raise RequestError("pass exactly one of prompts=, messages= or input_ids=")
    sampling = _merge_sampling(sampling, options)
    for option, flag in (("chat", chat), ("capture", capture)):
        if not isinstance(flag, bool) and not (option == "capture" and flag is None):  # "no" is truthy
            raise RequestError(f"{option} must be True or False, got {flag!r}")
    if progress is not None and not callable(progress):
        raise RequestError(f"progress must be a callable (done, total), got {type(progress).__name__}")
    if isinstance(prompts, str):
        prompts = [prompts]
    if prompts is not None:
        check_prompt_texts(prompts)  # before any model work
    elif input_ids is not None and (isinstance(input_ids, (str, bytes))
                                    or not isinstance(input_ids, Sequence | np.ndarray)):
        raise RequestError(f"input_ids must be a list of token-id lists, got {type(input_ids).__name__}")
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
        messages = [messages]  # one conversation: one row
    check_request(max_new_tokens, sampling, stop, weight_budget, device_budget)  # before any model work
    news = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens]
    if system is not None and not isinstance(system, str):
        raise RequestError(f"system must be a str, got {type(system).__name__}")
    if model is None or isinstance(model, (str, Path)):
        from core.models.prepare import default_variant, resolve_model

        name = provider if isinstance(provider, str) else getattr(provider, "name", None)
        model = resolve_model(model, *default_variant(name))
    runner = model if isinstance(model, Runner) else None
    if runner is not None and provider is not None and provider not in (runner.provider, runner.provider.name):
        raise RequestError(f"this Runner runs on provider {runner.provider.name!r}, not {provider!r}")
    provider = "cpu_reference" if provider is None else provider
    if isinstance(model, Runner):
        model = model.model
    elif not isinstance(model, Model):
        model = load_model(model)
    if messages is not None:
        input_ids = encode_messages(model, messages, system)
    elif prompts is not None:
        if system is not None:
            if not chat:
                raise RequestError("a system prompt (system=, --system) needs the chat template; it cannot be "
                                   "combined with chat=False (--raw)")
            input_ids = encode_messages(model, [[{"role": "user", "content": p}] for p in prompts], system)
        else:
            input_ids = encode_prompts(model, prompts, chat)
    assert input_ids is not None  # exactly one of the three (checked above)
    input_ids = [token_row(i, r).tolist() for i, r in enumerate(input_ids)]
    if not input_ids:
        raise RequestError("no prompts given")
    per_row = news if len(news) == len(input_ids) else [max(news)] * len(input_ids)  # a mismatch: refused below
    asked = capacity
    if capacity is None:
        need = max(len(r) + max(n - 1, 0) for r, n in zip(input_ids, per_row))  # each row its own (Generation._step)
        if need > model.config.context_length:
            raise RequestError(_too_long(input_ids, per_row, model.config.context_length))
        capacity = kvgeo.round_capacity(need, model.config.context_length)
    if tensor_parallel != 1 and not isinstance(tensor_parallel, bool):  # refuse sampling before ranks start
        from core.parallel.session import check_greedy

        check_greedy(sampling, len(input_ids), model)
    runner = _engine_runner(runner, model, provider, kv_layout, asked, weight_budget, device_budget,
                            tensor_parallel, input_ids, per_row, int(capacity))
    from core.generation.engine_run import EngineStream  # one decode path: the engine (docs/engine.md)

    return Stream(None, EngineStream(runner, input_ids, max_new_tokens, sampling, stop, stop_token_ids, progress,
                                     int(capacity), capture))


def _engine_runner(runner: Runner | None, model: Model, provider: Any, kv_layout: str | None, capacity: Any,
                   weight_budget: Any, device_budget: Any, tensor_parallel: Any, input_ids: Sequence[Sequence[int]],
                   news: Sequence[int], reserve_capacity: int | None = None) -> Any:
    """The step runner a request's engine drives (docs/engine.md, "One decode path"): the given
    Runner, or one made with the budgets (its weights stream through the engine's steps), or
    for ``tensor_parallel`` > 1 a :class:`~core.parallel.runner.TensorParallelRunner` (its rank
    processes, started only once the rows fit the capacity). A Runner made here reserves the
    engine's rows at ``reserve_capacity`` (``Runner(reserve_for=...)``: a MoE model's experts
    leave room for them under a device budget).

    Raises:
        RequestError: an option a Session refuses (:func:`~core.generation.engine_run.check_options`,
            its messages), or the Runner cannot be made (a KV layout or budget error).
    """
    from core.generation.engine_run import check_fit, check_options
    from core.runtime.residency import BudgetError

    check_options(runner, model, kv_layout, capacity, weight_budget, device_budget, tensor_parallel)
    if tensor_parallel > 1:
        if capacity is not None:
            check_fit(input_ids, news, int(capacity))
        from core.parallel.runner import TensorParallelRunner

        return TensorParallelRunner(model, provider, int(tensor_parallel), kv_layout or "head_major",
                                    weight_budget, device_budget)
    if runner is None:
        try:
            reserve = None if reserve_capacity is None else (len(input_ids), reserve_capacity)
            runner = Runner(model, provider, kv_layout or "head_major", weight_budget=weight_budget,
                            device_budget=device_budget, reserve_for=reserve)
        except (kvgeo.KVLayoutError, BudgetError) as exc:
            raise RequestError(str(exc)) from exc
    return runner


def _too_long(input_ids: Sequence[Sequence[int]], news: Sequence[int], context: int) -> str:
    """Why a request does not fit the model context, naming the row that needs the most KV
    positions, its prompt's token count and the largest max_new_tokens that fits."""
    b = max(range(len(input_ids)), key=lambda i: len(input_ids[i]) + max(news[i] - 1, 0))
    length, new = len(input_ids[b]), news[b]
    if length > context:
        return (f"prompt {b} has {length} tokens, more than the model context of {context} positions; "
                "shorten it")
    return (f"max_new_tokens={new} does not fit: prompt {b} has {length} tokens and the model context is "
            f"{context} positions, so max_new_tokens can be at most {context - length + 1}")


class Stream:
    """A started request: iterate it for :class:`~core.generation.stream.Delta` objects (per
    row and step: new token ids, new text, the finish reason), then call :meth:`result`.

    Attributes:
        session: the :class:`~core.session.Session` it runs on; None on the engine (every
            :func:`start`).
        generation: the :class:`~core.generation.engine_run.EngineStream` of its rows on the
            engine, or a :class:`~core.generation.stream.Generation` on a Session.
    """

    def __init__(self, session: Session | None, generation: Any):
        self.session, self.generation = session, generation

    def __iter__(self):
        return iter(self.generation)

    def interrupt(self) -> list:
        """End every running row now, between steps, keeping what it made (finish reason
        "interrupted"); returns the rows' last deltas. Close the iterator first."""
        return self.generation.interrupt()

    def close_ranks(self) -> None:
        """Stop the rank processes of a tensor-parallel request now (its
        :class:`~core.parallel.session.TensorParallelSession`, or the engine's
        :class:`~core.parallel.runner.TensorParallelRunner`), not when it is collected."""
        (self.session if self.session is not None else self.generation.runner).close()

    def result(self) -> Result:
        """Finish the request (if not iterated to the end) and return its :class:`Result`."""
        rows = [_row(r, sp) for r, sp in zip(self.generation.run(), self.generation.sampling)]
        owner = self.session if self.session is not None else self.generation
        return Result(rows, owner.runner.provider.name if self.session is None else self.session.provider.name,
                      owner.counters.to_dict())


def _row(r: RowState, sampling=None) -> Row:
    return Row(list(r.prompt_ids), list(r.output_ids), r.text, r.finish_reason or "length", r.stop,
               None if sampling is None else sampling.to_dict())


def stream(model: str | Path | Model | Runner | None = None, **kwargs) -> Stream:
    """Like :func:`run`, but returns a :class:`Stream`: iterating it yields
    :class:`~core.generation.stream.Delta` objects as the rows decode (text released per
    character once final, multi-byte characters whole), and ``.result()`` gives the Result.

        >>> for d in core.stream(model_dir, prompts=["Hi", "Name a color."], max_new_tokens=32):
        ...     print(d.row, d.text, end="")

    Raises:
        as :func:`run`, before any kernel runs.
    """
    return start(model, **kwargs)


def run(model: str | Path | Model | Runner | None = None, provider: Any = None,
        prompts: Sequence[str] | None = None, input_ids: Sequence[Sequence[int]] | None = None,
        max_new_tokens: Any = 64, chat: bool = True, kv_layout: str | None = None,
        capacity: int | None = None, capture: bool | None = None, progress=None,
        weight_budget: int | float | str | None = None, device_budget: int | str | None = None,
        messages: Sequence[Any] | None = None, system: str | None = None, sampling: Any = None,
        stop: Any = None, stop_token_ids: Any = None, tensor_parallel: int = 1, **options) -> Result:
    """Run several prompts as one batch: greedy by default, sampled per row on request.

    Each row is a request of the continuous-batching engine (:mod:`core.generation.engine_run`,
    docs/engine.md: one decode path), bitwise the fixed-batch Session's row, tensor parallel,
    weight and device budgets and any ``capacity`` a Session takes included.

    Args:
        model: a builder model folder, a loaded Model, a Runner (weights already on the
            provider; ``provider`` is then ignored), a model name, a Hugging Face folder or a
            .gguf file (prepared on first use for the provider: fp16/cuda for "cuda", else
            fp32/cpu; see :mod:`core.models.prepare`), or None for the default model
            (SmolLM2-135M-Instruct).
        provider: provider name or object (default "cpu_reference"; with a Runner, None or
            the runner's own provider).
        prompts: texts (one row each); ``messages``: per row a list of chat messages
            (``{"role": "system"|"user"|"assistant", "content": str}``; one list = one row);
            or ``input_ids``: token-id lists. Exactly one is given.
        max_new_tokens: tokens to generate per row (>= 0), one int or a list per row.
        chat: apply the model's chat template to ``prompts`` (ignored for input_ids).
        system: the system prompt for ``prompts`` / ``messages`` rows without one (instead of
            the template's default).
        kv_layout: "head_major" or "seq_major" (default: the Runner's, else "head_major").
        capacity: KV positions per row; default what the request needs (prompt plus
            ``max_new_tokens``), rounded up to 64, at most the model context.
        capture: graph capture for decode steps (None = when the provider supports it).
        progress: optional callable(done, total): (0, total) as the prefill starts, then (tokens
            per row so far, total) after the prefill and after each decode step.
        weight_budget: device bytes for the weights, staging included (bytes, a fraction of the
            weight bytes, or "2GiB" / "40%"); the rest stream every step (see
            :mod:`core.runtime.residency`). Default: everything resident when it fits.
        device_budget: device bytes for weights and KV together: KV growth takes from the
            weight budget (more weights stream) instead of running out of memory.
        sampling: per-row sampling options, a dict (every row) or a list of dicts (None
            entries: the defaults); see :mod:`core.generation.sampling`.
        stop: stop strings: a str or list (every row), or a list of lists (per row).
        stop_token_ids: token ids that end a row besides the model's EOS ids.
        tensor_parallel: shard the model over this many rank processes (greedy only, a model
            folder or Model, not a Runner; see :mod:`core.parallel.session` and
            docs/parallel.md). Default 1: unsharded, in this process.
        **options: sampling options for every row (``do_sample=True, temperature=0.7,
            top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, seed=0``); defaults
            from the model's genai_config.json "search" section.

    Returns:
        :class:`Result` with one :class:`Row` per prompt.

    Raises:
        RequestError: bad request (no/several prompt kinds, empty prompt, negative
            max_new_tokens, prompt beyond the capacity, an unknown option or a value out of
            range); checked before any kernel runs.
        core.plugins.ProviderError: the provider is unknown or cannot start.
        core.models.model.ModelError: the model folder cannot be decoded.
        core.executor.UnsupportedOpError: the provider cannot run some nodes (all are listed).
        core.models.prepare.PrepareError: an unknown model name or path, or a failed build.
    """
    st = start(model, provider, prompts, input_ids, max_new_tokens, chat, kv_layout, capacity, capture,
               progress, weight_budget, device_budget, messages, system, sampling, stop, stop_token_ids,
               tensor_parallel, **options)
    try:
        return st.result()
    finally:
        if tensor_parallel != 1:  # stop the rank processes now, not at collection
            st.close_ranks()

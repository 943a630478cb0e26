"""Prefill and the decode step, as functions of a decode state (and through it, its Runner).

:func:`decode_step` is the function a capture records: decode_advance, the graph with S = 1,
device_argmax (or device_sample), touching only persistent buffers. :func:`prefill` runs the prompts
right-padded (GroupQueryAttention "first prompt", docs/ops.md 1.4; one run, or pad-free length
groups, and only each row's last position's logits: :mod:`core.runtime.prompts`). Neither validates a
request: :class:`core.session.Session` does that before calling them.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from core.protocol import ARGMAX_ERROR, ARGMAX_TOKEN
from core.runtime import prompts


@attrs.frozen
class StepOutput:
    """What one prefill or decode step produced.

    Attributes:
        tokens: int64 ``[B]`` chosen token per row (-1 where the row's logits were non-finite).
        errors: bool ``[B]``, True where the row's logits held NaN or infinity (docs/cases.md 12).
    """

    tokens: np.ndarray
    errors: np.ndarray


def prefill(state, input_ids, all_logits: bool = False, grouping: str = "auto") -> None:
    """Run the prompts and choose each row's first token into ``state.result``.

    Args:
        state: a :class:`~core.runtime.state.DecodeState` of ``len(input_ids)`` rows.
        input_ids: one list of token ids per row (lengths may differ; already validated).
        all_logits: keep the logits of every prompt position (``state.logits`` [B, S, V]);
            by default only each row's last position is computed ([B, 1, V]) where the plan
            has a last-position program (core.runtime.prompts).
        grouping: pad-free length groups, "auto", "off" or "always"
            (:func:`core.runtime.prompts.plan_groups`).

    Raises:
        core.runtime.kv.KVFullError: the longest prompt does not fit the cache.
        core.runtime.residency.BudgetError: the device budget cannot hold the prompts' workspace.
        core.plugins.ProviderError: the provider returned a new present KV tensor instead of
            writing the shared past/present buffer in place.
    """
    p = state.runner.provider
    lens = np.array([len(r) for r in input_ids], np.int64)
    state.begin_request()
    state.reserve(int(lens.max()))  # room for the longest prompt in every row
    state.reserve_prefill(len(lens), int(lens.max()), all_logits)  # and its workspace, before any work
    state.logits, positions = prompts.run_prompts(state, input_ids, all_logits, grouping)
    select(state, positions, p.upload(lens.astype(np.int32)), None)
    state.set_lengths(lens)
    state.bind_persistent()
    state.started = True


def decode_step(state) -> None:
    """The device work of one decode step; the function a capture records.

    Feeds the argmax result back (decode_advance: input_ids, mask, lengths_dev), runs the graph
    with S = 1 against the full mask and selects the next tokens into ``state.result``.
    """
    p = state.runner.provider
    p.decode_advance(state.result, state.input_ids, state.attention_mask, state.lengths_dev)
    outs = state.binding.run()
    state.logits = outs["logits"]
    select(state, state.positions, state.lengths_dev, state.input_ids)


def select(state, positions, counter, fed) -> None:
    """Choose each row's next token from ``state.logits`` into ``state.result``:
    ``device_argmax``, or ``device_sample`` while the request samples (``state.sampling``;
    ``counter`` and ``fed`` as :meth:`core.protocol.ExecutionProvider.device_sample` takes them)."""
    p = state.runner.provider
    if state.sampling is None:
        p.device_argmax(state.logits, positions, state.result)
    else:
        p.device_sample(state.logits, positions, counter, fed, state.sampling, state.result)


def start_read(state) -> Any:
    """Start downloading the ``[B, 2]`` result as the queued work leaves it: the provider's
    ``download_async`` handle (``wait() -> int32 [B, 2]``; by default a finished one from a
    synchronous download, :class:`core.provider.ReadyDownload`)."""
    return state.runner.provider.download_async(state.result)


def step_output(res: np.ndarray) -> StepOutput:
    """A :class:`StepOutput` from a downloaded int32 ``[B, 2]`` result (token, error flag)."""
    return StepOutput(res[:, ARGMAX_TOKEN].astype(np.int64), res[:, ARGMAX_ERROR] != 0)


def force_tokens(state, tokens: np.ndarray) -> None:
    """Teacher forcing: make the next decode step feed ``tokens`` int64 ``[B]`` (validated)."""
    res = np.zeros((state.batch, 2), np.int32)
    res[:, ARGMAX_TOKEN] = tokens
    state.runner.provider.write(state.result, res)

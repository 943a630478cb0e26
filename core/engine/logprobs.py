"""Log-probabilities of the chosen token, from a step's logits (the server's ``logprobs``).

``logprob(t) = x_t - logsumexp(x)`` over the vocabulary of one row's logits ``x`` (the
log-softmax), computed in fp32 on the host whatever the model's dtype: ``m = max(x)``,
``logsumexp(x) = m + log(sum(exp(x - m)))`` (the shift keeps ``exp`` finite). These are the
model's raw distribution, before temperature, top-k or top-p (as vLLM reports them by default).
"""

from __future__ import annotations

import attrs
import numpy as np


@attrs.frozen
class Logprob:
    """The chosen token's log-probability and the most likely token's.

    Attributes:
        token: the chosen token id.
        logprob: its log-probability (natural log, <= 0).
        top_token: the most likely token id (equal to ``token`` for a greedy row).
        top_logprob: its log-probability.
    """

    token: int
    logprob: float
    top_token: int
    top_logprob: float


def chosen(logits: np.ndarray, token: int) -> Logprob:
    """The :class:`Logprob` of ``token`` from one row's logits (any shape holding ``V`` values,
    e.g. ``[1, V]``; any float dtype, cast to fp32).

    Raises:
        ValueError: ``token`` outside ``[0, V)``.
    """
    x = np.asarray(logits).reshape(-1).astype(np.float32)
    if not 0 <= token < x.size:
        raise ValueError(f"token {token} is outside the vocabulary [0, {x.size})")
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum(dtype=np.float32), dtype=np.float32)
    top = int(np.argmax(x))
    return Logprob(int(token), float(x[token] - lse), top, float(x[top] - lse))

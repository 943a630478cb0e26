"""Routing and expert evaluation shared by MoE and QMoE (no OP_TYPE: not an op; docs/moe.md).

Routing of token t over E experts, in fp32 (fp16 router logits are widened first):
    p = softmax(router[t]) over all E experts (max subtracted, exp, sum in expert order, divide);
    the k selected experts are the k largest p, a tie going to the larger expert index (ORT's
    ``std::partial_sort`` of (p, index) pairs with ``std::greater``), listed by descending p;
    their weights are those p, or p / (sum of the k p, in rank order) with
    ``normalize_routing_weights=1``.
Expert e on a token row x (fp32): h = x W1[e]^T + b1[e]; a = act(h); y = a W2[e]^T + b2[e];
the output row is sum_j w_j y_j, accumulated in rank order j = 0..k-1 from w_0 y_0, in fp32,
and rounded to the input dtype once. Each routed (token, expert) product is a vector-matrix
product of its own (ops.rowwise_matmul), so a row's result never depends on which other rows
chose the same expert (batch invariance).

Activations (fp32): relu, silu, identity, gelu (tanh approximation, ORT's MoE CPU), and SwiGLU:
    G = min(g, limit), L = clamp(l, -limit, limit) (no clamp without ``swiglu_limit``),
    a = G sigmoid(alpha G) (L + beta),
with (g, l) interleaved along h ([g0, l0, g1, l1, ...], ``swiglu_fusion=1``), concatenated
([g | l], fusion 2), or g from FC1 and l from FC3 (fusion 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import attrs
import numpy as np

from providers.cpu_reference.ops import rowwise_matmul
from providers.cpu_reference.ops._gelu import gelu_tanh


@attrs.frozen
class Routing:
    """Top-k routing of T tokens.

    Attributes:
        experts: int64 [T, k], the selected experts of each token by descending weight.
        weights: fp32 [T, k], their mixing weights.
    """

    experts: np.ndarray
    weights: np.ndarray


def route(router: np.ndarray, k: int, normalize: bool) -> Routing:
    """The top-``k`` routing of router logits ``[T, E]`` (module docstring).

    Raises:
        ValueError: ``k`` outside 1..E.
    """
    logits = np.asarray(router, dtype=np.float32)
    t, e = logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"MoE: k={k} outside 1..{e} (the number of experts)")
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    total = shifted[:, 0].copy()
    for j in range(1, e):  # expert order, one rounding per addition (ORT's loop)
        total += shifted[:, j]
    probs = shifted / total[:, None]
    index = np.broadcast_to(np.arange(e), (t, e))
    order = np.lexsort((-index, -probs), axis=1)[:, :k]  # descending p, then descending index
    weights = np.take_along_axis(probs, order, axis=1)
    if normalize:
        top = weights[:, 0].copy()
        for j in range(1, k):
            top += weights[:, j]
        weights = weights / top[:, None]
    return Routing(order.astype(np.int64), weights.astype(np.float32))


@attrs.frozen
class Activation:
    """The expert activation of a MoE node (module docstring).

    Attributes:
        kind: relu, gelu, silu, identity or swiglu.
        fusion: swiglu_fusion (0: FC3 holds l; 1: interleaved; 2: concatenated).
        alpha, beta: SwiGLU's activation_alpha / activation_beta.
        limit: swiglu_limit, or None (no clamp).
    """

    kind: str
    fusion: int
    alpha: float
    beta: float
    limit: float | None

    @classmethod
    def of(cls, node_attrs: dict) -> Activation:
        """The activation described by a MoE / QMoE node's attributes (ONNX defaults)."""
        limit = node_attrs.get("swiglu_limit")
        return cls(str(node_attrs.get("activation_type", "relu")), int(node_attrs.get("swiglu_fusion", 0)),
                   float(node_attrs.get("activation_alpha", 1.0)), float(node_attrs.get("activation_beta", 0.0)),
                   None if limit is None else float(limit))

    def __call__(self, h: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
        """The activation of FC1 output ``h`` [R, F*I] (fp32; ``up``: FC3's output for
        SwiGLU fusion 0) as fp32 [R, I]."""
        if self.kind == "relu":
            return np.maximum(h, np.float32(0))
        if self.kind == "silu":
            with np.errstate(over="ignore"):
                return (h / (np.float32(1) + np.exp(-h))).astype(np.float32)
        if self.kind == "gelu":
            return gelu_tanh(h)
        if self.kind == "identity":
            return h
        if self.fusion == 1:
            g, lin = h[:, 0::2], h[:, 1::2]
        elif self.fusion == 2:
            g, lin = np.split(h, 2, axis=1)
        elif up is not None:
            g, lin = h, up
        else:
            raise ValueError("MoE SwiGLU with fusion 0 needs FC3's output (up)")
        if self.limit is not None:
            lim = np.float32(self.limit)
            g = np.minimum(g, lim)
            lin = np.clip(lin, -lim, lim)
        with np.errstate(over="ignore"):
            gate = g / (np.float32(1) + np.exp(np.float32(-self.alpha) * g))
        return (gate * (lin + np.float32(self.beta))).astype(np.float32)


@attrs.frozen
class Experts:
    """Expert weights in fp32, transposed for ``x @ w``.

    Attributes:
        fc1: [E, H, F*I]; fc2: [E, I, H]; fc3: [E, H, I] or None.
        b1: [E, F*I] or None; b2: [E, H] or None; b3: [E, I] or None.
    """

    fc1: np.ndarray
    fc2: np.ndarray
    fc3: np.ndarray | None = None
    b1: np.ndarray | None = None
    b2: np.ndarray | None = None
    b3: np.ndarray | None = None

    def expert(self, e: int) -> Expert:
        """Expert ``e``'s arrays (views of these)."""
        parts = (self.fc3, self.b1, self.b2, self.b3)
        return Expert(self.fc1[e], self.fc2[e], *(None if a is None else a[e] for a in parts))


@attrs.frozen
class Expert:
    """One expert's fp32 arrays: fc1 [H, F*I], fc2 [I, H], fc3 [H, I] or None, biases or None."""

    fc1: np.ndarray
    fc2: np.ndarray
    fc3: np.ndarray | None = None
    b1: np.ndarray | None = None
    b2: np.ndarray | None = None
    b3: np.ndarray | None = None


class Pager(Protocol):
    """Where a MoE kernel reads its experts from under expert residency (expert_pager)."""

    def waves(self, node: str, experts: Experts, routing: Routing) -> Iterator[list[tuple[int, Expert]]]:
        """The routed experts of ``routing`` in ascending index order, in waves of (index, arrays)."""
        ...


def _project(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    y = rowwise_matmul(x, w)
    return y if bias is None else y + bias


def mix(x: np.ndarray, routing: Routing, experts: Experts, act: Activation, pager: Pager | None = None,
        node: str = "") -> np.ndarray:
    """The MoE output fp32 [T, H] of token rows ``x`` fp32 [T, H] (module docstring); with a
    ``pager``, the experts of MoE node ``node`` are read where it puts them (the same values)."""
    t, k = routing.experts.shape
    ys = np.zeros((t, k, experts.fc2.shape[2]), np.float32)
    if pager is None:
        waves: Iterable[list[tuple[int, Expert]]] = [[(int(e), experts.expert(int(e)))
                                                      for e in np.unique(routing.experts)]]
    else:
        waves = pager.waves(node, experts, routing)
    for wave in waves:
        for e, w in wave:
            rows, slots = np.nonzero(routing.experts == e)
            xe = x[rows]
            h = _project(xe, w.fc1, w.b1)
            up = None if w.fc3 is None else _project(xe, w.fc3, w.b3)
            ys[rows, slots] = _project(act(h, up), w.fc2, w.b2)
    weights = routing.weights
    out = weights[:, 0, None] * ys[:, 0]
    for j in range(1, k):  # rank order (module docstring)
        out += weights[:, j, None] * ys[:, j]
    return out


def expert_bias(b, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """An optional bias input as fp32 ``shape``, or None.

    Raises:
        ValueError: the bias has another shape.
    """
    if b is None:
        return None
    b = np.asarray(b)
    if b.shape != shape:
        raise ValueError(f"MoE: {name} has shape {b.shape}, expected {shape}")
    return b.astype(np.float32)


def token_rows(x, router, num_experts: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``x`` [..., H] as fp32 rows [T, H] and ``router`` as fp32 [T, E].

    Raises:
        ValueError: the router is not [T, E] for the T token rows of ``x``.
    """
    x = np.asarray(x)
    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    router = np.asarray(router)
    if router.ndim != 2 or router.shape[0] != rows.shape[0]:
        raise ValueError(f"MoE: router_probs has shape {router.shape}, expected ({rows.shape[0]}, num_experts)")
    if num_experts is not None and router.shape[1] != num_experts:
        raise ValueError(f"MoE: router_probs has {router.shape[1]} experts, the weights {num_experts}")
    return rows, router.astype(np.float32)

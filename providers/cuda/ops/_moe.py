"""Launcher of kernels/moe.cu, shared by MoE and QMoE (no OP_TYPE: a helper; docs/moe.md).

One node call is four launches on the provider stream, with shapes fixed by the token rows T,
k, the hidden size H and the inter size I (never by the routing, so the step captures):
``moe_route`` (grid over T) writes experts int32 [T, k] and weights fp32 [T, k] to scratch;
``moe_up`` (grid T*k x I/4) the activated fp32 [T*k, I]; ``moe_down`` (grid T*k x H/4) the
fp32 expert outputs [T*k, H]; ``moe_mix`` the output [T, H] in the input dtype, mixed in rank
order. The semantics are the oracle's (providers/cpu_reference/ops/_moe.py); the sums are
per (row, slot) with a fixed order, so a row's bits do not depend on the batch.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from core.opdefs import moe_unsupported
from providers.cuda.module import ctype, function
from providers.cuda.ops import MAX_GRID_Y, NULL, grid_threads, is_host

WEIGHT_BITS = (0, 2, 4, 8)
EXPRS = tuple([f"moe_route<{t}>" for t in ("__half", "float")] + [f"moe_mix<{t}>" for t in ("__half", "float")]
              + [f"moe_{kind}<{t}, {b}>" for kind in ("up", "down") for t in ("__half", "float")
                 for b in WEIGHT_BITS])
#: activation_type -> the kernel's act code.
ACTIVATIONS = {"relu": 0, "gelu": 1, "silu": 2, "identity": 3, "swiglu": 4}
_WARPS = 4


@attrs.frozen
class Projection:
    """One expert projection [E, N, K] on the device.

    Attributes:
        w: dense weights in the io dtype [E, N, K], or uint8 codes [E, N, K*bits/8].
        bits: 0 (dense), 2, 4 or 8.
        scales: [E, N, K/block] in the io dtype (quantized), else None.
        zero_points: uint8 [E, N, ceil(K/block*bits/8)] or None (2^(bits-1)).
        bias: [E, N] in the io dtype, or None.
    """

    w: Any
    bits: int = 0
    scales: Any = None
    zero_points: Any = None
    bias: Any = None

    def rows(self, k: int | None = None) -> tuple[int, int]:
        """(E, N) of the weights; the inner size is checked against ``k`` when given.

        Raises:
            ValueError: the weights are not 3-D, or hold another inner size.
        """
        if self.w.ndim != 3:
            raise ValueError(f"MoE (cuda): expert weights {self.w.dtype}{self.w.shape}, expected 3-D [E, N, K]")
        if k is not None and self.inner() != k:
            raise ValueError(f"MoE (cuda): expert weights {self.w.shape} hold {self.inner()} inputs, expected {k}")
        return int(self.w.shape[0]), int(self.w.shape[1])

    def inner(self) -> int:
        """K, the inputs of each row."""
        return int(self.w.shape[2]) * (8 // self.bits if self.bits else 1)


def support_reason(node, floats: tuple[int, ...] | None = None) -> str | None:
    """Why the cuda MoE kernels do not run ``node``, or None: core.opdefs.moe_unsupported and
    the declared dtypes of inputs ``floats`` (None: every input), which must be one of fp16, fp32."""
    reasons = moe_unsupported(node)
    dts = list(node.input_dtypes)
    picked = dts if floats is None else [dts[i] for i in floats if i < len(dts)]
    kinds = {np.dtype(d) for d in picked if d is not None}
    if len(kinds) > 1 or not kinds <= {np.dtype(np.float16), np.dtype(np.float32)}:
        reasons.append(f"input dtypes {sorted(d.name for d in kinds)} (one of float16, float32)")
    return "; ".join(reasons) or None


def _check(p: Projection, name: str, dtype, e: int, n: int, k: int, block: int) -> None:
    """Raises ValueError where ``p`` does not hold [e, n, k] weights of ``dtype`` (module docstring)."""
    if any(is_host(a) for a in (p.w, p.scales, p.zero_points, p.bias) if a is not None):
        raise ValueError(f"MoE (cuda): {name} must be device arrays")
    if p.rows(k) != (e, n):
        raise ValueError(f"MoE (cuda): {name} has shape {p.w.shape}, expected ({e}, {n}, ...)")
    if p.bits == 0 and p.w.dtype != dtype:
        raise ValueError(f"MoE (cuda): {name} is {p.w.dtype}, the input {dtype}")
    if p.bits:
        if p.w.dtype != np.uint8 or not block or k % block:
            raise ValueError(f"MoE (cuda): {name} {p.w.dtype}{p.w.shape} needs uint8 codes and a block_size "
                             f"dividing K={k}, got block_size={block}")
        if p.scales is None or p.scales.dtype != dtype or p.scales.size != e * n * (k // block):
            raise ValueError(f"MoE (cuda): {name} scales must be {dtype} ({e}, {n}, {k // block})")
        if p.zero_points is not None and (p.zero_points.dtype != np.uint8
                                          or p.zero_points.size != e * n * -(-(k // block) * p.bits // 8)):
            raise ValueError(f"MoE (cuda): {name} zero points must be packed uint8 ({e}, {n}, ...)")
    if p.bias is not None and (p.bias.dtype != dtype or p.bias.size != e * n):
        raise ValueError(f"MoE (cuda): {name} bias must be {dtype} ({e}, {n})")


def _args(p: Projection) -> tuple:
    return (p.w, NULL if p.scales is None else p.scales, NULL if p.zero_points is None else p.zero_points,
            NULL if p.bias is None else p.bias)


def run(ctx, x, router, fc1: Projection, fc2: Projection, fc3: Projection | None, block: int = 0) -> tuple:
    """The MoE output of token rows ``x`` [..., H] (fp16/fp32, device) routed by ``router``
    [T, E] (io dtype), in output buffer 0 with x's shape and dtype; ``block``: QMoE's block_size.

    Raises:
        ValueError: host inputs, shapes or dtypes that do not fit (named), k outside 1..E, a
            SwiGLU whose fc1 / fc3 do not fit the inter size, fc1 and fc3 of other bit widths.
    """
    node_attrs = ctx.node.attrs
    dtype = np.dtype(x.dtype)
    if is_host(x) or is_host(router) or dtype not in (np.float16, np.float32):
        raise ValueError(f"MoE (cuda): needs fp16/fp32 device input and router, got {x.dtype}")
    hidden = int(x.shape[-1])
    rows = x.size // hidden if hidden else 0
    e, n1 = fc1.rows(hidden)
    inter = fc2.inner()
    k = int(node_attrs.get("k", 1))
    act_name = str(node_attrs.get("activation_type", "relu"))
    fusion = int(node_attrs.get("swiglu_fusion", 0))
    fused = act_name == "swiglu" and fusion in (1, 2)
    if router.shape != (rows, e) or router.dtype != dtype:
        raise ValueError(f"MoE (cuda): router_probs {router.dtype}{router.shape}, expected {dtype}({rows}, {e})")
    if not 1 <= k <= e:
        raise ValueError(f"MoE: k={k} outside 1..{e} (the number of experts)")
    if n1 != (2 * inter if fused else inter):
        raise ValueError(f"MoE (cuda): fc1 has {n1} outputs for an inter size of {inter} ({act_name})")
    _check(fc1, "fc1_experts_weights", dtype, e, n1, hidden, block)
    _check(fc2, "fc2_experts_weights", dtype, e, hidden, inter, block)
    if act_name == "swiglu" and not fused:
        if fc3 is None or fc3.bits != fc1.bits:
            raise ValueError("MoE (cuda): swiglu_fusion=0 needs fc3 weights of fc1's bit width")
        _check(fc3, "fc3_experts_weights", dtype, e, inter, hidden, block)
    if -(-max(inter, hidden) // _WARPS) > MAX_GRID_Y:
        raise ValueError(f"MoE (cuda): sizes H={hidden}, I={inter} past the kernel's grid")
    out = ctx.output(0, x.shape, dtype)
    experts = ctx.output("moe_experts", (rows, k), np.int32)
    weights = ctx.output("moe_weights", (rows, k), np.float32)
    a = ctx.output("moe_act", (rows * k, inter), np.float32)
    y = ctx.output("moe_y", (rows * k, hidden), np.float32)
    if rows == 0:
        return (out,)
    t = ctype(dtype)
    function("moe", f"moe_route<{t}>", EXPRS)(
        (-(-rows // 128),), (128,),
        (router, experts, weights, np.int64(rows), np.int32(e), np.int32(k),
         np.int32(bool(node_attrs.get("normalize_routing_weights", 0)))))
    lin = fc3 if fc3 is not None and act_name == "swiglu" and not fused else fc1
    steps = (2, 0, 2, 1) if fusion == 1 else (1, 0, 1, inter) if fusion == 2 else (1, 0, 1, 0)
    limit = node_attrs.get("swiglu_limit")
    tail = (*(np.int32(s) for s in steps), np.int32(block), np.int32(ACTIVATIONS[act_name]),
            np.float32(node_attrs.get("activation_alpha", 1.0)), np.float32(node_attrs.get("activation_beta", 0.0)),
            np.float32(0.0 if limit is None else limit), np.int32(limit is not None))
    pager = ctx.cache.get("expert_pager")  # experts read as pages (providers/cuda/expert_pager.py)
    if pager is not None:
        pager.launch(ctx, t, (fc1.bits, fc2.bits), x, experts, a, y, (rows, k, hidden, inter),
                     (n1, 0 if lin is fc1 else 8, lin.rows()[1]), block, tail)
    else:
        function("moe", f"moe_up<{t}, {fc1.bits}>", EXPRS)(
            (rows * k, -(-inter // _WARPS)), (32 * _WARPS,),
            (x, experts, np.int64(k), np.int64(hidden), np.int64(inter), *_args(fc1), np.int64(n1),
             *_args(lin), np.int64(lin.rows()[1]), *tail, a))
        function("moe", f"moe_down<{t}, {fc2.bits}>", EXPRS)(
            (rows * k, -(-hidden // _WARPS)), (32 * _WARPS,),
            (a, experts, np.int64(hidden), np.int64(inter), *_args(fc2), np.int32(block), y))
    function("moe", f"moe_mix<{t}>", EXPRS)(
        grid_threads(rows * hidden, 256, 4096), (256,),
        (y, weights, out, np.int64(rows), np.int64(hidden), np.int32(k)))
    return (out,)

"""GroupQueryAttention (com.microsoft v1): causal GQA with a KV cache, exactly docs/ops.md 1.3 / 1.4.

Inputs: query [B, S, Nq*H], or packed QKV [B, S, (Nq + 2*Nkv)*H] when key/value are absent;
key, value [B, S, Nkv*H]; past_key, past_value: the KV buffer, [B, Nkv, P_buf, H] when
ctx.kv_layout is "head_major" (the ONNX layout) or [B, P_buf, Nkv, H] when "seq_major";
seqlens_k int [B] (tokens in row b's cache after this step, minus 1); total_sequence_length
int scalar / 1-element; cos_cache, sin_cache [max_pos, rotary_dim/2]; position_ids int64 [B, S];
attention_bias [B|1, Nq|1, S, total]; head_sink [Nq]; q_norm_weight, k_norm_weight [H] (inputs
14, 15, given together: the fused per-head q/k RMSNorm, docs/ops.md 1.3.0). Inputs 12, 13 and 16
(quantized KV, query_seqlens) are rejected by ``supports``, as are qk_output and causal=0.
Outputs: output [B, S, Nq*H]; present_key, present_value.

Per row b: T_b = seqlens_k[b] + 1; with q/k norm weights, every head vector of Q and of the new
K is first RMS-normalised over its H values (fp32, the bits of SimplifiedLayerNormalization over
the head axis) and rounded to T; P_b = 0 for the first prompt (S == total), else T_b - S
(decode: S == 1; subsequent prompt: 1 < S != total, only at B == 1). RoPE (do_rotary) on Q and
K at positions base + s (first prompt; base = position_ids[0] or 0) or position_ids[b, s] /
P_b + s. New K/V rows go to cache rows [P_b, P_b + S). For query row s (p = P_b + s) and key
j < T_b: z = scale * q.k, softcap, + attention_bias, allowed iff j <= p and (W > 0 ->
j > p - W); softmax over the allowed keys (with head_sink / smooth_softmax: the sink
exp(sigma - m) joins the denominator); out = sum_j p_j v_j. Only rows j < T_b of a row's cache
are ever read, so the other rows (capacity, padding, NaN) never matter; each (row, kv head) is
computed alone with a fixed reduction order (ops.rowwise_matmul). A query row with no allowed
key (a padding row under a window) outputs zeros.

sliding_window_cache=1 (a ring KV cache, docs/kv-geometry.md; needs local_window_size W > 0 and
a past, no attention_bias): position p of row b lives at slot p mod P_buf of the past buffer,
which is the present (always in place). Query p reads keys max(0, p - W + 1) .. min(p, T_b - 1)
in position order (those before P_b from the ring, the others from this call's new K/V), so
a prompt longer than the ring needs no staging; then the last min(T_b - P_b, P_buf) new rows
are written to their slots (pad rows are not written: they would overwrite live slots). A row
that wraps (T_b > P_buf) needs P_buf >= W.

KV buffer sharing: when past is given and holds at least total_sequence_length rows, present
has the same shape as past (present length = max(total, P_buf), docs/ops.md 1.1), which is when
ORT may run in place: the new rows are written into past itself and the same arrays are
returned as present (GenAI share-buffer mode). Otherwise present is the node's output buffer
(ctx.output), zero-filled, of max(total, P_buf) rows with rows [0, P_b) copied from past
(docs/ops.md 1.3 step 2). The output is written into the node's output buffer 0.

dtypes: T = fp32 or fp16. Q and K are rotated in fp32 and rounded to T (the cache holds T);
scores, softmax and P.V are fp32; the output is rounded to T.
Source: ORT contrib_ops/cpu/bert/group_query_attention.cc, gqa_attention_base.h,
group_query_attention_helper.h.
"""

import math

import numpy as np

from core.opdefs import gqa_unsupported
from providers.cpu_reference.ops import rowwise_matmul
from providers.cpu_reference.ops._out import buffer, write
from providers.cpu_reference.ops._rotary import cache_rows, rotate
from providers.cpu_reference.ops._util import int_list, int_scalar

OP_TYPE = "GroupQueryAttention"
DOMAIN = "com.microsoft"


def supports(node) -> bool:
    return not gqa_unsupported(node, qk_norm=True, ring=True)


def support_reason(node) -> str | None:
    return "; ".join(gqa_unsupported(node, qk_norm=True, ring=True)) or None


def qk_norm(x: np.ndarray, weight, eps: float) -> np.ndarray:
    """The fused q/k RMSNorm of GroupQueryAttention (docs/ops.md 1.3.0) on head vectors.

    Args:
        x: [..., H] of T (fp32 or fp16), one head vector per last-axis row.
        weight: [H], any float dtype (read as fp32).
        eps: the epsilon (``qk_norm_epsilon`` or its per-side override), added to the mean square.

    Returns:
        [..., H] of T: ``(x / sqrt(mean(x^2) + eps)) * weight`` computed in fp32 and rounded to
        T, exactly as SimplifiedLayerNormalization (epsilon=eps, stash_type=1) over the last axis
        followed by a cast to T: the Reshape -> SimplifiedLayerNormalization -> Reshape chain that
        ORT fuses into these inputs gives the same bits.

    Raises:
        ValueError: ``weight`` is not [H].
    """
    w = np.asarray(weight, dtype=np.float32)
    if w.shape != (x.shape[-1],):
        raise ValueError(f"GroupQueryAttention: q/k norm weight shape {w.shape}, expected ({x.shape[-1]},)")
    v = np.ascontiguousarray(x, dtype=np.float32)
    inv = (np.float32(1.0) / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + np.float32(eps))).astype(np.float32)
    return ((v * inv) * w).astype(x.dtype)


def _rows(buf, layout: str, b: int, g: int) -> np.ndarray:
    """View [P_buf, H] of kv head g of row b in a KV buffer of the given layout."""
    return buf[b, g] if layout == "head_major" else buf[b, :, g]


def _capacity(buf, layout: str) -> int:
    return buf.shape[2] if layout == "head_major" else buf.shape[1]


def _attend(qg, keys, vals, allowed, bias, scale: float, softcap: float, sink):
    """Attention of queries ``qg`` [G, S, H] over ``keys`` / ``vals`` [T, H] with ``allowed``
    [S, T], ``bias`` [G, S, T] or None, ``sink`` [G, 1, 1] or None; returns fp32 [G, S, H]."""
    z = rowwise_matmul(qg, np.ascontiguousarray(keys.T)) * np.float32(scale)  # [G, S, T]
    if softcap > 0:
        z = np.float32(softcap) * np.tanh(z / np.float32(softcap))
    if bias is not None:
        z = z + bias.astype(np.float32)
    z = np.where(allowed[None], z, -np.inf).astype(np.float32)
    m = np.max(z, axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, np.float32(0.0))
    e = np.where(allowed[None], np.exp(z - m), np.float32(0.0))
    denom = np.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + np.exp(sink - m)
    probs = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)
    return rowwise_matmul(probs, vals)


def run(ctx, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
        total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None,
        attention_bias=None, head_sink=None, k_scale=None, v_scale=None, q_norm_weight=None,
        k_norm_weight=None, query_seqlens=None):
    attrs = ctx.node.attrs
    layout = ctx.kv_layout
    if k_scale is not None or v_scale is not None or query_seqlens is not None:
        raise ValueError("GroupQueryAttention: inputs k_scale, v_scale (quantized KV) and query_seqlens "
                         "are not supported")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("GroupQueryAttention: q_norm_weight and k_norm_weight must be given together")
    nq, nkv = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    if nq % nkv:
        raise ValueError(f"GroupQueryAttention: num_heads {nq} not a multiple of kv_num_heads {nkv}")
    dtype = query.dtype
    bsz, s_len = query.shape[:2]
    if key is None:
        h = query.shape[2] // (nq + 2 * nkv)
        q = query[..., :nq * h]
        k = query[..., nq * h:(nq + nkv) * h]
        v = query[..., (nq + nkv) * h:]
    else:
        h = query.shape[2] // nq
        q, k, v = query, key, value
        if k.shape[:2] != (bsz, s_len) or k.shape[2] != nkv * h or v.shape != k.shape:
            raise ValueError(f"GroupQueryAttention: key/value shapes {k.shape}/{v.shape}")
    q = q.reshape(bsz, s_len, nq, h)
    k = k.reshape(bsz, s_len, nkv, h)
    v = v.reshape(bsz, s_len, nkv, h)

    total = int_scalar(total_sequence_length)
    seqlens = int_list(seqlens_k)
    if len(seqlens) != bsz or min(seqlens) < 0:
        raise ValueError(f"GroupQueryAttention: seqlens_k {seqlens} for batch {bsz}")
    subsequent = s_len > 1 and s_len != total
    if subsequent and bsz != 1:
        raise ValueError("GroupQueryAttention: a subsequent prompt (1 < S != total) needs B == 1")
    first = not subsequent and s_len == total
    totals = [n + 1 for n in seqlens]
    pasts = [0 if first else t - s_len for t in totals]
    if min(pasts) < 0:
        raise ValueError(f"GroupQueryAttention: seqlens_k {seqlens} smaller than S {s_len}")

    # 0. The fused q/k RMSNorm, per head vector, rounded to T before RoPE (docs/ops.md 1.3.0).
    if q_norm_weight is not None:
        eps = float(attrs.get("qk_norm_epsilon", 1e-6))
        q = qk_norm(q, q_norm_weight, float(attrs.get("q_norm_epsilon", eps)))
        k = qk_norm(k, k_norm_weight, float(attrs.get("k_norm_epsilon", eps)))

    # 1. RoPE on Q and K (fp32, rounded to T as ORT stores them).
    if attrs.get("do_rotary", 0):
        if cos_cache is None or sin_cache is None:
            raise ValueError("GroupQueryAttention: do_rotary=1 needs cos_cache and sin_cache")
        if first:
            base = int(np.asarray(position_ids).reshape(-1)[0]) if position_ids is not None else 0
            pos = np.broadcast_to(base + np.arange(s_len), (bsz, s_len))
        elif position_ids is not None:
            pos = np.asarray(position_ids, dtype=np.int64)[:, :s_len]
        else:
            pos = np.array(pasts)[:, None] + np.arange(s_len)[None, :]
        cos, sin = cache_rows(cos_cache, pos), cache_rows(sin_cache, pos)
        interleaved = bool(attrs.get("rotary_interleaved", 0))
        q = rotate(q.astype(np.float32), cos, sin, interleaved).astype(dtype)
        k = rotate(k.astype(np.float32), cos, sin, interleaved).astype(dtype)

    scale = float(attrs.get("scale", 0.0)) or 1.0 / math.sqrt(h)
    softcap = float(attrs.get("softcap", 0.0))
    window = int(attrs.get("local_window_size", -1))
    smooth = bool(attrs.get("smooth_softmax", 0))
    if smooth and head_sink is not None:
        raise ValueError("GroupQueryAttention: head_sink cannot be combined with smooth_softmax=1")
    sinks = None
    if smooth or head_sink is not None:
        sinks = np.zeros(nq, np.float32) if head_sink is None else np.asarray(head_sink, dtype=np.float32)
    if int(attrs.get("sliding_window_cache", 0)):
        if past_key is None or past_value is None or window <= 0 or attention_bias is not None:
            raise ValueError("GroupQueryAttention: sliding_window_cache=1 needs past_key, past_value, "
                             "local_window_size > 0 and no attention_bias")
        out = _ring_attention(ctx, q, k, v, past_key, past_value, pasts, totals, window, scale, softcap, sinks)
        result = write(ctx, 0, out.reshape(bsz, s_len, nq * h), dtype)
        return tuple(o if i < len(ctx.node.outputs) and ctx.node.outputs[i] else None
                     for i, o in enumerate((result, past_key, past_value)))

    # 2. KV write.
    p_buf = 0 if past_key is None else _capacity(past_key, layout)
    shared = past_key is not None and p_buf >= total
    if shared:
        present_k, present_v = past_key, past_value
    else:
        length = max(total, p_buf)
        shape = (bsz, nkv, length, h) if layout == "head_major" else (bsz, length, nkv, h)
        present_k, present_v = buffer(ctx, 1, shape, dtype), buffer(ctx, 2, shape, dtype)
        present_k[...], present_v[...] = 0, 0
    capacity = _capacity(present_k, layout)
    for b in range(bsz):
        if pasts[b] + s_len > capacity or totals[b] > capacity:
            raise ValueError(f"GroupQueryAttention: row {b} needs {pasts[b] + s_len} cache rows, "
                             f"capacity {capacity}")
        if not shared and pasts[b] > p_buf:
            raise ValueError(f"GroupQueryAttention: row {b} has {pasts[b]} past rows, past holds {p_buf}")
        for g in range(nkv):
            for src, dst, new in ((past_key, present_k, k), (past_value, present_v, v)):
                rows = _rows(dst, layout, b, g)
                if not shared and pasts[b]:
                    rows[:pasts[b]] = _rows(src, layout, b, g)[:pasts[b]]
                rows[pasts[b]:pasts[b] + s_len] = new[b, :, g]

    # 3-5. Scores, softmax, output per (row, kv head).
    group = nq // nkv
    out = np.zeros((bsz, s_len, nq, h), np.float32)
    bias = None if attention_bias is None else np.asarray(attention_bias)
    for b in range(bsz):
        t_b, p_b = totals[b], pasts[b]
        bias_b = None if bias is None else bias[b if bias.shape[0] > 1 else 0]
        for g in range(nkv):
            keys = _rows(present_k, layout, b, g)[:t_b].astype(np.float32)
            vals = _rows(present_v, layout, b, g)[:t_b].astype(np.float32)
            heads = list(range(g * group, (g + 1) * group))
            qg = q[b, :, g * group:(g + 1) * group].astype(np.float32).transpose(1, 0, 2)  # [G, S, H]
            hb = None if bias_b is None else (bias_b[heads] if bias_b.shape[0] > 1 else bias_b[[0] * group])
            sink = None if sinks is None else sinks[heads][:, None, None]
            # Query s (position p) reads keys [0, min(p + 1, T_b)): exactly the keys, and so the
            # reduction widths, a decode step at position p reads, so a prompt's logits are the
            # bits of the same tokens fed one decode step at a time (docs/design.md "Continuing").
            for s0 in range(s_len):
                p = p_b + s0
                width = min(p + 1, t_b)
                j = np.arange(width)[None, :]
                allowed = j <= p
                if window > 0:
                    allowed &= j > p - window
                hb_s = None if hb is None else hb[:, s0:s0 + 1, :width]
                out[b, s0, g * group:(g + 1) * group] = _attend(
                    qg[:, s0:s0 + 1], keys[:width], vals[:width], allowed, hb_s, scale, softcap, sink)[:, 0]
    result = write(ctx, 0, out.reshape(bsz, s_len, nq * h), dtype)
    names = ctx.node.outputs
    outs = (result, present_k, present_v)
    return tuple(o if i < len(names) and names[i] else None for i, o in enumerate(outs))


def _ring_attention(ctx, q, k, v, past_key, past_value, pasts, totals, window: int, scale: float,
                    softcap: float, sinks) -> np.ndarray:
    """sliding_window_cache=1 (module docstring): attention of ``q`` [B, S, Nq, H] over each
    row's window, read from the ring ``past_*`` and the new ``k``/``v`` [B, S, Nkv, H], then the
    new rows written into the ring; returns fp32 [B, S, Nq, H]."""
    layout = ctx.kv_layout
    bsz, s_len, nq, h = q.shape
    nkv = k.shape[2]
    group = nq // nkv
    cap = _capacity(past_key, layout)
    out = np.zeros((bsz, s_len, nq, h), np.float32)
    for b in range(bsz):
        p_b, t_b = pasts[b], totals[b]
        if t_b > cap and cap < window:
            raise ValueError(f"GroupQueryAttention: row {b} holds {t_b} positions in a ring of {cap} slots, "
                             f"smaller than the window {window}")
        lo = max(0, p_b - window + 1)  # the first position query P_b reads
        past_slots = np.arange(lo, p_b) % cap
        new_rows = min(t_b - p_b, s_len)
        for g in range(nkv):
            heads = slice(g * group, (g + 1) * group)
            sink = None if sinks is None else sinks[heads][:, None, None]
            keys = np.concatenate([_rows(past_key, layout, b, g)[past_slots], k[b, :new_rows, g]]).astype(np.float32)
            vals = np.concatenate([_rows(past_value, layout, b, g)[past_slots], v[b, :new_rows, g]]).astype(np.float32)
            qg = q[b, :, heads].astype(np.float32).transpose(1, 0, 2)  # [G, S, H]
            for s0 in range(s_len):
                p = p_b + s0
                first, end = max(0, p - window + 1), min(p + 1, t_b)
                if end <= first:
                    continue  # a padding query with no key in its window: zeros
                allowed = np.ones((1, end - first), bool)
                out[b, s0, heads] = _attend(qg[:, s0:s0 + 1], keys[first - lo:end - lo], vals[first - lo:end - lo],
                                            allowed, None, scale, softcap, sink)[:, 0]
        written = np.arange(max(p_b, t_b - cap), t_b)
        for g in range(nkv):
            for buf, new in ((past_key, k), (past_value, v)):
                _rows(buf, layout, b, g)[written % cap] = new[b, written - p_b, g]
    return out

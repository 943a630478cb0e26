"""GroupQueryAttention (com.microsoft), docs/ops.md 1.3/1.4, shared KV buffer only.

Kernels (kernels/group_query_attention.cu), split-KV over chunks of CH = 64 absolute positions:
decode (S == 1, not the first prompt): one launch ``gqa_decode`` (grid (ceil(cap / CH), Nkv, B):
one block of :func:`decode_threads` threads per chunk, kv head and row, the group's query heads
together; the last chunk's block writes the rotated K/V row P_b = seqlens_k[b]; partials fold in
chunk order in the block that takes the last ticket); a prompt: ``gqa_kv_write`` (grid (S, Nkv,
B)) then ``gqa_attn`` (grid (ceil(S / 8), Nq, B), each block walking its queries' chunks in the
same order). seqlens_k is read on the device, never copied to the host; total_sequence_length
must be a host value (it only selects the phase). A prompt block takes up to 8 consecutive
queries of one head (the K/V tiles are loaded once for all of them). The decode workspace
(partials [B, Nq, chunks, H + 2] float32, tickets [B, Nkv] int32, zero between launches) is one
per shape for all layers of a provider (layers run one after the other on one stream).

Supported: packed QKV or separate q/k/v, do_rotary with cos/sin caches (non-interleaved),
softcap, local_window_size, smooth_softmax, head_sink, the fused q/k RMSNorm (q_norm_weight and
k_norm_weight [H], inputs 14 and 15, docs/ops.md 1.3.0: every kernel that rotates Q or the new K
normalises it first with the same device function, so decode and prefill keep giving the same
bits); KV layout head_major or seq_major (ctx.kv_layout). The KV buffer must be shared (past
given with >= total rows): new rows are written in place and the past arrays are returned as
present. sliding_window_cache=1 (a ring, docs/kv-geometry.md): position p lives in row p mod cap;
decode blocks take the chunks of the row's window (:func:`decode_chunks`) and address rows by
slot; a prompt runs on a staging cache of S positions (node scratch) and ``gqa_ring_store``
copies each row's live positions into the ring. Rejected: position_ids, attention_bias,
rotary_interleaved, quantized KV (inputs 12, 13), query_seqlens (16), qk_output, causal=0.

:func:`stats` counts the launcher runs that took the q/k-norm path or a ring (tests assert they ran).
"""

import math
from typing import Any, Callable, Sequence

import numpy as np

from core.opdefs import gqa_unsupported
from providers.cuda import replay
from providers.cuda.module import ctype, function, multiprocessors
from providers.cuda.ops import MAX_GRID_Y, NULL, device_array
from providers.cuda.ops._linear import i32
from providers.cuda.paths import PATHS

OP_TYPE = "GroupQueryAttention"
DOMAIN = "com.microsoft"
NT = 128  # block size of the prompt kernels (the kernel's NT)
CH = 64  # positions per KV chunk (the kernel's CH)


#: Launcher runs per path since import (replayed launches are not counted): "qk_norm" took the
#: fused q/k RMSNorm, "plain" did not; "decode_128" and "decode_256" count decode launches by
#: block size (:func:`decode_threads`), "decode_hinted" those that took the hinted prologue and
#: "decode_static_head" those that ran the compile-time head size (:func:`static_head`), "ring"
#: the runs on a sliding_window_cache ring (:func:`ring_rows`).
PATHS.declare("gqa", ("qk_norm", "plain", "decode_128", "decode_256", "decode_hinted", "decode_static_head",
                      "ring"))
#: ``gqa_decode`` may take its hinted prologue (:func:`hinted`) where the provider's tuning says
#: so (``tuning.attn_hint``, :class:`~providers.cuda.tuning.Tuning`). Either way every output bit
#: is the same. The most rows of a decode step that takes the hint: past 8 rows the attention
#: grid is large and the guess's extra read lengthens every block, the many that exit at once too
#: (measured slower at 16 and 32 rows, faster at 1 and 8).
HINT_ROWS = 8
#: Added to the decode kernel's guess of each row's position (its ``hint`` argument,
#: kernels/group_query_attention.cu QkvRound): 0, the seqlens array itself. Tests set it to make
#: every guess wrong, so the kernel's reload path runs (the bits must not change); eager only.
HINT_SHIFT = 0


def stats() -> dict:
    """A copy of the launcher-run counters (the ``gqa`` group of :data:`providers.cuda.paths.PATHS`)."""
    return PATHS.stats("gqa")


def supports(node, ring: bool = True) -> bool:
    """Whether the launcher runs ``node``; ``ring``: sliding_window_cache=1 nodes run on their
    ring (the provider passes ``tuning.attn_ring``; off, they are refused at load with what to
    do, core.opdefs.gqa_unsupported)."""
    return not gqa_unsupported(node, interleaved=False, bias=False, qk_norm=True, any_norm_dtype=False, ring=ring)


def support_reason(node, ring: bool = True) -> str | None:
    """Why :func:`supports` refuses ``node`` (``ring`` as there), or None."""
    return "; ".join(gqa_unsupported(node, interleaved=False, bias=False, qk_norm=True, any_norm_dtype=False,
                                     ring=ring)) or None


def replay_key(ctx, *inputs) -> tuple:
    """Eager replay key (providers/cuda/replay.py): the launches use total_sequence_length
    (input 6) only to pick the phase (S == total) and to check the KV capacity, so a decode
    step replays although the total grows by one each step."""
    total = inputs[6] if len(inputs) > 6 else None
    if not isinstance(total, (np.ndarray, np.generic, int)):
        return None, replay.host_values(inputs)  # run() raises: never replayed
    total = int(np.asarray(total).reshape(-1)[0])
    past = inputs[3] if len(inputs) > 3 else None
    cap = 0 if past is None else past.shape[2 if ctx.kv_layout == "head_major" else 1]
    return (total == inputs[0].shape[1], total <= cap), replay.host_values(inputs, skip=6)


#: Head sizes ``gqa_decode`` is compiled for at compile time (its HC template argument); any other
#: runs the kernel with H at run time (HC = 0).
STATIC_HEADS = (64, 128)
#: Decode launches use the compile-time head size where it is one of STATIC_HEADS and
#: ``tuning.attn_static_head`` is on (divisions by a known H become shifts on the kernel's
#: latency-bound path). The same floating-point operations in the same order either way, so the
#: same bits.


def _exprs(t):
    decode = tuple(f"gqa_decode<{t}, {n}, {hc}>" for n in (128, 256) for hc in (0, *STATIC_HEADS))
    return (*decode, f"gqa_attn<{t}>", f"gqa_kv_write<{t}>", f"gqa_ring_store<{t}>")


def static_head(h: int, on: bool) -> int:
    """The HC template argument of ``gqa_decode`` for head size ``h``: ``h`` itself where it is
    one of STATIC_HEADS and ``on`` (``tuning.attn_static_head``), else 0 (H at run time)."""
    return h if on and h in STATIC_HEADS else 0


def decode_threads(bsz: int, nkv: int) -> int:
    """Block size of ``gqa_decode`` for ``bsz`` rows of ``nkv`` kv heads: 256 threads while the
    rows' (row, kv head) pairs fit one per multiprocessor (the step is the latency of one block,
    and the wider block halves its serial passes), else 128 (more blocks resident, fewer idle
    threads). The arithmetic of every output element is the same in both
    (kernels/group_query_attention.cu), so this choice never changes a bit."""
    return 256 if bsz * nkv <= multiprocessors() else 128


def run(ctx, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
        total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None,
        attention_bias=None, head_sink=None, k_scale=None, v_scale=None, q_norm_weight=None,
        k_norm_weight=None, query_seqlens=None):
    attrs = ctx.node.attrs
    if any(x is not None for x in (position_ids, attention_bias, k_scale, v_scale, query_seqlens)):
        raise ValueError("GroupQueryAttention (cuda): position_ids, attention_bias, k_scale, v_scale and "
                         "query_seqlens are not supported")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("GroupQueryAttention: q_norm_weight and k_norm_weight must be given together")
    if not isinstance(total_sequence_length, (np.ndarray, np.generic, int)):
        raise ValueError("GroupQueryAttention (cuda): total_sequence_length must be a host value")
    total = int(np.asarray(total_sequence_length).reshape(-1)[0])
    nq, nkv = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    if nq % nkv:
        raise ValueError(f"GroupQueryAttention: num_heads {nq} not a multiple of kv_num_heads {nkv}")
    bsz, s_len, width = query.shape
    dtype = query.dtype
    if key is None:
        h = width // (nq + 2 * nkv)
        kin = vin = query
        q_row = k_row = width
        k_off, v_off = nq * h, (nq + nkv) * h
    else:
        h = width // nq
        kin, vin = key, value
        q_row, k_row, k_off, v_off = width, nkv * h, 0, 0
        if key.shape != (bsz, s_len, nkv * h) or value.shape != key.shape:
            raise ValueError(f"GroupQueryAttention: key/value shapes {key.shape}/{value.shape}")
    if h > 256 or h % 8:
        raise ValueError(f"GroupQueryAttention (cuda): head size {h} unsupported (multiple of 8, <= 256)")
    if past_key is None or past_value is None:
        raise ValueError("GroupQueryAttention (cuda): needs the shared KV buffer as past_key/past_value")
    head_major = ctx.kv_layout == "head_major"
    cap = past_key.shape[2] if head_major else past_key.shape[1]
    window = int(attrs.get("local_window_size", -1))
    first = s_len == total
    ring = ring_rows(attrs, cap, first, s_len)
    if cap < total and not ring:
        raise ValueError(f"GroupQueryAttention (cuda): KV buffer holds {cap} rows < total {total}; "
                         "only the shared-buffer mode is supported")
    cb, cg, cj = strides(head_major, nkv, cap, h)
    if not first and s_len != 1 and bsz != 1:
        raise ValueError("GroupQueryAttention: a subsequent prompt (1 < S != total) needs B == 1")
    seqlens = device_array(ctx, seqlens_k, "seqlens_i32", np.int32)
    rotary = int(attrs.get("do_rotary", 0))
    if rotary and (cos_cache is None or sin_cache is None):
        raise ValueError("GroupQueryAttention: do_rotary=1 needs cos_cache and sin_cache")
    half_rot = int(cos_cache.shape[1]) if rotary else 0
    cos = cos_cache if rotary else query
    sin = sin_cache if rotary else query
    smooth = int(attrs.get("smooth_softmax", 0))
    if smooth and head_sink is not None:
        raise ValueError("GroupQueryAttention: head_sink cannot be combined with smooth_softmax=1")
    sinks = NULL if head_sink is None else head_sink
    norm = q_norm_weight is not None
    if norm:
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            if tuple(w.shape) != (h,) or w.dtype != dtype:
                raise ValueError(f"GroupQueryAttention (cuda): {name} is {w.dtype}{list(w.shape)}, "
                                 f"expected {np.dtype(dtype).name}[{h}]")
    eps = float(attrs.get("qk_norm_epsilon", 1e-6))
    qeps, keps = np.float32(attrs.get("q_norm_epsilon", eps)), np.float32(attrs.get("k_norm_epsilon", eps))
    qnw = q_norm_weight if norm else NULL
    knw = k_norm_weight if norm else NULL
    PATHS.add("gqa", "qk_norm" if norm else "plain")
    PATHS.add("gqa", "ring", int(bool(ring)))
    scale = float(attrs.get("scale", 0.0)) or 1.0 / math.sqrt(h)
    out = ctx.output(0, (bsz, s_len, nq * h), dtype)

    def geo_of(rows: int, strides_: tuple, ring_: int) -> tuple:
        return (i32(bsz), i32(s_len), i32(nq), i32(nkv), i32(h), i32(half_rot), i32(rows),
                np.int64(q_row), np.int64(k_row), i32(k_off), i32(v_off), *(np.int64(x) for x in strides_),
                i32(first), i32(window), i32(smooth), np.float32(scale), np.float32(attrs.get("softcap", 0.0)),
                i32(ring_))

    geo = geo_of(cap, (cb, cg, cj), ring)
    t = ctype(dtype)
    if bsz > MAX_GRID_Y:
        raise ValueError(f"GroupQueryAttention (cuda): batch {bsz} exceeds the grid limit {MAX_GRID_Y}")
    chunks = decode_chunks(cap, window, bool(ring))
    if not ctx.frozen:  # a prompt makes the workspace of the decode steps that follow it
        _workspace(ctx, bsz, nq, nkv, chunks, h)
    if not first and s_len == 1:
        group = nq // nkv
        part, tickets = _workspace(ctx, bsz, nq, nkv, chunks, h)
        threads = decode_threads(bsz, nkv)
        PATHS.add("gqa", f"decode_{threads}")
        tuning = ctx.provider.tuning
        use_hint = tuning.attn_hint and bsz <= HINT_ROWS and not ring  # a ring's chunks follow the position
        if use_hint and not norm and hinted(group, h, threads):
            PATHS.add("gqa", "decode_hinted")
        hint = NULL if not use_hint else seqlens if HINT_SHIFT == 0 else _shifted(ctx, seqlens, HINT_SHIFT)
        hc = static_head(h, tuning.attn_static_head)
        if hc:
            PATHS.add("gqa", "decode_static_head")
        kern = function("group_query_attention", f"gqa_decode<{t}, {threads}, {hc}>", _exprs(t))
        tiles = 2 * CH * _decode_tile_stride(h, dtype) * dtype.itemsize
        shared = tiles + (group * h + group * CH + 2 * group + 1 + h) * 4
        _shared_limit(kern, shared)
        kern((chunks, nkv, bsz), (threads,), (query, kin, vin, past_key, past_value, seqlens, hint, cos, sin,
                                          i32(rotary), sinks, out, part, tickets, qnw, knw, qeps, keps) + geo,
             shared_mem=shared)
    else:
        kc, vc = past_key, past_value
        if ring:  # the prompt runs on a staging cache of S positions, then its live rows go to the ring
            shape = (bsz, nkv, s_len, h) if head_major else (bsz, s_len, nkv, h)
            kc, vc = ctx.output("ring_stage_k", shape, dtype), ctx.output("ring_stage_v", shape, dtype)
            geo = geo_of(s_len, strides(head_major, nkv, s_len, h), 0)
        write = function("group_query_attention", f"gqa_kv_write<{t}>", _exprs(t))
        write((s_len, nkv, bsz), (NT,), (kin, vin, kc, vc, seqlens, cos, sin,
                                          i32(rotary), knw, keps) + geo)
        attn = function("group_query_attention", f"gqa_attn<{t}>", _exprs(t))
        qb = min(8, 8 * NT // h)  # queries per block: qb * H <= 8 * NT (the kernel's QMAX and acc[8])
        shared = (2 * qb * h + qb * CH + 6 * qb) * 4 + 2 * CH * _tile_stride(h, dtype) * dtype.itemsize
        _shared_limit(attn, shared)
        attn((-(-s_len // qb), nq, bsz), (NT,), (query, kc, vc, seqlens, cos, sin, i32(rotary),
                                                 sinks, out, i32(qb), qnw, qeps) + geo, shared_mem=shared)
        if ring:
            store = function("group_query_attention", f"gqa_ring_store<{t}>", _exprs(t))
            store((s_len, nkv, bsz), (NT,), (kc, vc, past_key, past_value, seqlens, i32(h), i32(ring),
                                             *(np.int64(x) for x in strides(head_major, nkv, s_len, h)),
                                             np.int64(cb), np.int64(cg), np.int64(cj)))
    names = ctx.node.outputs
    outs = (out, past_key, past_value)
    return tuple(o if i < len(names) and names[i] else None for i, o in enumerate(outs))


def ring_rows(attrs, cap: int, first: bool, s_len: int) -> int:
    """The ring size the kernels get for a node's KV buffer of ``cap`` rows: ``cap`` with
    sliding_window_cache=1 (position p in row p mod cap, docs/kv-geometry.md), else 0.

    Raises:
        ValueError: a subsequent prompt (1 < S != total) into a ring (Lockstep's prefill is
            always a first prompt; its staging would need the ring's past rows).
    """
    if not int(attrs.get("sliding_window_cache", 0)):
        return 0
    if not first and s_len > 1:
        raise ValueError("GroupQueryAttention (cuda): a subsequent prompt into a sliding_window_cache ring")
    return cap


def strides(head_major: bool, nkv: int, rows: int, h: int) -> tuple[int, int, int]:
    """Element strides (batch, kv head, position) of a KV buffer of ``rows`` positions."""
    return (nkv * rows * h, rows * h, h) if head_major else (rows * nkv * h, h, nkv * h)


def decode_chunks(cap: int, window: int, ring: bool) -> int:
    """Blocks of ``gqa_decode`` per (kv head, row), its grid's x: one per CH-position chunk of a
    full cache of ``cap`` rows; for a ring, enough for the chunks of any query's window: the
    keys ``p - m + 1 .. p`` (m = min(window, cap)) touch at most ``ceil(m / CH) + 1`` chunks, and
    block x takes the row's x-th one."""
    if not ring:
        return -(-cap // CH)
    return -(-min(window, cap) // CH) + 1


def prompt_staging_bytes(nodes: Sequence[Any], steps: Sequence[int], shape_of: Callable[[str], Any]) -> int:
    """Device bytes of a prompt's staging cache on a sliding-window layer (:func:`run`: K and V of
    its S positions, ``[B, Nkv, S, H]`` each, before the live rows go to the ring), the largest
    over the GroupQueryAttention nodes ``nodes[i]`` for ``i`` in ``steps`` at the shapes
    ``shape_of`` gives (a prefill frees each node's buffers after their last reader); 0 at a
    decode step (S = 1) and without a window."""
    most = 0
    for i in steps:
        n = nodes[i]
        out = shape_of(n.outputs[0]) if n.op_type == "GroupQueryAttention" else None
        if out is None or out.ndim != 3 or out.shape[1] <= 1 or int(n.attrs.get("local_window_size", -1)) <= 0:
            continue
        nq, nkv = int(n.attrs["num_heads"]), int(n.attrs["kv_num_heads"])
        most = max(most, 2 * out.shape[0] * nkv * out.shape[1] * (out.shape[2] // nq) * out.dtype.itemsize)
    return most


def hinted(group: int, h: int, threads: int) -> bool:
    """Whether ``gqa_decode`` takes its hinted prologue (kernels/group_query_attention.cu QkvRound,
    ``qkv_one_round``) for ``group`` query heads of ``h`` values at ``threads`` threads, without
    a fused q/k norm: the group's q, new k and new v fit one round of RQ = 4 values per thread.
    The cos/sin rows and the chunk's first K/V tiles then load before the PDL wait at a guess of
    the position, checked after it."""
    return (group + 2) * h <= 4 * threads


def _shifted(ctx, seqlens, shift: int):
    """seqlens + ``shift`` in the node's scratch "seqlens_hint" (a CuPy op: eager only)."""
    import cupy

    replay.not_replayable()
    buf = ctx.output("seqlens_hint", seqlens.shape, seqlens.dtype)
    cupy.add(seqlens, shift, out=buf)
    return buf


def _tile_stride(h: int, dtype) -> int:
    """Row stride of the kernel's shared K/V tiles (tile_stride in the .cu): odd 32-bit words."""
    return h + 2 if np.dtype(dtype).itemsize == 2 else h + 1


def _decode_tile_stride(h: int, dtype) -> int:
    """Row stride of the decode kernel's K/V tiles (dtile_stride in the .cu): an odd number of
    16-byte units."""
    units = h * np.dtype(dtype).itemsize // 16
    return (units + (1 if units % 2 == 0 else 2)) * 16 // np.dtype(dtype).itemsize


def _workspace(ctx, bsz: int, nq: int, nkv: int, chunks: int, h: int):
    """The decode split-KV workspace for this shape, shared by every GQA node of the provider.

    Kept per shape for the provider's life (a captured graph holds the pointers); the tickets
    are zeroed once at allocation and every launch leaves them at zero. Raises RuntimeError when
    a new shape is needed inside a capture (docs/cases.md 10).
    """
    store = ctx.provider.__dict__.setdefault("_gqa_workspace", {})
    key = (bsz, nq, nkv, chunks, h)
    ws = store.get(key)
    if ws is None:
        if ctx.frozen:
            raise RuntimeError(f"GroupQueryAttention (cuda): new split-KV workspace {key} inside a capture")
        ws = (ctx.provider.allocate((bsz, nq, chunks, h + 2), np.float32),
              ctx.provider.allocate((bsz, nkv), np.int32, zero=True))
        store[key] = ws
    return ws


def _shared_limit(kern, nbytes: int) -> None:
    """Opt the kernel in to ``nbytes`` of dynamic shared memory (above the default 48 KiB).

    Raises:
        ValueError: more than the device's opt-in limit per block (the head size and GQA group
            decide it: about 227 KiB on an H200).
    """
    if nbytes <= 48 * 1024 or kern.max_dynamic_shared_size_bytes >= nbytes:
        return
    import cupy

    limit = cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
    if nbytes > limit:
        raise ValueError(f"GroupQueryAttention (cuda): needs {nbytes} bytes of shared memory per block, "
                         f"over this device's opt-in limit of {limit} (head size and query heads per KV "
                         "head too large)")
    kern.max_dynamic_shared_size_bytes = nbytes

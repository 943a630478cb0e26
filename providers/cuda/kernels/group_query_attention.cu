// GroupQueryAttention (com.microsoft), docs/ops.md 1.3: RoPE on Q and K, KV write into the shared
// cache, causal softmax attention.  Packed QKV [B, S, (Nq + 2 Nkv) H] or separate q/k/v.
//
// Per row b: T_b = seqlens_k[b] + 1 read from DEVICE memory (never copied to the host);
// P_b = 0 for the first prompt (S == total, decided on the host from shapes), else T_b - S.
// Query row s sits at p = P_b + s and attends to keys j in [lo, min(p, T_b - 1)]
// (lo = p - W + 1 with a local window W, else 0).
//
// Split-KV.  The keys of one query are cut into chunks of CH = 64 ABSOLUTE positions
// (chunk c holds keys [c CH, c CH + CH) intersected with [lo, hi]); how many chunks a query has
// depends only on its own position, never on B, on the capacity or on other rows.  Decode
// (S == 1) runs one block per (chunk, kv head, row): the query heads of a GQA group share every
// K/V read; partials (m_c, l_c, o_c[H]) go to a workspace and the last block of a (row, kv head)
// to finish (an atomic ticket) folds them.  Prefill runs one block per (query, head, row) that
// walks the same chunks in order.  Both call the same device functions below, so a query gives
// the same bits in decode and in prefill (continuing a row == prefilling its whole history).
//
// Arithmetic for one (row, query head, query position), fixed by H and the key indices alone:
//   score z_j: one thread's fmaf chain of q[d] k[d] over d = 0 .. H - 1 ascending from 0; times
//     scale; softcap.
//   chunk c: m_c = max z_j (exact); e_j = expf(z_j - m_c); l_c: lane l sums e_j for
//     j = j0 + l, j0 + l + 32 (ascending), then a fixed xor tree; o_c[d]: one thread's fmaf chain
//     of e_j v_j[d] over the chunk's keys ascending from 0.
//   fold over chunks ascending from (m, l, o) = (-inf, 0, 0): m' = max(m, m_c),
//     a = expf(m - m'), b = expf(m_c - m'), l' = l a + l_c b, o' = o a + o_c b (rounded mul, add).
//   finish: with a sink s (head_sink, or 0 for smooth_softmax): m'' = max(m, s),
//     a = expf(m - m''), l = l a + expf(s - m''), o = o a; out = o / l (0 when l == 0).
// Fused q/k RMSNorm (docs/ops.md 1.3.0; qnw/knw non-null): before RoPE, every head vector x of Q and
//   of the new K: one warp, lane l sums x[d]^2 for d = l, l + 32, ... ascending (fmaf chain),
//   then the fixed xor tree; r = 1 / sqrt(sum / H + eps) (correctly rounded divisions and sqrt);
//   y[d] = T(x[d] r w[d]), then RoPE on y as without the norm.  The same function in decode and
//   prefill, per head vector alone (norm_rope below).
// Geometry scalars are passed one by one (GEO_ARGS order) and gathered in a Geo struct.
// Blocks of NT = 128 threads (prompt kernels) or NTT = 128 or 256 (decode, the launcher's
// choice).  Q and K are rotated in fp32 and rounded to T before use (the cache holds T), as
// cpu_reference does.
#include <cuda_fp16.h>

#define NEG_INF __int_as_float(0xff800000)
__device__ __forceinline__ bool finite_f(float v) { return fabsf(v) < __int_as_float(0x7f800000); }

#define NT 128

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

struct Geo {
    int B, S, nq, nkv, H, half_rot, cap;
    long long q_row, k_row;   // element stride between tokens (b, s) of the q / k,v inputs
    int k_off, v_off;         // element offset of K / V inside a token row (packed) or 0
    long long cb, cg, cj;     // cache strides: batch, kv head, position
    int first, window, smooth;
    float scale, softcap;
    int ring;                 // sliding_window_cache=1: the cache is a ring of this many rows, else 0
};

// Cache row of absolute position p: p, or its ring slot p mod ring (docs/kv-geometry.md).
__device__ __forceinline__ long long slot(const Geo& g, int p) { return g.ring ? p % g.ring : p; }
// Whether position p has a cache row: below the capacity, or any position of a ring.
__device__ __forceinline__ bool in_cache(const Geo& g, int p) { return p >= 0 && (g.ring || p < g.cap); }
// Rows of a ring from the slot of position p to the ring's end (a tile's rows past it wrap to 0).
__device__ __forceinline__ int wrap_rows(const Geo& g, int p) { return g.ring ? g.ring - (int)slot(g, p) : 1 << 30; }

// Rotate head vector x (H elements of T at src) at position pos, rounded to T, into dst (T or float).
// nh > 1: nh adjacent head vectors (src and dst advance by H per head).
template <typename T, typename D>
__device__ void rope(const T* src, D* dst, const T* cosc, const T* sinc, int pos, int H, int half_rot, int tid, int nt,
                     int nh = 1) {
    const int r = 2 * half_rot;
    for (int e = tid; e < nh * H; e += nt) {
        const int hh = e / H, d = e - hh * H;
        float v = to_f(src[hh * H + d]);
        if (d < r) {
            const int i = d < half_rot ? d : d - half_rot;
            const float c = to_f(cosc[(long long)pos * half_rot + i]), s = to_f(sinc[(long long)pos * half_rot + i]);
            if (d < half_rot) v = __fsub_rn(__fmul_rn(v, c), __fmul_rn(to_f(src[hh * H + d + half_rot]), s));
            else v = __fadd_rn(__fmul_rn(v, c), __fmul_rn(to_f(src[hh * H + d - half_rot]), s));
        }
        dst[hh * H + d] = (D)to_f(from_f<T>(v));
    }
}
template <typename T>
__device__ void rope_t(const T* src, T* dst, const T* cosc, const T* sinc, int pos, int H, int half_rot, int tid, int nt) {
    const int r = 2 * half_rot;
    for (int d = tid; d < H; d += nt) {
        float v = to_f(src[d]);
        if (d < r) {
            const int i = d < half_rot ? d : d - half_rot;
            const float c = to_f(cosc[(long long)pos * half_rot + i]), s = to_f(sinc[(long long)pos * half_rot + i]);
            if (d < half_rot) v = __fsub_rn(__fmul_rn(v, c), __fmul_rn(to_f(src[d + half_rot]), s));
            else v = __fadd_rn(__fmul_rn(v, c), __fmul_rn(to_f(src[d - half_rot]), s));
        }
        dst[d] = from_f<T>(v);
    }
}

// Fused q/k RMSNorm, then RoPE, of nh adjacent head vectors (H values of T at src, advancing by H)
// into dst (floats holding values of T, advancing by H): the arithmetic of the header.  A warp per
// head vector for the norm; RoPE on pairs (i, i + half_rot) in place, rounded to T, with the
// products and sums of rope().  Every thread of the block must call it (it synchronises).
template <typename T, int NTT = NT>
__device__ void norm_rope(const T* src, float* dst, const T* w, float eps, const T* cosc, const T* sinc, int pos,
                          int H, int half_rot, int nh, int do_rotary) {
    const int lane = threadIdx.x & 31;
    for (int hh = threadIdx.x >> 5; hh < nh; hh += NTT / 32) {  // warp-uniform: full-mask shuffles
        const T* x = src + hh * H;
        float ss = 0.f;
        for (int d = lane; d < H; d += 32) { const float v = to_f(x[d]); ss = fmaf(v, v, ss); }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, o));
        const float r = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)H), eps)));
        for (int d = lane; d < H; d += 32)
            dst[hh * H + d] = to_f(from_f<T>(__fmul_rn(__fmul_rn(to_f(x[d]), r), to_f(w[d]))));
    }
    __syncthreads();
    if (!do_rotary) return;
    for (int e = threadIdx.x; e < nh * half_rot; e += NTT) {
        const int hh = e / half_rot, i = e - hh * half_rot;
        float* y = dst + hh * H;
        const float c = to_f(cosc[(long long)pos * half_rot + i]), s = to_f(sinc[(long long)pos * half_rot + i]);
        const float a = y[i], b = y[i + half_rot];
        y[i] = to_f(from_f<T>(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s))));
        y[i + half_rot] = to_f(from_f<T>(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s))));
    }
    __syncthreads();
}

#define CH 64

__device__ __forceinline__ float scaled(float s, const Geo& g) {
    float z = __fmul_rn(s, g.scale);
    if (g.softcap > 0.f) z = __fmul_rn(g.softcap, tanhf(__fdiv_rn(z, g.softcap)));
    return z;
}

// Shared K/V tiles of the prompt kernel: row stride TS(H) elements of T, an odd number of 32-bit
// words, so threads reading one element of different rows hit different banks.  The decode kernel
// reads whole 16-byte units of a row (dtile_stride: an odd number of 16-byte units, so the eight
// threads of a quarter warp reading one unit of eight different rows hit different banks).
template <typename T> __host__ __device__ constexpr int tile_stride(int H) { return sizeof(T) == 2 ? H + 2 : H + 1; }
template <typename T> __host__ __device__ constexpr int dtile_stride(int H) {
    return (H * (int)sizeof(T) / 16 + (H * (int)sizeof(T) / 16 % 2 == 0 ? 1 : 2)) * 16 / (int)sizeof(T);
}

// One chunk's K and V rows [j0, j0 + n) (n <= CH) from the cache into shared tiles [n, ts] of T,
// in rounds of TUN 16-byte units of each tile per thread (NTT threads): a round issues all of its
// loads before it stores any (a store through the tile pointer could alias the rows, so a
// load-store loop would wait out one memory round trip per unit).
#define TU 4
template <int TUN> struct TileRound { uint4 k[TUN], v[TUN]; };
template <typename T, int TUN, int NTT>
__device__ __forceinline__ void tiles_issue(TileRound<TUN>& r, const T* krows, const T* vrows, long long cj, int n,
                                            int H, int u0, int wrap = 1 << 30, int ring = 0) {
    const int upr = H * (int)sizeof(T) / 16, total = n * upr;  // H % 8 == 0: whole units
#pragma unroll
    for (int i = 0; i < TUN; ++i) {
        const int u = u0 + i * NTT;
        if (u < total) {
            const int jj = u / upr, x = u - jj * upr;
            const long long row = jj < wrap ? jj : jj - ring;  // a ring's rows past its end wrap to 0
            r.k[i] = reinterpret_cast<const uint4*>(krows + row * cj)[x];
            r.v[i] = reinterpret_cast<const uint4*>(vrows + row * cj)[x];
        }
    }
}
template <typename T, int TUN, int NTT>
__device__ __forceinline__ void tiles_store(const TileRound<TUN>& r, T* kt, T* vt, int n, int H, int ts, int u0) {
    const int upr = H * (int)sizeof(T) / 16, total = n * upr;
#pragma unroll
    for (int i = 0; i < TUN; ++i) {
        const int u = u0 + i * NTT;
        if (u < total) {
            const int jj = u / upr, x = u - jj * upr;
            unsigned* kd = reinterpret_cast<unsigned*>(kt + jj * ts) + x * 4;
            unsigned* vd = reinterpret_cast<unsigned*>(vt + jj * ts) + x * 4;
            kd[0] = r.k[i].x; kd[1] = r.k[i].y; kd[2] = r.k[i].z; kd[3] = r.k[i].w;
            vd[0] = r.v[i].x; vd[1] = r.v[i].y; vd[2] = r.v[i].z; vd[3] = r.v[i].w;
        }
    }
}
// The rounds from unit u0 on (u0 = threadIdx.x: the whole chunk).
template <typename T, int TUN = TU, int NTT = NT>
__device__ __forceinline__ void load_tiles(T* kt, const T* krows, T* vt, const T* vrows, long long cj, int n, int H,
                                           int ts, int u0 = threadIdx.x, int wrap = 1 << 30, int ring = 0) {
    const int total = n * (H * (int)sizeof(T) / 16);
    for (; u0 < total; u0 += TUN * NTT) {
        TileRound<TUN> r;
        tiles_issue<T, TUN, NTT>(r, krows, vrows, cj, n, H, u0, wrap, ring);
        tiles_store<T, TUN, NTT>(r, kt, vt, n, H, ts, u0);
    }
}

// Score dot product of one query head (H floats at q, 16-byte aligned) with one key row (H values
// of T at k, 16-byte aligned): one fmaf chain over d = 0 .. H - 1 ascending from 0, the same
// arithmetic as the prompt kernel's scalar loop, read a 16-byte unit at a time.
__device__ __forceinline__ float dot_row(const float* q, const __half* k, int H) {
    float s = 0.f;
#pragma unroll 2
    for (int d = 0; d < H; d += 8) {
        const uint4 u = *reinterpret_cast<const uint4*>(k + d);
        const float4 a = *reinterpret_cast<const float4*>(q + d), b = *reinterpret_cast<const float4*>(q + d + 4);
        const float2 k0 = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
        const float2 k1 = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
        const float2 k2 = __half22float2(*reinterpret_cast<const __half2*>(&u.z));
        const float2 k3 = __half22float2(*reinterpret_cast<const __half2*>(&u.w));
        s = fmaf(a.x, k0.x, s); s = fmaf(a.y, k0.y, s); s = fmaf(a.z, k1.x, s); s = fmaf(a.w, k1.y, s);
        s = fmaf(b.x, k2.x, s); s = fmaf(b.y, k2.y, s); s = fmaf(b.z, k3.x, s); s = fmaf(b.w, k3.y, s);
    }
    return s;
}
__device__ __forceinline__ float dot_row(const float* q, const float* k, int H) {
    float s = 0.f;
#pragma unroll 4
    for (int d = 0; d < H; d += 4) {
        const float4 u = *reinterpret_cast<const float4*>(k + d), a = *reinterpret_cast<const float4*>(q + d);
        s = fmaf(a.x, u.x, s); s = fmaf(a.y, u.y, s); s = fmaf(a.z, u.z, s); s = fmaf(a.w, u.w, s);
    }
    return s;
}
// Two adjacent values (d, d + 1) of a V row as floats.
__device__ __forceinline__ float2 pair_f(const __half* v) { return __half22float2(*reinterpret_cast<const __half2*>(v)); }
__device__ __forceinline__ float2 pair_f(const float* v) { return *reinterpret_cast<const float2*>(v); }

// One warp: chunk max m_c and sum l_c of the n scores at z (exp written back into z).
__device__ __forceinline__ void chunk_stats(float* z, int n, float& mc, float& lc) {
    const int lane = threadIdx.x & 31;
    float m = NEG_INF;
    for (int jj = lane; jj < n; jj += 32) m = fmaxf(m, z[jj]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (!finite_f(m)) m = 0.f;
    float l = 0.f;
    for (int jj = lane; jj < n; jj += 32) { const float e = expf(__fsub_rn(z[jj], m)); z[jj] = e; l = __fadd_rn(l, e); }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, o));
    mc = m;
    lc = __shfl_sync(0xffffffffu, l, 0);
}

// Fold weights of chunk (mc) into the running max m: a for the running state, b for the chunk.
__device__ __forceinline__ void fold_weights(float& m, float mc, float& a, float& b) {
    const float mn = fmaxf(m, mc);
    a = expf(__fsub_rn(m, mn));
    b = expf(__fsub_rn(mc, mn));
    m = mn;
}
__device__ __forceinline__ float folded(float x, float a, float xc, float b) {
    return __fadd_rn(__fmul_rn(x, a), __fmul_rn(xc, b));
}
// Final value of one output dim from the folded (m, l, o) and the optional sink.
__device__ __forceinline__ float finish(float m, float l, float o, bool use_sink, float sink) {
    if (use_sink) {
        const float ms = fmaxf(m, sink), a = expf(__fsub_rn(m, ms));
        l = __fadd_rn(__fmul_rn(l, a), expf(__fsub_rn(sink, ms)));
        o = __fmul_rn(o, a);
    }
    return l > 0.f ? __fdiv_rn(o, l) : 0.f;
}

// Prefill KV write: grid (S, Nkv, B), block NT.  Rotated K and V of token (b, s) -> cache row P_b + s.
template <typename T>
__global__ void gqa_kv_write(const T* __restrict__ kin, const T* __restrict__ vin, T* kc, T* vc,
                             const int* __restrict__ seqlens, const T* cosc, const T* sinc, int do_rotary,
                             const T* knw, float keps,
    int B, int S, int nq, int nkv, int H, int half_rot, int cap, long long q_row, long long k_row, int k_off, int v_off, long long cb, long long cg, long long cj, int first, int window, int smooth, float scale, float softcap, int ring) {
    PDL_ENTER();
    const Geo g{B, S, nq, nkv, H, half_rot, cap, q_row, k_row, k_off, v_off, cb, cg, cj, first, window, smooth, scale, softcap, ring};
    const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int past = g.first ? 0 : seqlens[b] + 1 - g.S, row = past + s;
    if (row < 0 || row >= g.cap) return;
    const T* ksrc = kin + (long long)(b * g.S + s) * g.k_row + g.k_off + h * g.H;
    const T* vsrc = vin + (long long)(b * g.S + s) * g.k_row + g.v_off + h * g.H;
    T* kd = kc + b * g.cb + h * g.cg + (long long)row * g.cj;
    T* vd = vc + b * g.cb + h * g.cg + (long long)row * g.cj;
    if (knw != nullptr) {  // fused k norm (block-uniform): normalised and rotated in shared memory
        __shared__ float kbuf[256];
        norm_rope<T>(ksrc, kbuf, knw, keps, cosc, sinc, row, g.H, g.half_rot, 1, do_rotary);
        for (int d = threadIdx.x; d < g.H; d += NT) kd[d] = from_f<T>(kbuf[d]);
    } else if (do_rotary) rope_t<T>(ksrc, kd, cosc, sinc, row, g.H, g.half_rot, threadIdx.x, NT);
    else for (int d = threadIdx.x; d < g.H; d += NT) kd[d] = ksrc[d];
    for (int d = threadIdx.x; d < g.H; d += NT) vd[d] = vsrc[d];
}

// Key range [lo, hi] of prompt query s (position p = past + s); empty when hi < lo.
__device__ __forceinline__ void query_range(const Geo& g, int past, int tb, int s, int& lo, int& hi) {
    const int p = past + s;
    hi = min(p, tb - 1);
    lo = g.window > 0 ? max(0, p - g.window + 1) : 0;
}

#define QMAX 8   // most queries per prefill block; QMAX * H <= 8 * NT (the launcher's qb)

// Prefill attention: grid (ceil(S / qb), Nq, B), block NT, dynamic smem (2 qb H + qb CH + 6 qb)
// floats + 2 CH TS T.  A block takes qb consecutive queries of one head: each chunk's K/V tile
// is loaded once for all of them, and each query's arithmetic is exactly that of a decode step
// at its position (scores, chunk_stats, values and the fold of the header, in chunk order).
template <typename T>
__global__ void gqa_attn(const T* __restrict__ qin, const T* kc, const T* vc, const int* __restrict__ seqlens,
                         const T* cosc, const T* sinc, int do_rotary, const T* sinks, T* out, int qb,
                         const T* qnw, float qeps,
    int B, int S, int nq, int nkv, int H, int half_rot, int cap, long long q_row, long long k_row, int k_off, int v_off, long long cb, long long cg, long long cj, int first, int window, int smooth, float scale, float softcap, int ring) {
    PDL_ENTER();
    const Geo g{B, S, nq, nkv, H, half_rot, cap, q_row, k_row, k_off, v_off, cb, cg, cj, first, window, smooth, scale, softcap, ring};
    extern __shared__ float sm[];
    float* qs = sm; float* sc = qs + qb * g.H; float* oc = sc + qb * CH; float* st = oc + qb * g.H;
    T* kt = (T*)(st + 6 * qb);  // st per query: m, l, a, b, m_c, l_c
    T* vt = kt + CH * tile_stride<T>(g.H);
    const int s0 = blockIdx.x * qb, h = blockIdx.y, b = blockIdx.z, kvh = h / (g.nq / g.nkv), tid = threadIdx.x;
    const int tb = seqlens[b] + 1, past = g.first ? 0 : tb - g.S, nqb = min(qb, g.S - s0), ts = tile_stride<T>(g.H);
    int lo_min = 1 << 30, hi_max = -1;
    for (int i = 0; i < nqb; ++i) {
        int lo, hi;
        query_range(g, past, tb, s0 + i, lo, hi);
        if (hi >= lo && hi < g.cap) { lo_min = min(lo_min, lo); hi_max = max(hi_max, hi); }
    }
    for (int i = 0; i < nqb; ++i) {  // rotate each live query (positions differ per query)
        int lo, hi;
        query_range(g, past, tb, s0 + i, lo, hi);
        if (hi < lo || hi >= g.cap) continue;
        const T* qsrc = qin + (long long)(b * g.S + s0 + i) * g.q_row + h * g.H;
        if (qnw != nullptr) norm_rope<T>(qsrc, qs + i * g.H, qnw, qeps, cosc, sinc, past + s0 + i, g.H, g.half_rot, 1,
                                         do_rotary);  // block-uniform (i, the range): it synchronises
        else if (do_rotary) rope<T, float>(qsrc, qs + i * g.H, cosc, sinc, past + s0 + i, g.H, g.half_rot, tid, NT);
        else for (int d = tid; d < g.H; d += NT) qs[i * g.H + d] = to_f(qsrc[d]);
    }
    if (tid < nqb) { st[6 * tid] = NEG_INF; st[6 * tid + 1] = 0.f; }
    float acc[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) acc[r] = 0.f;
    const T* kb = kc + b * g.cb + kvh * g.cg;
    const T* vb = vc + b * g.cb + kvh * g.cg;
    __syncthreads();
    for (int c = hi_max < 0 ? 1 : lo_min / CH; c <= (hi_max < 0 ? 0 : hi_max / CH); ++c) {
        const int u0 = max(lo_min, c * CH), nu = min(hi_max, c * CH + CH - 1) - u0 + 1;
        load_tiles<T>(kt, kb + (long long)u0 * g.cj, vt, vb + (long long)u0 * g.cj, g.cj, nu, g.H, ts);
        __syncthreads();
        for (int e = tid; e < nqb * CH; e += NT) {  // scores: one thread per (query, key)
            const int i = e / CH, jj = e - i * CH;
            int lo, hi;
            query_range(g, past, tb, s0 + i, lo, hi);
            const int j0 = max(lo, c * CH), n = min(hi, c * CH + CH - 1) - j0 + 1;
            if (hi < lo || hi >= g.cap || jj >= n) continue;
            const float* q = qs + i * g.H;
            const T* k = kt + (j0 - u0 + jj) * ts;
            float z = 0.f;
#pragma unroll 8
            for (int d = 0; d < g.H; ++d) z = fmaf(q[d], to_f(k[d]), z);
            sc[i * CH + jj] = scaled(z, g);
        }
        __syncthreads();
        for (int i = tid >> 5; i < nqb; i += NT / 32) {  // stats and fold weights: a warp per query
            int lo, hi;
            query_range(g, past, tb, s0 + i, lo, hi);
            const int j0 = max(lo, c * CH), n = min(hi, c * CH + CH - 1) - j0 + 1;
            if (hi < lo || hi >= g.cap || n <= 0) continue;
            float mc, lc;
            chunk_stats(sc + i * CH, n, mc, lc);
            if ((tid & 31) == 0) {
                float m = st[6 * i], a, bw;
                fold_weights(m, mc, a, bw);
                st[6 * i] = m; st[6 * i + 1] = folded(st[6 * i + 1], a, lc, bw);
                st[6 * i + 2] = a; st[6 * i + 3] = bw;
            }
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 8; ++r) {  // values: one thread per (query, dim), folded in place
            const int e = tid + NT * r, i = e / g.H, d = e - i * g.H;
            if (i >= nqb) continue;
            int lo, hi;
            query_range(g, past, tb, s0 + i, lo, hi);
            const int j0 = max(lo, c * CH), n = min(hi, c * CH + CH - 1) - j0 + 1;
            if (hi < lo || hi >= g.cap || n <= 0) continue;
            const float* w = sc + i * CH;
            const T* v = vt + (j0 - u0) * ts + d;
            float o = 0.f;
#pragma unroll 8
            for (int jj = 0; jj < n; ++jj) o = fmaf(w[jj], to_f(v[jj * ts]), o);
            acc[r] = folded(acc[r], st[6 * i + 2], o, st[6 * i + 3]);
        }
        __syncthreads();
    }
    const bool use_sink = sinks != nullptr || g.smooth;
    const float sink = sinks ? to_f(sinks[h]) : 0.f;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        const int e = tid + NT * r, i = e / g.H, d = e - i * g.H;
        if (i >= nqb) continue;
        int lo, hi;
        query_range(g, past, tb, s0 + i, lo, hi);
        const bool live = hi >= lo && hi < g.cap;
        out[((long long)(b * g.S + s0 + i) * g.nq + h) * g.H + d] =
            from_f<T>(live ? finish(st[6 * i], st[6 * i + 1], acc[r], use_sink, sink) : 0.f);
    }
}

// The q/k/v values a decode thread loads before it rotates any (one round trip for the whole group
// at up to RQ * NTT values, NTT the decode block size).
#define RQ 4

// The decode step's new query heads (G H values), new key and new value (H each) of one kv head,
// loaded in rounds of RQ values per thread (every load of a round issued before any is used),
// rotated as rope() does and rounded to T: q into qs (floats), and when `last` (the block of the
// chunk holding position p) the key and value into the tile rows kt, vt (as T) and into the cache
// rows krow, vrow.
template <typename T, int NTT>
__device__ __forceinline__ void decode_qkv(const T* qsrc, const T* ksrc, const T* vsrc, float* qs, T* kt, T* vt,
                                           T* krow, T* vrow, const T* cosc, const T* sinc, int do_rotary,
                                           int p, int G, int H, int half_rot, bool last) {
    const int r2 = do_rotary ? 2 * half_rot : 0, nqv = G * H, total = last ? nqv + 2 * H : nqv;
    for (int e0 = threadIdx.x; e0 < total; e0 += RQ * NTT) {
        float x[RQ], y[RQ], c[RQ], sn[RQ];
#pragma unroll
        for (int r = 0; r < RQ; ++r) {  // loads
            const int e = e0 + r * NTT;
            if (e >= total) continue;
            const bool isv = e >= nqv + H;
            const T* src = e < nqv ? qsrc + e - e % H : (isv ? vsrc : ksrc);
            const int d = e < nqv ? e % H : (isv ? e - nqv - H : e - nqv);
            x[r] = to_f(src[d]);
            if (!isv && d < r2) {
                const int i = d < half_rot ? d : d - half_rot;
                y[r] = to_f(src[d < half_rot ? d + half_rot : d - half_rot]);
                c[r] = to_f(cosc[(long long)p * half_rot + i]);
                sn[r] = to_f(sinc[(long long)p * half_rot + i]);
            }
        }
#pragma unroll
        for (int r = 0; r < RQ; ++r) {  // rotation (rope()'s products and sums), stores
            const int e = e0 + r * NTT;
            if (e >= total) continue;
            const bool isv = e >= nqv + H;
            const int d = e < nqv ? e % H : (isv ? e - nqv - H : e - nqv);
            float v = x[r];
            if (!isv && d < r2) {
                if (d < half_rot) v = __fsub_rn(__fmul_rn(v, c[r]), __fmul_rn(y[r], sn[r]));
                else v = __fadd_rn(__fmul_rn(v, c[r]), __fmul_rn(y[r], sn[r]));
            }
            const T t = from_f<T>(v);
            if (e < nqv) qs[e] = to_f(t);
            else if (!isv) { kt[d] = t; krow[d] = t; }
            else { vt[d] = t; vrow[d] = t; }
        }
    }
}


// The hinted prologue of gqa_decode (the common case: no fused q/k norm and the group's q, new k
// and new v in one round of RQ values per thread).  The q/k/v loads do not depend on P_b, so they
// leave right after PDL_ENTER together with the seqlens read; the cos/sin rows and the chunk's
// first round of K/V tiles do depend on P_b, so they are loaded before PDL_ENTER at a guess of
// P_b (`hint`, null to turn the path off, else the seqlens array, read through L2 before the wait: the value this step's mask kernels
// wrote, or the previous step's while they still run) and loaded again after the wait when the
// guess was wrong.
// Same values either way, so the same bits.  QkvRound holds one thread's elements: e = tid + r NTT
// over the G H query values, then the new key's H, then the new value's H.
struct QkvRound { float x[RQ], y[RQ], c[RQ], s[RQ]; };

// Whether the decode prologue of G query heads of H values takes the hinted path at NTT threads.
__host__ __device__ constexpr bool qkv_one_round(int G, int H, int ntt) { return (G + 2) * H <= RQ * ntt; }

// cos/sin at position p of the thread's rotated elements (q and the new key): rope()'s indices.
template <typename T, int NTT>
__device__ __forceinline__ void qkv_trig(QkvRound& q, const T* cosc, const T* sinc, int do_rotary, int p, int G, int H,
                                         int half_rot) {
    const int r2 = do_rotary ? 2 * half_rot : 0, nqv = G * H;
#pragma unroll
    for (int r = 0; r < RQ; ++r) {
        const int e = threadIdx.x + r * NTT;
        if (e >= nqv + H) continue;
        const int d = e < nqv ? e % H : e - nqv;
        if (d < r2) {
            const int i = d < half_rot ? d : d - half_rot;
            q.c[r] = to_f(cosc[(long long)p * half_rot + i]);
            q.s[r] = to_f(sinc[(long long)p * half_rot + i]);
        }
    }
}

// The thread's q, new k and new v values (and each rotated value's rotation partner).
template <typename T, int NTT>
__device__ __forceinline__ void qkv_values(QkvRound& q, const T* qsrc, const T* ksrc, const T* vsrc, int do_rotary,
                                           int G, int H, int half_rot) {
    const int r2 = do_rotary ? 2 * half_rot : 0, nqv = G * H;
#pragma unroll
    for (int r = 0; r < RQ; ++r) {
        const int e = threadIdx.x + r * NTT;
        if (e >= nqv + 2 * H) continue;
        const bool isv = e >= nqv + H;
        const T* src = e < nqv ? qsrc + e - e % H : (isv ? vsrc : ksrc);
        const int d = e < nqv ? e % H : (isv ? e - nqv - H : e - nqv);
        q.x[r] = to_f(src[d]);
        if (!isv && d < r2) q.y[r] = to_f(src[d < half_rot ? d + half_rot : d - half_rot]);
    }
}

// decode_qkv's rotation and stores for the values of qkv_values: q into qs, and when `last` the
// new key and value into the tile rows kt, vt and the cache rows krow, vrow.
template <typename T, int NTT>
__device__ __forceinline__ void qkv_store(const QkvRound& q, float* qs, T* kt, T* vt, T* krow, T* vrow, int do_rotary,
                                          int G, int H, int half_rot, bool last) {
    const int r2 = do_rotary ? 2 * half_rot : 0, nqv = G * H, total = last ? nqv + 2 * H : nqv;
#pragma unroll
    for (int r = 0; r < RQ; ++r) {
        const int e = threadIdx.x + r * NTT;
        if (e >= total) continue;
        const bool isv = e >= nqv + H;
        const int d = e < nqv ? e % H : (isv ? e - nqv - H : e - nqv);
        float v = q.x[r];
        if (!isv && d < r2) {
            if (d < half_rot) v = __fsub_rn(__fmul_rn(v, q.c[r]), __fmul_rn(q.y[r], q.s[r]));
            else v = __fadd_rn(__fmul_rn(v, q.c[r]), __fmul_rn(q.y[r], q.s[r]));
        }
        const T t = from_f<T>(v);
        if (e < nqv) qs[e] = to_f(t);
        else if (!isv) { kt[d] = t; krow[d] = t; }
        else { vt[d] = t; vrow[d] = t; }
    }
}

// The cache rows [j0, j0 + nc) of chunk c for position p (nc without row p itself), or false
// where chunk c is not live for p (gqa_decode's block of chunk c then exits).
__device__ __forceinline__ bool chunk_rows(const Geo& g, int c, int p, int& j0, int& nc) {
    if (!in_cache(g, p)) return false;
    const int lo = g.window > 0 ? max(0, p - g.window + 1) : 0;
    if (c < lo / CH || c > p / CH) return false;
    j0 = max(lo, c * CH);
    const int n = min(p, c * CH + CH - 1) - j0 + 1;
    nc = c == p / CH ? n - 1 : n;
    return true;
}

// Decode (S == 1, not the first prompt): grid (ceil(cap / CH), Nkv, B), block NTT (128 or 256), dynamic smem
// 2 CH DTS T + (G H + G CH + 2 G + 1 + H) floats (G = Nq / Nkv, DTS = dtile_stride).  Block
// (c, kv head, b) computes chunk c of row b for the G query heads of its group (blocks whose chunk
// the row does not have exit).  After the seqlens read, the block's loads (its chunk's K/V rows, q,
// the new k and v) are issued in rounds, each round before any of its values is used.  The block of the last chunk c1 = P_b / CH rotates the new key
// (rounded to T exactly as the cache stores it) and puts it and the new value into its tiles as
// key P_b, and into cache row P_b.  No block reads cache row P_b, so no grid-wide ordering is
// needed for the KV write.  A row with one chunk finishes in its block; otherwise partials go to
// part[b, h, c, H + 2] (m_c, l_c, o_c) and the block that takes the last ticket of
// tickets[b, kv head] folds them in chunk order and resets the ticket to 0.  Scores are one thread
// per (head, key) and values one thread per (head, two adjacent dims): the chains of the header.
// HC: the head size when the launcher knows it at compile time (64 or 128), else 0 (H at run time).
// A compile-time H turns the index arithmetic of every loop over head values (e / H, e % H) into
// shifts and fixes the loops' trip counts; the floating-point operations and their order are the
// same, so the bits are too.
template <typename T, int NTT, int HC>
__global__ void __launch_bounds__(NTT, 1) gqa_decode(const T* __restrict__ qin, const T* __restrict__ kin,
                           const T* __restrict__ vin,
                           T* kc, T* vc, const int* __restrict__ seqlens, const int* hint, const T* cosc,
                           const T* sinc, int do_rotary, const T* sinks, T* out, float* part, int* tickets,
                           const T* qnw, const T* knw, float qeps, float keps,
    int B, int S, int nq, int nkv, int H, int half_rot, int cap, long long q_row, long long k_row, int k_off, int v_off, long long cb, long long cg, long long cj, int first, int window, int smooth, float scale, float softcap, int ring) {
    const Geo g{B, S, nq, nkv, HC > 0 ? HC : H, half_rot, cap, q_row, k_row, k_off, v_off, cb, cg, cj, first, window, smooth, scale, softcap, ring};
    extern __shared__ uint4 sm4[];  // 16-byte aligned: the tiles first
    const int kvh = blockIdx.y, b = blockIdx.z, G = g.nq / g.nkv, tid = threadIdx.x;
    const int nch = gridDim.x, stride = g.H + 2, ts = dtile_stride<T>(g.H);
    int c = blockIdx.x;  // the chunk; a ring's block x takes the x-th chunk of the row's window (below)
    T* kt = reinterpret_cast<T*>(sm4);
    T* vt = kt + CH * ts;
    float* qs = reinterpret_cast<float*>(vt + CH * ts); float* sc = qs + G * g.H; float* stats = sc + G * CH;
    int* flag = (int*)(stats + 2 * G);
    float* kn = (float*)(flag + 1);
    T* kb = kc + b * g.cb + kvh * g.cg;
    T* vb = vc + b * g.cb + kvh * g.cg;
    const T* ksrc = kin + (long long)b * g.k_row + g.k_off + kvh * g.H;
    const T* vsrc = vin + (long long)b * g.k_row + g.v_off + kvh * g.H;
    const T* qsrc = qin + (long long)b * g.q_row + kvh * G * g.H;  // the group's heads are adjacent
    const bool hinted = hint != nullptr && qnw == nullptr && !g.ring && qkv_one_round(G, g.H, NTT);
    TileRound<TU> round0;  // the first round's loads stay in flight while q and the new k are rotated
    QkvRound qv;
    int ph = -1, j0 = 0, nc = 0;
    bool live_h = false;  // the guess names a live chunk for this block
    if (hinted) {  // before PDL_ENTER: a guess of P_b (see QkvRound), cache rows of earlier steps, cos/sin
        ph = __ldcg(hint + b);  // seqlens itself, but for the tests of a wrong guess
        live_h = chunk_rows(g, c, ph, j0, nc);
        if (live_h) {
            tiles_issue<T, TU, NTT>(round0, kb + (long long)j0 * g.cj, vb + (long long)j0 * g.cj, g.cj, nc, g.H, tid);
            qkv_trig<T, NTT>(qv, cosc, sinc, do_rotary, ph, G, g.H, g.half_rot);
        }
    }
    PDL_ENTER();
    const int p = seqlens[b];
    // with the seqlens read, but only in blocks the guess keeps: most chunks of a row are past P_b,
    // and their blocks must exit at once, not wait on loads (measured: 6-12% of a step at 16-32 rows)
    if (live_h) qkv_values<T, NTT>(qv, qsrc, ksrc, vsrc, do_rotary, G, g.H, g.half_rot);
    const int lo = g.window > 0 ? max(0, p - g.window + 1) : 0;
    T* ob = out + ((long long)b * g.nq + kvh * G) * g.H;  // the group's G heads are adjacent
    if (!in_cache(g, p)) {
        if (c == 0) for (int i = tid; i < G * g.H; i += NTT) ob[i] = from_f<T>(0.f);
        return;
    }
    const int c0 = lo / CH, c1 = p / CH;
    const int pc0 = g.ring ? c0 : 0;  // the partials' chunk index is c - pc0 (a ring's grid spans its window)
    c += pc0;
    if (c < c0 || c > c1) return;
    const int n = min(p, c * CH + CH - 1) - max(lo, c * CH) + 1;
    const bool last = c == c1;
    const int jn = n - 1;  // tile row of key P_b (last)
    if (!hinted || p != ph) {  // no guess, or a wrong one: this block's rows and cos/sin at p now
        chunk_rows(g, c, p, j0, nc);
        tiles_issue<T, TU, NTT>(round0, kb + slot(g, j0) * g.cj, vb + slot(g, j0) * g.cj, g.cj, nc, g.H, tid,
                                wrap_rows(g, j0), g.ring);
        if (hinted) qkv_trig<T, NTT>(qv, cosc, sinc, do_rotary, p, G, g.H, g.half_rot);
        if (hinted && !live_h) qkv_values<T, NTT>(qv, qsrc, ksrc, vsrc, do_rotary, G, g.H, g.half_rot);
    }
    if (hinted) {
        qkv_store<T, NTT>(qv, qs, kt + jn * ts, vt + jn * ts, kb + slot(g, p) * g.cj, vb + slot(g, p) * g.cj,
                          do_rotary, G, g.H, g.half_rot, last);
    } else if (qnw != nullptr) {  // fused q/k norm (the block's whole grid takes this branch): synchronises
        norm_rope<T, NTT>(ksrc, kn, knw, keps, cosc, sinc, p, g.H, g.half_rot, 1, do_rotary);
        norm_rope<T, NTT>(qsrc, qs, qnw, qeps, cosc, sinc, p, g.H, g.half_rot, G, do_rotary);
        if (last) {
            for (int d = tid; d < g.H; d += NTT) {
                const T kv = from_f<T>(kn[d]), vv = vsrc[d];
                kt[jn * ts + d] = kv; kb[slot(g, p) * g.cj + d] = kv;
                vt[jn * ts + d] = vv; vb[slot(g, p) * g.cj + d] = vv;
            }
        }
    } else {
        decode_qkv<T, NTT>(qsrc, ksrc, vsrc, qs, kt + jn * ts, vt + jn * ts, kb + slot(g, p) * g.cj,
                      vb + slot(g, p) * g.cj, cosc, sinc, do_rotary, p, G, g.H, g.half_rot, last);
    }
    tiles_store<T, TU, NTT>(round0, kt, vt, nc, g.H, ts, tid);
    load_tiles<T, TU, NTT>(kt, kb + slot(g, j0) * g.cj, vt, vb + slot(g, j0) * g.cj, g.cj, nc, g.H, ts,
                           tid + TU * NTT, wrap_rows(g, j0), g.ring);
    __syncthreads();
    for (int i = tid; i < G * n; i += NTT) {  // scores: one thread per (head, key)
        const int hh = i / n, jj = i - hh * n;
        sc[hh * CH + jj] = scaled(dot_row(qs + hh * g.H, kt + jj * ts, g.H), g);
    }
    __syncthreads();
    const int warp = tid >> 5;
    for (int hh = warp; hh < G; hh += NTT / 32) {
        float mc, lc;
        chunk_stats(sc + hh * CH, n, mc, lc);
        if ((tid & 31) == 0) { stats[2 * hh] = mc; stats[2 * hh + 1] = lc; }
    }
    __syncthreads();
    float* oc = qs;  // q is no longer needed
    for (int i = tid; i < G * g.H / 2; i += NTT) {  // values: one thread per (head, dims d and d + 1)
        const int e = 2 * i, hh = e / g.H, d = e - hh * g.H;
        const float* w = sc + hh * CH;
        const T* v = vt + d;
        float a0 = 0.f, a1 = 0.f;
#pragma unroll 8
        for (int jj = 0; jj < n; ++jj) {
            const float2 x = pair_f(v + jj * ts);
            a0 = fmaf(w[jj], x.x, a0);
            a1 = fmaf(w[jj], x.y, a1);
        }
        oc[e] = a0; oc[e + 1] = a1;
    }
    __syncthreads();
    const bool use_sink = sinks != nullptr || g.smooth;
    if (c0 == c1) {  // one chunk: the fold of a single chunk is (m_c, l_c, o_c) itself
        for (int i = tid; i < G * g.H; i += NTT) {
            const int hh = i / g.H;
            const float sink = sinks ? to_f(sinks[kvh * G + hh]) : 0.f;
            ob[i] = from_f<T>(finish(stats[2 * hh], stats[2 * hh + 1], oc[i], use_sink, sink));
        }
        return;
    }
    float* pb = part + ((long long)b * g.nq + kvh * G) * nch * stride;  // [G, nch, H + 2]
    for (int i = tid; i < G * g.H; i += NTT) {
        const int hh = i / g.H, d = i - hh * g.H;
        pb[((long long)hh * nch + c - pc0) * stride + 2 + d] = oc[i];
    }
    if (tid < G) {
        pb[((long long)tid * nch + c - pc0) * stride] = stats[2 * tid];
        pb[((long long)tid * nch + c - pc0) * stride + 1] = stats[2 * tid + 1];
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const int t = atomicAdd(tickets + b * g.nkv + kvh, 1);
        *flag = t == c1 - c0;
        if (*flag) tickets[b * g.nkv + kvh] = 0;  // every block of this launch has taken its ticket
    }
    __syncthreads();
    if (!*flag) return;
    __threadfence();
    for (int i = tid; i < G * g.H; i += NTT) {
        const int hh = i / g.H, d = i - hh * g.H;
        const float* ph = pb + (long long)hh * nch * stride;
        float m = NEG_INF, l = 0.f, acc = 0.f;
        for (int cc0 = c0; cc0 <= c1; cc0 += 8) {  // 8 chunks' loads in flight, folded in order
            float pm[8], pl[8], po[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const bool ok = cc0 + u <= c1;
                const float* q = ph + (long long)(cc0 + u - pc0) * stride;
                pm[u] = ok ? __ldcg(q) : 0.f;
                pl[u] = ok ? __ldcg(q + 1) : 0.f;
                po[u] = ok ? __ldcg(q + 2 + d) : 0.f;
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                if (cc0 + u > c1) break;
                float a, bw;
                fold_weights(m, pm[u], a, bw);
                l = folded(l, a, pl[u], bw);
                acc = folded(acc, a, po[u], bw);
            }
        }
        const float sink = sinks ? to_f(sinks[kvh * G + hh]) : 0.f;
        ob[i] = from_f<T>(finish(m, l, acc, use_sink, sink));
    }
}

// A prompt into a ring (sliding_window_cache=1, docs/kv-geometry.md): the launcher runs
// gqa_kv_write and gqa_attn on a staging cache of S positions (their ring = 0), then this kernel
// copies each row's resident positions into the ring: position s of row b goes to slot s mod ring
// when T_b - ring <= s < T_b (pad positions s >= T_b are not copied: they would overwrite live
// slots).  Grid (S, Nkv, B), block NT; the staging and ring strides are each cache's (cb, cg, cj).
template <typename T>
__global__ void gqa_ring_store(const T* __restrict__ ks, const T* __restrict__ vs, T* kc, T* vc,
                               const int* __restrict__ seqlens, int H, int ring, long long sb, long long sg,
                               long long sj, long long cb, long long cg, long long cj) {
    PDL_ENTER();
    const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tb = seqlens[b] + 1;
    if (s >= tb || s < tb - ring) return;
    const long long src = b * sb + h * sg + s * sj, dst = b * cb + h * cg + (long long)(s % ring) * cj;
    for (int d = threadIdx.x; d < H; d += NT) {
        kc[dst + d] = ks[src + d];
        vc[dst + d] = vs[src + d];
    }
}

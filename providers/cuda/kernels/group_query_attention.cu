// GroupQueryAttention (com.microsoft), docs/ops.md 1.3: RoPE on Q and K, KV write into the shared
// cache, causal softmax attention.  Packed QKV [B, S, (Nq + 2 Nkv) H] or separate q/k/v.
//
// Per row b: T_b = seqlens_k[b] + 1 read from DEVICE memory (never copied to the host);
// P_b = 0 for the first prompt (S == total, decided on the host from shapes), else T_b - S.
// Query row s sits at p = P_b + s and attends to keys j in [lo, min(p, T_b - 1)]
// (lo = p - W + 1 with a local window W, else 0).
//
// Batch invariance: the grid is (S, heads, B) or (Nkv, B); blocks whose row has nothing to do
// exit; nothing depends on B, on the capacity or on total_sequence_length except the grid
// size.  For one (b, head, p) the arithmetic is fixed by H and by the key index alone:
//   score z_j: lane l of the warp owning key j (4 consecutive keys per warp) sums q[d] k[d] for d = l, l + 32, ... (fmaf,
//     ascending), then a fixed xor-shuffle tree; lane 0's value is used.
//   max: exact.  e_j = expf(z_j - m).  denominator: thread t sums e_j for j = lo + t + 128 i
//     ascending, then a fixed xor tree per warp and the 4 warp sums added in order.
//   output dim d: slot u (of 128 / H slots) sums e_j v_j[d] over j = lo + u + slots i
//     ascending (fmaf); slots added in ascending order; divided by the denominator.
// Geometry scalars are passed one by one (GEO_ARGS order) and gathered in a Geo struct.
// Block size is always 128 threads.  Q and K are rotated in fp32 and rounded to T before use
// (the cache holds T), as cpu_reference does.
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
};

// Rotate head vector x (H elements of T at src) at position pos, rounded to T, into dst (T or float).
template <typename T, typename D>
__device__ void rope(const T* src, D* dst, const T* cosc, const T* sinc, int pos, int H, int half_rot, int tid, int nt) {
    const int r = 2 * half_rot;
    for (int d = tid; d < H; d += nt) {
        float v = to_f(src[d]);
        if (d < r) {
            const int i = d < half_rot ? d : d - half_rot;
            const float c = to_f(cosc[(long long)pos * half_rot + i]), s = to_f(sinc[(long long)pos * half_rot + i]);
            if (d < half_rot) v = __fsub_rn(__fmul_rn(v, c), __fmul_rn(to_f(src[d + half_rot]), s));
            else v = __fadd_rn(__fmul_rn(v, c), __fmul_rn(to_f(src[d - half_rot]), s));
        }
        dst[d] = (D)to_f(from_f<T>(v));
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

// Attention of one query (qs: H floats in shared memory) over keys [lo, hi] of one kv head.
// sc: shared scratch of (hi - lo + 1) floats; red: shared scratch of 2 * NT floats.
template <typename T>
__device__ void attend(const float* qs, const T* kc, const T* vc, long long cj, int lo, int hi, int H,
                       const Geo& g, float sink, bool use_sink, float* sc, float* red, T* out,
                       int jnew = -1, const float* knew = nullptr, const float* vnew = nullptr) {
    // jnew >= 0: key/value row jnew is taken from knew/vnew (shared, the same T-rounded values
    // the cache holds) instead of the cache, so decode blocks need not wait for the KV write.
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n = hi - lo + 1;
    // 4 keys per warp iteration: all loads issued first (the arithmetic per key is unchanged)
    for (int j0 = warp * 4; j0 < n; j0 += NT / 32 * 4) {
        float kv[4][8];
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int d = lane + 32 * i;
                kv[u][i] = (j0 + u < n && d < H)
                    ? (lo + j0 + u == jnew ? knew[d] : to_f(kc[(long long)(lo + j0 + u) * cj + d])) : 0.f;
            }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) if (lane + 32 * i < H) s = fmaf(qs[lane + 32 * i], kv[u][i], s);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
            s = __shfl_sync(0xffffffffu, s, 0);
            if (lane == 0 && j0 + u < n) {
                float z = __fmul_rn(s, g.scale);
                if (g.softcap > 0.f) z = __fmul_rn(g.softcap, tanhf(__fdiv_rn(z, g.softcap)));
                sc[j0 + u] = z;
            }
        }
    }
    __syncthreads();
    float m = NEG_INF;
    for (int jj = tid; jj < n; jj += NT) m = fmaxf(m, sc[jj]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    if (use_sink) m = fmaxf(m, sink);
    if (!finite_f(m)) m = 0.f;
    __syncthreads();
    float l = 0.f;
    for (int jj = tid; jj < n; jj += NT) { const float e = expf(__fsub_rn(sc[jj], m)); sc[jj] = e; l = __fadd_rn(l, e); }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, o));
    l = __shfl_sync(0xffffffffu, l, 0);
    if (lane == 0) red[NT + warp] = l;
    __syncthreads();
    float denom = __fadd_rn(__fadd_rn(__fadd_rn(red[NT], red[NT + 1]), red[NT + 2]), red[NT + 3]);
    if (use_sink) denom = __fadd_rn(denom, expf(__fsub_rn(sink, m)));
    const int slots = H <= NT ? NT / H : 1;
    for (int d0 = 0; d0 < H; d0 += NT) {
        const int d = d0 + (H <= NT ? tid % H : tid), u = H <= NT ? tid / H : 0;
        float acc = 0.f;
        if (u < slots && d < H)
        {
            int jj = u;
            for (; jj + 7 * slots < n; jj += 8 * slots) {  // loads first, same fmaf order
                float v[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) v[i] = lo + jj + i * slots == jnew ? vnew[d] : to_f(vc[(long long)(lo + jj + i * slots) * cj + d]);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc = fmaf(sc[jj + i * slots], v[i], acc);
            }
            for (; jj < n; jj += slots) acc = fmaf(sc[jj], lo + jj == jnew ? vnew[d] : to_f(vc[(long long)(lo + jj) * cj + d]), acc);
        }
        __syncthreads();
        if (u < slots && d < H) red[u * (H <= NT ? H : NT) + (d - d0)] = acc;
        __syncthreads();
        if (tid < H - d0 && tid < NT) {
            float o = 0.f;
            for (int v = 0; v < slots; ++v) o = __fadd_rn(o, red[v * (H <= NT ? H : NT) + tid]);
            out[d0 + tid] = from_f<T>(denom > 0.f ? __fdiv_rn(o, denom) : 0.f);
        }
        __syncthreads();
    }
}

// Prefill KV write: grid (S, Nkv, B), block NT.  Rotated K and V of token (b, s) -> cache row P_b + s.
template <typename T>
__global__ void gqa_kv_write(const T* __restrict__ kin, const T* __restrict__ vin, T* kc, T* vc,
                             const int* __restrict__ seqlens, const T* cosc, const T* sinc, int do_rotary,
    int B, int S, int nq, int nkv, int H, int half_rot, int cap, long long q_row, long long k_row, int k_off, int v_off, long long cb, long long cg, long long cj, int first, int window, int smooth, float scale, float softcap) {
    const Geo g{B, S, nq, nkv, H, half_rot, cap, q_row, k_row, k_off, v_off, cb, cg, cj, first, window, smooth, scale, softcap};
    const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int past = g.first ? 0 : seqlens[b] + 1 - g.S, row = past + s;
    if (row < 0 || row >= g.cap) return;
    const T* ksrc = kin + (long long)(b * g.S + s) * g.k_row + g.k_off + h * g.H;
    const T* vsrc = vin + (long long)(b * g.S + s) * g.k_row + g.v_off + h * g.H;
    T* kd = kc + b * g.cb + h * g.cg + (long long)row * g.cj;
    T* vd = vc + b * g.cb + h * g.cg + (long long)row * g.cj;
    if (do_rotary) rope_t<T>(ksrc, kd, cosc, sinc, row, g.H, g.half_rot, threadIdx.x, NT);
    else for (int d = threadIdx.x; d < g.H; d += NT) kd[d] = ksrc[d];
    for (int d = threadIdx.x; d < g.H; d += NT) vd[d] = vsrc[d];
}

// Prefill attention: grid (S, Nq, B), block NT, dynamic smem (H + 2 NT + cap) floats.
template <typename T>
__global__ void gqa_attn(const T* __restrict__ qin, const T* kc, const T* vc, const int* __restrict__ seqlens,
                         const T* cosc, const T* sinc, int do_rotary, const T* sinks, T* out,
    int B, int S, int nq, int nkv, int H, int half_rot, int cap, long long q_row, long long k_row, int k_off, int v_off, long long cb, long long cg, long long cj, int first, int window, int smooth, float scale, float softcap) {
    const Geo g{B, S, nq, nkv, H, half_rot, cap, q_row, k_row, k_off, v_off, cb, cg, cj, first, window, smooth, scale, softcap};
    extern __shared__ float sm[];
    float* qs = sm; float* red = sm + g.H; float* sc = red + 2 * NT;
    const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / (g.nq / g.nkv);
    const int tb = seqlens[b] + 1, past = g.first ? 0 : tb - g.S, p = past + s;
    const int hi = min(p, tb - 1), lo = g.window > 0 ? max(0, p - g.window + 1) : 0;
    T* o = out + ((long long)(b * g.S + s) * g.nq + h) * g.H;
    if (hi < lo || hi >= g.cap) {
        for (int d = threadIdx.x; d < g.H; d += NT) o[d] = from_f<T>(0.f);
        return;
    }
    const T* qsrc = qin + (long long)(b * g.S + s) * g.q_row + h * g.H;
    if (do_rotary) rope<T, float>(qsrc, qs, cosc, sinc, p, g.H, g.half_rot, threadIdx.x, NT);
    else for (int d = threadIdx.x; d < g.H; d += NT) qs[d] = to_f(qsrc[d]);
    __syncthreads();
    const bool use_sink = sinks != nullptr || g.smooth;
    const float sink = sinks ? to_f(sinks[h]) : 0.f;
    attend<T>(qs, kc + b * g.cb + kvh * g.cg, vc + b * g.cb + kvh * g.cg, g.cj, lo, hi, g.H, g, sink, use_sink, sc, red, o);
}

// Decode (S == 1, not the first prompt): grid (Nq, B), block NT, dynamic smem
// (3 H + 2 NT + cap) floats.  One block per (row b, query head h).  Every block rotates the new
// key of its kv head itself (into shared memory, rounded to T exactly as the cache stores it) and
// uses it and the new value for key P_b = seqlens_k[b]; the first query head of each group also
// writes them into the cache row P_b.  No block reads cache row P_b, so no grid-wide ordering is
// needed, and the arithmetic is that of the prefill path (write, then attend) bit for bit.
template <typename T>
__global__ void gqa_decode(const T* __restrict__ qin, const T* __restrict__ kin, const T* __restrict__ vin,
                           T* kc, T* vc, const int* __restrict__ seqlens, const T* cosc, const T* sinc,
                           int do_rotary, const T* sinks, T* out,
    int B, int S, int nq, int nkv, int H, int half_rot, int cap, long long q_row, long long k_row, int k_off, int v_off, long long cb, long long cg, long long cj, int first, int window, int smooth, float scale, float softcap) {
    const Geo g{B, S, nq, nkv, H, half_rot, cap, q_row, k_row, k_off, v_off, cb, cg, cj, first, window, smooth, scale, softcap};
    extern __shared__ float sm[];
    float* qs = sm; float* kn = sm + g.H; float* vn = kn + g.H; float* red = vn + g.H; float* sc = red + 2 * NT;
    const int h = blockIdx.x, b = blockIdx.y, group = g.nq / g.nkv, kvh = h / group;
    const int p = seqlens[b];
    const int lo = g.window > 0 ? max(0, p - g.window + 1) : 0;
    T* o = out + ((long long)b * g.nq + h) * g.H;
    if (p < 0 || p >= g.cap) {
        for (int d = threadIdx.x; d < g.H; d += NT) o[d] = from_f<T>(0.f);
        return;
    }
    T* kb = kc + b * g.cb + kvh * g.cg;
    T* vb = vc + b * g.cb + kvh * g.cg;
    const T* ksrc = kin + (long long)b * g.k_row + g.k_off + kvh * g.H;
    const T* vsrc = vin + (long long)b * g.k_row + g.v_off + kvh * g.H;
    if (do_rotary) rope<T, float>(ksrc, kn, cosc, sinc, p, g.H, g.half_rot, threadIdx.x, NT);
    else for (int d = threadIdx.x; d < g.H; d += NT) kn[d] = to_f(ksrc[d]);
    for (int d = threadIdx.x; d < g.H; d += NT) vn[d] = to_f(vsrc[d]);
    const T* qsrc = qin + (long long)b * g.q_row + h * g.H;
    if (do_rotary) rope<T, float>(qsrc, qs, cosc, sinc, p, g.H, g.half_rot, threadIdx.x, NT);
    else for (int d = threadIdx.x; d < g.H; d += NT) qs[d] = to_f(qsrc[d]);
    __syncthreads();
    if (h % group == 0) {
        for (int d = threadIdx.x; d < g.H; d += NT) {
            kb[(long long)p * g.cj + d] = from_f<T>(kn[d]);
            vb[(long long)p * g.cj + d] = vsrc[d];
        }
    }
    const bool use_sink = sinks != nullptr || g.smooth;
    attend<T>(qs, kb, vb, g.cj, lo, p, g.H, g, sinks ? to_f(sinks[h]) : 0.f, use_sink, sc, red, o, p, kn, vn);
}

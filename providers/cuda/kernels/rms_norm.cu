// SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization (docs/ops.md 3.1, 3.2).
// One block of 256 threads per row, always (never a block size chosen by the number of rows).
// Reduction order of sum(v^2), fixed by D alone: thread t adds v[d]^2 (fmaf) for
// d = t, t + 256, ... ascending; a fixed xor-shuffle tree per warp (lane 0's value); the 8
// warp sums added in ascending order.  inv = 1 / sqrtf(sum / D + eps); y = (v * inv) * gamma.
// Skip variant: v = input + skip[i % skip_size] (+ bias) in fp32; output 3 is v rounded to T.
#include <cuda_fp16.h>

#define NT 256
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

__device__ __forceinline__ float block_sum(float s, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
    s = __shfl_sync(0xffffffffu, s, 0);
    if (lane == 0) red[warp] = s;
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) t = __fadd_rn(t, red[w]);
    return t;
}

// x, skip, bias: T; gamma: TG; y: TG.  skip/bias/sum_out/mean_out/inv_out may be null.
// Shared memory: D floats (v) + 8.
template <typename T, typename TG>
__global__ void rms_norm(const T* __restrict__ x, const T* __restrict__ skip, long long skip_size,
                         const T* __restrict__ bias, const TG* __restrict__ gamma, TG* __restrict__ y,
                         T* __restrict__ sum_out, float* mean_out, float* inv_out, int D, float eps) {
    PDL_ENTER();
    extern __shared__ float sm[];
    float* red = sm;
    float* v = sm + 32;
    const long long row = blockIdx.x;
    const long long base = row * D;
    // skip rows: skip_size a multiple of D (a [.., D] skip broadcast over rows) puts row r's skip
    // at (r D) % skip_size, one 64-bit modulo per row; any other size takes it per element
    const long long sbase = skip_size > 0 && skip_size % D == 0 ? base % skip_size : -1;
    // Each thread's values v[d], d = t + 256 u, are loaded U at a time before any is used (one
    // memory round trip per U of them, not one each); the fmaf chain still walks d ascending.
    constexpr int U = 8;
    float ss = 0.f;
    for (int d0 = threadIdx.x; d0 < D; d0 += NT * U) {
        float t[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int d = d0 + u * NT;
            t[u] = 0.f;
            if (d < D) {
                t[u] = to_f(x[base + d]);
                if (skip) t[u] = __fadd_rn(t[u], to_f(skip[sbase >= 0 ? sbase + d : (base + d) % skip_size]));
                if (bias) t[u] = __fadd_rn(t[u], to_f(bias[d]));
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int d = d0 + u * NT;
            if (d < D) {
                v[d] = t[u];
                ss = fmaf(t[u], t[u], ss);
                if (sum_out) store(sum_out + base + d, t[u]);
            }
        }
    }
    const float total = block_sum(ss, red);
    const float inv = __fdiv_rn(1.f, sqrtf(__fadd_rn(__fdiv_rn(total, (float)D), eps)));
    for (int d = threadIdx.x; d < D; d += NT) store(y + base + d, __fmul_rn(__fmul_rn(v[d], inv), to_f(gamma[d])));
    if (threadIdx.x == 0) {
        if (inv_out) inv_out[row] = inv;
        if (mean_out) mean_out[row] = 0.f;
    }
}

// rms_norm_h8<V>: fp16 rows of D % 8 == 0 values (every fp16 model here), bitwise
// rms_norm<__half, __half>: the same v, sum chains, tree, inv and y, only loaded and stored
// differently.  Thread t owns the 8-value pieces q = t, t + 256, ..., at most V of them (V = 1
// serves D <= 2,048, V = 4 D <= 8,192).  x, skip, bias and gamma arrive as 16-byte loads, all
// issued before any is used: one memory round trip, where rms_norm reads gamma in a second one
// after the sum.  v goes to shared memory so that thread t still walks its chain over d = t,
// t + 256, ... ascending; y and the residual sum leave as 16-byte stores.  Needs 16-byte aligned
// pointers and skip_size a multiple of D.
__device__ __forceinline__ uint4 ld16(const __half* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

template <int V>
__global__ void rms_norm_h8(const __half* __restrict__ x, const __half* __restrict__ skip, long long skip_size,
                            const __half* __restrict__ bias, const __half* __restrict__ gamma, __half* __restrict__ y,
                            __half* __restrict__ sum_out, float* mean_out, float* inv_out, int D, float eps) {
    // the skip row's offset before the wait (it reads no memory); the 64-bit remainder, a long
    // software division, only for a broadcast skip shorter than x
    const long long row = blockIdx.x, base = row * D;
    const long long sbase = !skip ? 0 : base < skip_size ? base : base % skip_size;
    PDL_ENTER();
    extern __shared__ float sm[];
    float* red = sm;
    float* v = sm + 32;
    const int nv = D >> 3;
    // every load is unconditional (a piece past the row re-reads the last one; a missing skip or
    // bias reads x) so that the compiler issues them back to back
    const __half* xp = x + base;
    const __half* sp = skip ? skip + sbase : xp;
    const __half* bp = bias ? bias : xp;
    uint4 xr[V], sr[V], br[V], gr[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int d = 8 * min((int)threadIdx.x + i * NT, nv - 1);
        xr[i] = ld16(xp + d);
        sr[i] = ld16(sp + d);
        br[i] = ld16(bp + d);
        gr[i] = ld16(gamma + d);
    }
    float t[V][8];
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int q = threadIdx.x + i * NT;
        if (q < nv) {
            const __half* xh = reinterpret_cast<const __half*>(&xr[i]);
            const __half* sh = reinterpret_cast<const __half*>(&sr[i]);
            const __half* bh = reinterpret_cast<const __half*>(&br[i]);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                t[i][e] = __half2float(xh[e]);
                if (skip) t[i][e] = __fadd_rn(t[i][e], __half2float(sh[e]));
                if (bias) t[i][e] = __fadd_rn(t[i][e], __half2float(bh[e]));
            }
            float4* vp = reinterpret_cast<float4*>(v + 8 * q);
            vp[0] = make_float4(t[i][0], t[i][1], t[i][2], t[i][3]);
            vp[1] = make_float4(t[i][4], t[i][5], t[i][6], t[i][7]);
            if (sum_out) {
                uint4 o;
                __half2* oh = reinterpret_cast<__half2*>(&o);
#pragma unroll
                for (int e = 0; e < 4; ++e) oh[e] = __floats2half2_rn(t[i][2 * e], t[i][2 * e + 1]);
                *reinterpret_cast<uint4*>(sum_out + base + 8 * q) = o;
            }
        }
    }
    __syncthreads();
    float ss = 0.f;
    for (int d = threadIdx.x; d < D; d += NT) ss = fmaf(v[d], v[d], ss);
    const float total = block_sum(ss, red);
    const float inv = __fdiv_rn(1.f, sqrtf(__fadd_rn(__fdiv_rn(total, (float)D), eps)));
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int q = threadIdx.x + i * NT;
        if (q < nv) {
            const __half* gh = reinterpret_cast<const __half*>(&gr[i]);
            uint4 o;
            __half2* oh = reinterpret_cast<__half2*>(&o);
#pragma unroll
            for (int e = 0; e < 4; ++e)
                oh[e] = __floats2half2_rn(__fmul_rn(__fmul_rn(t[i][2 * e], inv), __half2float(gh[2 * e])),
                                          __fmul_rn(__fmul_rn(t[i][2 * e + 1], inv), __half2float(gh[2 * e + 1])));
            *reinterpret_cast<uint4*>(y + base + 8 * q) = o;
        }
    }
    if (threadIdx.x == 0) {
        if (inv_out) inv_out[row] = inv;
        if (mean_out) mean_out[row] = 0.f;
    }
}

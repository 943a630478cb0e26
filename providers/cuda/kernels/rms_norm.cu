// SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization (docs/ops.md 3.1, 3.2).
// One block of 256 threads per row, always (never a block size chosen by the number of rows).
// Reduction order of sum(v^2), fixed by D alone: kernels/rms_order.cuh (16-value group sums,
// four lane sums of groups, a fixed pair tree), the order every kernel that normalises a row
// follows (the projection epilogue and prologue of lockstep.MatMulNormMatMul among them).
// inv = 1 / sqrtf(sum / D + eps); y = (v * inv) * gamma.
// Skip variant: v = input + skip[i % skip_size] (+ bias) in fp32; output 3 is v rounded to T.
#include <cuda_fp16.h>

#define NT 256
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

// sum(v^2) of the block's row in the order of kernels/rms_order.cuh, v [D] in shared memory
// (written before the call; the call starts with a barrier).  grp: rms_groups(D) floats of
// shared memory.  Every thread returns the total.
__device__ __forceinline__ float row_sum_squares(const float* v, int D, float* grp) {
    const int P = rms_groups(D);
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += NT) grp[p] = rms_group_sum(v, D, p);
    __syncthreads();
    return rms_total_of(grp, P);
}

// x, skip, bias: T; gamma: TG; y: TG.  skip/bias/sum_out/mean_out/inv_out may be null.
// Shared memory: 32 + D + rms_groups(D) + 4 floats (v, then the group and lane sums).
template <typename T, typename TG>
__global__ void rms_norm(const T* __restrict__ x, const T* __restrict__ skip, long long skip_size,
                         const T* __restrict__ bias, const TG* __restrict__ gamma, TG* __restrict__ y,
                         T* __restrict__ sum_out, float* mean_out, float* inv_out, int D, float eps) {
    PDL_ENTER();
    extern __shared__ float sm[];
    float* v = sm + 32;
    float* grp = v + D;
    const long long row = blockIdx.x;
    const long long base = row * D;
    // skip rows: skip_size a multiple of D (a [.., D] skip broadcast over rows) puts row r's skip
    // at (r D) % skip_size, one 64-bit modulo per row; any other size takes it per element
    const long long sbase = skip_size > 0 && skip_size % D == 0 ? base % skip_size : -1;
    // Each thread's values v[d], d = t + 256 u, are loaded U at a time before any is used (one
    // memory round trip per U of them, not one each).
    constexpr int U = 8;
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
                if (sum_out) store(sum_out + base + d, t[u]);
            }
        }
    }
    const float inv = rms_inv(row_sum_squares(v, D, grp), D, eps);
    for (int d = threadIdx.x; d < D; d += NT) store(y + base + d, __fmul_rn(__fmul_rn(v[d], inv), to_f(gamma[d])));
    if (threadIdx.x == 0) {
        if (inv_out) inv_out[row] = inv;
        if (mean_out) mean_out[row] = 0.f;
    }
}

// rms_norm_h8<V>: fp16 rows of D % 8 == 0 values (every fp16 model here), bitwise
// rms_norm<__half, __half>: the same v, sums, inv and y, only loaded and stored differently.
// Thread t owns the 8-value pieces q = t, t + 256, ..., at most V of them (V = 1 serves
// D <= 2,048, V = 4 D <= 8,192).  x, skip, bias and gamma arrive as 16-byte loads, all issued
// before any is used: one memory round trip, where rms_norm reads gamma in a second one after the
// sum.  The group sums are made in registers (a group is the pieces of two neighbouring lanes) and
// meet in shared memory behind one barrier; y and the residual sum leave as 16-byte stores.  Needs 16-byte aligned
// pointers and skip_size a multiple of D.
__device__ __forceinline__ uint4 ld16(const __half* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

template <int V>
__global__ void rms_norm_h8(const __half* __restrict__ x, const __half* __restrict__ skip, long long skip_size,
                            const __half* __restrict__ bias, const __half* __restrict__ gamma, __half* __restrict__ y,
                            __half* __restrict__ sum_out, float* mean_out, float* inv_out, int D, float eps) {
    PDL_ENTER();
    extern __shared__ float sm[];
    float* grp = sm + 32;
    const long long row = blockIdx.x, base = row * D;
    const long long sbase = skip ? base % skip_size : 0;
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
#pragma unroll
        for (int e = 0; e < 8; ++e) t[i][e] = 0.f;  // pieces past the row add exact zeros below
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
            if (sum_out) {
                uint4 o;
                __half2* oh = reinterpret_cast<__half2*>(&o);
#pragma unroll
                for (int e = 0; e < 4; ++e) oh[e] = __floats2half2_rn(t[i][2 * e], t[i][2 * e + 1]);
                *reinterpret_cast<uint4*>(sum_out + base + 8 * q) = o;
            }
        }
    }
    // group p = pieces 2p and 2p + 1, held by neighbouring lanes: the odd lane's values go to the
    // even one, which walks the group's fmaf chain over all 16 (fmaf(0, 0, s) == s for the zeros)
#pragma unroll
    for (int i = 0; i < V; ++i) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) s = fmaf(t[i][e], t[i][e], s);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float o = __shfl_down_sync(0xffffffffu, t[i][e], 1);
            s = fmaf(o, o, s);
        }
        const int q = threadIdx.x + i * NT;
        if ((q & 1) == 0 && q < nv) grp[q >> 1] = s;
    }
    __syncthreads();
    const float inv = rms_inv(rms_total_of(grp, rms_groups(D)), D, eps);
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

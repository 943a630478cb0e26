// Mixture of experts (com.microsoft MoE / QMoE, docs/moe.md), four kernels per node call:
//   moe_route: top-k routing of each token row on the device (softmax over E experts, the k
//              largest p by descending p, a tie to the larger expert index; weights optionally
//              divided by their rank-order sum)                     -> experts int32 [T, k], weights fp32 [T, k]
//   moe_up:    per routed (row, slot) pair: h = x W1[e]^T + b1[e], the activation -> a fp32 [T*k, I]
//   moe_down:  per routed (row, slot) pair: y = a W2[e]^T + b2[e]                 -> y fp32 [T*k, H]
//   moe_mix:   out[t] = sum_j w[t, j] y[t, j], j = 0..k-1 in rank order, fp32, rounded once to T.
// The grids cover rows x k and read the expert index from device memory, so the launch shapes
// depend on T and k only (static inside a captured step, no host sync).  Every output element
// is one warp's dot product with a fixed K order (lane l sums columns l, l + 32, ... with fmaf,
// then a fixed xor-shuffle tree), so a row's bits never depend on the other rows of the batch
// or on which of them chose the same expert (batch invariance).
// Weights: BITS = 0 dense T [E, N, K]; BITS = 2/4/8 uint8 codes [E, N, K*BITS/8], least
// significant bits first along K, dequantised as (q - zp) * scale with scales T [E, N, K/block]
// and zero points uint8 [E, N, ceil(K/block*BITS/8)] (absent: 2^(BITS-1)).
// The activations (moe_act, moe_swiglu) are kernels/moe_act.cuh's, prepended to this file.
#include <cuda_fp16.h>

__device__ __forceinline__ float moe_f(float x) { return x; }
__device__ __forceinline__ float moe_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void moe_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void moe_store(__half* p, float v) { *p = __float2half_rn(v); }

// Element (row, col) of expert e's projection, in fp32.
template <typename T, int BITS>
__device__ __forceinline__ float moe_weight(const void* w, const T* scales, const unsigned char* zp, int e,
                                            long long n, long long k, int block, long long row, long long col) {
    const long long r = (long long)e * n + row;
    if constexpr (BITS == 0) {
        return moe_f(static_cast<const T*>(w)[r * k + col]);
    } else {
        const unsigned char* q = static_cast<const unsigned char*>(w);
        const long long bit = col * BITS;
        const int mask = (1 << BITS) - 1;
        const int code = (q[r * (k * BITS / 8) + (bit >> 3)] >> (bit & 7)) & mask;
        const long long blocks = k / block, b = col / block;
        float z = (float)(1 << (BITS - 1));
        if (zp != nullptr) {
            const long long zbit = b * BITS;
            z = (float)((zp[r * ((blocks * BITS + 7) / 8) + (zbit >> 3)] >> (zbit & 7)) & mask);
        }
        return __fmul_rn(__fsub_rn((float)code, z), moe_f(scales[r * blocks + b]));
    }
}

__device__ __forceinline__ float moe_warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// One thread per token row; E experts; experts int32 [T, k], weights fp32 [T, k].
template <typename T>
__global__ void moe_route(const T* __restrict__ router, int* __restrict__ experts, float* __restrict__ weights,
                          long long rows, int num_experts, int k, int normalize) {
    PDL_ENTER();
    const long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (t >= rows) return;
    const T* l = router + t * num_experts;
    float top = moe_f(l[0]);
    for (int e = 1; e < num_experts; ++e) top = fmaxf(top, moe_f(l[e]));
    float total = expf(__fsub_rn(moe_f(l[0]), top));
    for (int e = 1; e < num_experts; ++e) total = __fadd_rn(total, expf(__fsub_rn(moe_f(l[e]), top)));
    int prev = -1;
    float prev_p = 0.f, sum = 0.f;
    for (int j = 0; j < k; ++j) {
        int best = -1;
        float best_p = 0.f;
        for (int e = 0; e < num_experts; ++e) {
            const float p = __fdiv_rn(expf(__fsub_rn(moe_f(l[e]), top)), total);
            // e comes after prev in (descending p, descending index) order, and before best
            const bool after = prev < 0 || p < prev_p || (p == prev_p && e < prev);
            const bool better = best < 0 || p > best_p || (p == best_p && e > best);
            if (after && better) { best = e; best_p = p; }
        }
        if (best < 0) best = 0, best_p = 0.f;  // non-finite logits: no order; route to expert 0
        experts[t * k + j] = best;
        weights[t * k + j] = best_p;
        sum = j == 0 ? best_p : __fadd_rn(sum, best_p);
        prev = best;
        prev_p = best_p;
    }
    if (normalize)
        for (int j = 0; j < k; ++j) weights[t * k + j] = __fdiv_rn(weights[t * k + j], sum);
}

// Dot of x (T, K values) with row `row` of expert e's projection, in a warp (lane sums then tree).
template <typename T, typename X, int BITS>
__device__ __forceinline__ float moe_dot(const X* x, const void* w, const T* scales, const unsigned char* zp,
                                         int e, long long n, long long k, int block, long long row) {
    float acc = 0.f;
    for (long long c = threadIdx.x & 31; c < k; c += 32)
        acc = __fmaf_rn(moe_f(x[c]), moe_weight<T, BITS>(w, scales, zp, e, n, k, block, row, c), acc);
    return moe_warp_sum(acc);
}

// act: 0 relu, 1 gelu (tanh), 2 silu, 3 identity, 4 swiglu.  Gate row i*g_step + g_off of w1
// (n1 rows); SwiGLU's linear row i*l_step + l_off of wl (nl rows: w1 itself, or fc3).
// Grid (T*k, ceil(I / warps)); a fp32 [T*k, I].
template <typename T, int BITS>
__global__ void moe_up(const T* __restrict__ x, const int* __restrict__ experts, long long k_routed,
                       long long hidden, long long inter,
                       const void* w1, const T* s1, const unsigned char* z1, const T* b1, long long n1,
                       const void* wl, const T* sl, const unsigned char* zl, const T* bl, long long nl,
                       int g_step, int g_off, int l_step, int l_off, int block, int act,
                       float alpha, float beta, float limit, int has_limit, float* __restrict__ a) {
    PDL_ENTER();
    const long long slot = blockIdx.x;
    const long long i = (long long)blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= inter) return;
    const int e = experts[slot];
    const T* row = x + (slot / k_routed) * hidden;
    const long long gi = i * g_step + g_off;
    float g = moe_dot<T, T, BITS>(row, w1, s1, z1, e, n1, hidden, block, gi);
    if (b1 != nullptr) g = __fadd_rn(g, moe_f(b1[e * n1 + gi]));
    float r;
    if (act != 4) {
        r = moe_act(act, g);
    } else {
        const long long li = i * l_step + l_off;
        float lin = moe_dot<T, T, BITS>(row, wl, sl, zl, e, nl, hidden, block, li);
        if (bl != nullptr) lin = __fadd_rn(lin, moe_f(bl[e * nl + li]));
        r = moe_swiglu(g, lin, alpha, beta, limit, has_limit);
    }
    if ((threadIdx.x & 31) == 0) a[slot * inter + i] = r;
}

// Grid (T*k, ceil(H / warps)); y fp32 [T*k, H] from a fp32 [T*k, I].
template <typename T, int BITS>
__global__ void moe_down(const float* __restrict__ a, const int* __restrict__ experts, long long hidden,
                         long long inter, const void* w2, const T* s2, const unsigned char* z2, const T* b2,
                         int block, float* __restrict__ y) {
    PDL_ENTER();
    const long long slot = blockIdx.x;
    const long long n = (long long)blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= hidden) return;
    const int e = experts[slot];
    float v = moe_dot<T, float, BITS>(a + slot * inter, w2, s2, z2, e, hidden, inter, block, n);
    if (b2 != nullptr) v = __fadd_rn(v, moe_f(b2[e * hidden + n]));
    if ((threadIdx.x & 31) == 0) y[slot * hidden + n] = v;
}

// out T [T, H] = sum_j weights[t, j] y[t*k + j], in rank order from w_0 y_0.
template <typename T>
__global__ void moe_mix(const float* __restrict__ y, const float* __restrict__ weights, T* __restrict__ out,
                        long long rows, long long hidden, int k) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows * hidden;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / hidden, h = i % hidden;
        float acc = __fmul_rn(weights[t * k], y[(t * k) * hidden + h]);
        for (int j = 1; j < k; ++j) acc = __fadd_rn(acc, __fmul_rn(weights[t * k + j], y[(t * k + j) * hidden + h]));
        moe_store(out + i, acc);
    }
}

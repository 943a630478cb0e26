// Greedy selection (protocol device_argmax; docs/cases.md 11, 12): per row b, over logits[b, pos[b], :],
// the maximum with the lowest index on ties; a row holding NaN or +-inf gives [-1, 1].
// Pass 1 (argmax_partial): grid (B, ceil(V / CHUNK)), CHUNK = 4096 fixed (never depends on B),
// 256 threads; each block writes (value, index, bad) of its chunk.  Pass 2 (argmax_final): one
// 256-thread block per row over the chunk partials.  max with lowest-index tie-break is exact and
// order-free, so the result is the same for every grid; values compared in fp32.
#include <cuda_fp16.h>

#define NEG_INF __int_as_float(0xff800000)
__device__ __forceinline__ bool finite_f(float v) { return fabsf(v) < __int_as_float(0x7f800000); }

#define CHUNK 4096
#define NT 256
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

__device__ __forceinline__ void better(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
}

__device__ void block_best(float& bv, int& bi, int& bad) {
    __shared__ float sv[NT]; __shared__ int si[NT]; __shared__ int sb[NT];
    sv[threadIdx.x] = bv; si[threadIdx.x] = bi; sb[threadIdx.x] = bad;
    __syncthreads();
    for (int o = NT / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) {
            float v = sv[threadIdx.x]; int i = si[threadIdx.x];
            better(v, i, sv[threadIdx.x + o], si[threadIdx.x + o]);
            sv[threadIdx.x] = v; si[threadIdx.x] = i; sb[threadIdx.x] |= sb[threadIdx.x + o];
        }
        __syncthreads();
    }
    bv = sv[0]; bi = si[0]; bad = sb[0];
}

template <typename T>
__global__ void argmax_partial(const T* __restrict__ logits, const int* __restrict__ pos, int S, int V,
                               float* pv, int* pi, int* pb) {
    PDL_ENTER();
    const int b = blockIdx.x, c = blockIdx.y, nch = gridDim.y;
    const T* row = logits + ((long long)b * S + pos[b]) * V;
    float bv = NEG_INF; int bi = 0x7fffffff, bad = 0;
    const int i0 = c * CHUNK + threadIdx.x, end = min(V, (c + 1) * CHUNK);
    // all CHUNK / NT loads of a thread issue before the first compare: one memory round trip
    // rather than one per element (the order of the compares never changes the result)
    float v[CHUNK / NT];
#pragma unroll
    for (int u = 0; u < CHUNK / NT; ++u) v[u] = i0 + u * NT < end ? to_f(row[i0 + u * NT]) : NEG_INF;
#pragma unroll
    for (int u = 0; u < CHUNK / NT; ++u) {
        if (i0 + u * NT >= end) break;
        if (!finite_f(v[u])) bad = 1; else better(bv, bi, v[u], i0 + u * NT);
    }
    block_best(bv, bi, bad);
    if (threadIdx.x == 0) { pv[b * nch + c] = bv; pi[b * nch + c] = bi; pb[b * nch + c] = bad; }
}

__global__ void argmax_final(const float* pv, const int* pi, const int* pb, int nch, int* result) {
    PDL_ENTER();
    const int b = blockIdx.x;
    float bv = NEG_INF; int bi = 0x7fffffff, bad = 0;
    for (int c = threadIdx.x; c < nch; c += NT) { better(bv, bi, pv[b * nch + c], pi[b * nch + c]); bad |= pb[b * nch + c]; }
    block_best(bv, bi, bad);
    if (threadIdx.x == 0) { result[2 * b] = bad ? -1 : bi; result[2 * b + 1] = bad; }
}

// decode_advance (protocol): input_ids[b, 0] = token (0 when flagged), mask[b, lengths[b]] = 1,
// lengths[b] += 1.  One thread per row.
__global__ void decode_advance(const int* result, long long* input_ids, long long* mask, int* lengths, int B, int cap) {
    PDL_ENTER();
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    input_ids[b] = result[2 * b + 1] ? 0 : result[2 * b];
    const int l = lengths[b];
    if (l < cap) mask[(long long)b * cap + l] = 1;
    lengths[b] = l + 1;
}

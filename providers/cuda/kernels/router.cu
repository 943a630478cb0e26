// The standard ops of an in-graph MoE router (LFM2-MoE: sigmoid written as Neg, Exp, Add,
// Reciprocal; TopK over the experts; GatherElements of the chosen scores; their sum; Clip, Log;
// ScatterElements into sentinel logits).  Shapes depend on the tensors' shapes only, never on
// their values, and no value comes back to the host, so a decode step with them captures.
//
// Batch invariance and reduction order (docs/moe.md "On cuda"):
// - unary, clip: one element per thread, fp32 math rounded once to T; no reduction.
// - topk: an element's rank along the axis is the count of the elements that come before it:
//   larger (largest=1) or smaller (largest=0) values, equal values of a lower index; NaN after
//   every number, NaNs by index (numpy's stable argsort, what cpu_reference runs).  Elements of
//   rank < k are written at their rank.  No reduction: each slice along the axis is alone.
// - gather_elements, scatter_elements: copies.  A scatter line (the fixed other coordinates)
//   is one thread that copies the line, then writes its updates in index order, so with
//   duplicate indices the last update wins (C order), whatever the launch.  An index outside
//   [-n, n) writes all bits set (NaN for floats) to the gathered element or to its whole
//   scatter line, since a device kernel cannot raise.
// - reduce_axis: one thread per output element, an fp32 sum over the reduced axis in
//   ascending index order, rounded once to T.  The order depends on the axis length only.
#include <cuda_fp16.h>

__device__ __forceinline__ float rf(float x) { return x; }
__device__ __forceinline__ float rf(__half x) { return __half2float(x); }
__device__ __forceinline__ void rs(float* p, float v) { *p = v; }
__device__ __forceinline__ void rs(__half* p, float v) { *p = __float2half_rn(v); }

#define GRID_STRIDE(i, n) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

// kind: 0 Neg, 1 Exp, 2 Log, 3 Reciprocal.
template <typename T>
__global__ void unary(const T* __restrict__ x, T* __restrict__ y, long long n, int kind) {
    PDL_ENTER();
    GRID_STRIDE(i, n) {
        const float v = rf(x[i]);
        rs(y + i, kind == 0 ? -v : kind == 1 ? expf(v) : kind == 2 ? logf(v) : __fdiv_rn(1.f, v));
    }
}

// y = min(max(x, lo), hi); a bound from lo_p / hi_p (device, one element) when given, else the
// scalar when has_lo / has_hi; the bounds are values of T.  NaN passes through.
template <typename T>
__global__ void clip(const T* __restrict__ x, T* __restrict__ y, long long n, const T* __restrict__ lo_p,
                     const T* __restrict__ hi_p, float lo, float hi, int has_lo, int has_hi) {
    PDL_ENTER();
    const float l = lo_p ? rf(*lo_p) : lo, h = hi_p ? rf(*hi_p) : hi;
    GRID_STRIDE(i, n) {
        float v = rf(x[i]);
        if (has_lo && v < l) v = l;
        if (has_hi && v > h) v = h;
        rs(y + i, v);
    }
}

__device__ __forceinline__ bool before(float a, long long ia, float b, long long ib, int largest) {
    const bool na = a != a, nb = b != b;  // NaN (no fast-math: the comparison holds)
    if (na || nb) return na && nb ? ia < ib : nb;
    if (a == b) return ia < ib;
    return largest ? a > b : a < b;
}

// x viewed as [outer, n, inner]; values [outer, k, inner] (T) and indices (int64).
template <typename T>
__global__ void topk(const T* __restrict__ x, T* __restrict__ values, long long* __restrict__ indices,
                     long long outer, long long n, long long inner, long long k, int largest) {
    PDL_ENTER();
    GRID_STRIDE(t, outer * n * inner) {
        const long long o = t / (n * inner), j = (t / inner) % n, in = t % inner;
        const T* line = x + o * n * inner + in;
        const float v = rf(line[j * inner]);
        long long rank = 0;
        for (long long i = 0; i < n && rank < k; ++i)
            rank += before(rf(line[i * inner]), i, v, j, largest);
        if (rank < k) {
            const long long at = (o * k + rank) * inner + in;
            values[at] = line[j * inner];
            indices[at] = j;
        }
    }
}

// out [outer, m, inner] = data [outer, n, inner] at the indices [outer, m, inner] (int32/int64)
// along the middle axis; E: an unsigned type of the element's size.
template <typename E, typename I>
__global__ void gather_elements(const E* __restrict__ data, const I* __restrict__ idx, E* __restrict__ out,
                                long long outer, long long n, long long m, long long inner) {
    PDL_ENTER();
    GRID_STRIDE(t, outer * m * inner) {
        const long long o = t / (m * inner), in = t % inner;
        long long j = (long long)idx[t];
        if (j < 0) j += n;
        out[t] = (j < 0 || j >= n) ? (E)~(E)0 : data[(o * n + j) * inner + in];
    }
}

// out [outer, n, inner] = data (or the fill when data is null), then out[o, idx[o, j, in], in] =
// updates[o, j, in] for j = 0..m-1 in order; one thread per line (o, in).
template <typename E, typename I>
__global__ void scatter_elements(const E* __restrict__ data, E fill, const I* __restrict__ idx,
                                 const E* __restrict__ updates, E* __restrict__ out, long long outer, long long n,
                                 long long m, long long inner) {
    PDL_ENTER();
    GRID_STRIDE(t, outer * inner) {
        const long long o = t / inner, in = t % inner;
        E* line = out + o * n * inner + in;
        for (long long j = 0; j < n; ++j) line[j * inner] = data ? data[(o * n + j) * inner + in] : fill;
        bool bad = false;
        for (long long j = 0; j < m; ++j) {
            long long at = (long long)idx[(o * m + j) * inner + in];
            if (at < 0) at += n;
            if (at < 0 || at >= n) { bad = true; continue; }
            line[at * inner] = updates[(o * m + j) * inner + in];
        }
        if (bad)
            for (long long j = 0; j < n; ++j) line[j * inner] = (E)~(E)0;
    }
}

// y [outer, inner] = the fp32 sum of x [outer, n, inner] over the middle axis, i = 0..n-1.
template <typename T>
__global__ void reduce_axis(const T* __restrict__ x, T* __restrict__ y, long long outer, long long n,
                            long long inner) {
    PDL_ENTER();
    GRID_STRIDE(t, outer * inner) {
        const long long o = t / inner, in = t % inner;
        const T* line = x + o * n * inner + in;
        float s = 0.f;
        for (long long i = 0; i < n; ++i) s = __fadd_rn(s, rf(line[i * inner]));
        rs(y + t, s);
    }
}

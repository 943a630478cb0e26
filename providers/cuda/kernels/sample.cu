// Per-row sampling (protocol device_sample; the algorithm and its reference are
// core/generation/sampling.py, whose docstring this follows step by step).
// One 512-thread block per row b over logits[b, pos[b], :]; nothing depends on B, and every
// reduction has a fixed order or is exact, so a row's token is the same at every batch size,
// eager or captured, and equal to the NumPy reference on the same logits:
//   - max / argmax with lowest index on ties: exact and order-free;
//   - top-k: radix select of the k-th largest key (4 passes of 8-bit digits, integer counts);
//   - top-p: radix descent over the keys with integer masses floor(exp(z - m) * 2^40) summed in
//     uint64 (exact, so the atomic order cannot matter; the reference adds the same integers);
//   - min-p: exp(z - m) >= min_p in double;
//   - draw: Gumbel-max, argmax of double(z) - log(-log(u)), u = (w + 0.5) / 2^32, w from
//     Philox-4x32-10 with key (seed lo, seed hi) and counter (v / 4, counter[b], 0, 0).
// Keys are the order-preserving uint32 of z + 0.0f (so -0 and +0 are one key).
#include <cuda_fp16.h>

#define NT 512
#define NEG_INF_F __int_as_float(0xff800000)
#define MASS_SCALE 1099511627776.0  // 2^40
#define NEG_INF_D __longlong_as_double(0xfff0000000000000LL)

__device__ __forceinline__ bool finite_f(float v) { return fabsf(v) < __int_as_float(0x7f800000); }
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

__device__ __forceinline__ unsigned key_of(float z) {
    unsigned u = __float_as_uint(z + 0.0f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint4 philox(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    return c;
}

__device__ __forceinline__ double gumbel(unsigned w) {
    const double u = ((double)w + 0.5) * (1.0 / 4294967296.0);
    return -log(-log(u));
}

struct Shared {
    float fv[NT]; int fi[NT]; int fb[NT];
    double dv[NT]; int di[NT];
    unsigned cnt[256]; unsigned long long mass[256];
    unsigned sel_prefix; int sel_rem; unsigned long long sel_above, total;
};

// max of float with lowest index; OR of the bad flags.  Fixed tree.
__device__ void reduce_max_f(Shared& s, float& v, int& i, int& bad) {
    const int t = threadIdx.x;
    s.fv[t] = v; s.fi[t] = i; s.fb[t] = bad;
    __syncthreads();
    for (int o = NT / 2; o > 0; o >>= 1) {
        if (t < o) {
            const float ov = s.fv[t + o]; const int oi = s.fi[t + o];
            if (ov > s.fv[t] || (ov == s.fv[t] && oi < s.fi[t])) { s.fv[t] = ov; s.fi[t] = oi; }
            s.fb[t] |= s.fb[t + o];
        }
        __syncthreads();
    }
    v = s.fv[0]; i = s.fi[0]; bad = s.fb[0];
    __syncthreads();
}

__device__ void reduce_max_d(Shared& s, double& v, int& i) {
    const int t = threadIdx.x;
    s.dv[t] = v; s.di[t] = i;
    __syncthreads();
    for (int o = NT / 2; o > 0; o >>= 1) {
        if (t < o) {
            const double ov = s.dv[t + o]; const int oi = s.di[t + o];
            if (ov > s.dv[t] || (ov == s.dv[t] && oi < s.di[t])) { s.dv[t] = ov; s.di[t] = oi; }
        }
        __syncthreads();
    }
    v = s.dv[0]; i = s.di[0];
    __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(NT) sample_rows(
        const T* __restrict__ logits, const int* __restrict__ pos, int S, int V,
        const float* __restrict__ params, const int* __restrict__ options, const int* __restrict__ counter,
        const long long* __restrict__ fed, unsigned char* __restrict__ history, int* __restrict__ result) {
    PDL_ENTER();
    __shared__ Shared s;
    const int b = blockIdx.x, t = threadIdx.x;
    const T* row = logits + ((long long)b * S + pos[b]) * V;
    unsigned char* hist = history + (long long)b * V;
    if (fed != nullptr && t == 0) {
        const long long tok = fed[b];
        if (tok >= 0 && tok < V) hist[tok] = 1;
    }
    __syncthreads();
    const int flags = options[4 * b], top_k = options[4 * b + 1];
    const unsigned seed_lo = (unsigned)options[4 * b + 2], seed_hi = (unsigned)options[4 * b + 3];
    const float temperature = params[4 * b], top_p = params[4 * b + 1], min_p = params[4 * b + 2];
    const float penalty = params[4 * b + 3];
    const bool sample = flags & 1, penal = (flags & 2) != 0;

    // z_v: the penalised logit, divided by the temperature for a sampled row (fp32, IEEE).
    auto zval = [&](int i) -> float {
        float l = to_f(row[i]);
        if (penal && hist[i]) l = l < 0.0f ? l * penalty : l / penalty;
        return sample ? l / temperature : l;
    };

    // 1-3: non-finite check, max and argmax.
    float bv = NEG_INF_F; int bi = 0x7fffffff, bad = 0;
    for (int i = t; i < V; i += NT) {
        if (!finite_f(to_f(row[i]))) { bad = 1; continue; }
        const float z = zval(i);
        if (z > bv || (z == bv && i < bi)) { bv = z; bi = i; }
    }
    reduce_max_f(s, bv, bi, bad);
    if (bad || !sample) {
        if (t == 0) { result[2 * b] = bad ? -1 : bi; result[2 * b + 1] = bad; }
        return;
    }
    const double m = (double)bv;

    // 5: top-k threshold key (the k-th largest key, duplicates counted).
    unsigned thr_k = 0;
    if (top_k > 0 && top_k < V) {
        unsigned prefix = 0, pmask = 0; int remaining = top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int d = t; d < 256; d += NT) s.cnt[d] = 0;
            __syncthreads();
            for (int i = t; i < V; i += NT) {
                const unsigned k = key_of(zval(i));
                if ((k & pmask) == prefix) atomicAdd(&s.cnt[(k >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (t == 0) {
                int d = 255;
                for (; d > 0; --d) {
                    if ((int)s.cnt[d] >= remaining) break;
                    remaining -= (int)s.cnt[d];
                }
                s.sel_prefix = prefix | ((unsigned)d << shift); s.sel_rem = remaining;
            }
            __syncthreads();
            prefix = s.sel_prefix; remaining = s.sel_rem; pmask |= 255u << shift;
            __syncthreads();
        }
        thr_k = prefix;
    }

    // 6: top-p threshold key: the lowest key whose strictly-greater kept mass is < top_p * total.
    unsigned thr_p = 0;
    if (top_p < 1.0f) {
        unsigned prefix = 0, pmask = 0; unsigned long long above = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int d = t; d < 256; d += NT) { s.cnt[d] = 0; s.mass[d] = 0ull; }
            __syncthreads();
            for (int i = t; i < V; i += NT) {
                const float z = zval(i);
                const unsigned k = key_of(z);
                if (k >= thr_k && (k & pmask) == prefix) {
                    const unsigned d = (k >> shift) & 255u;
                    atomicAdd(&s.cnt[d], 1u);
                    atomicAdd(&s.mass[d], (unsigned long long)(exp((double)z - m) * MASS_SCALE));
                }
            }
            __syncthreads();
            if (t == 0) {
                if (shift == 24) {
                    unsigned long long sum = 0;
                    for (int d = 0; d < 256; ++d) sum += s.mass[d];
                    s.total = sum;
                }
                const double limit = (double)top_p * (double)s.total;
                unsigned long long acc = above;
                int sel = -1; unsigned long long sel_above = above;
                for (int d = 255; d >= 0; --d) {
                    if (s.cnt[d] == 0) continue;
                    if (!((double)acc < limit)) break;
                    sel = d; sel_above = acc;
                    acc += s.mass[d];
                }
                s.sel_prefix = prefix | ((unsigned)(sel < 0 ? 255 : sel) << shift);
                s.sel_above = sel_above;
            }
            __syncthreads();
            prefix = s.sel_prefix; above = s.sel_above; pmask |= 255u << shift;
            __syncthreads();
        }
        thr_p = prefix;
    }

    // 7-8: min-p and the Gumbel-max draw over the kept entries, 4 entries per Philox call.
    const double minp = (double)min_p;
    const unsigned ctr = (unsigned)counter[b];
    double best = NEG_INF_D; int best_i = 0x7fffffff;
    const int groups = (V + 3) / 4;
    for (int j = t; j < groups; j += NT) {
        float zs[4]; bool keep[4]; bool any = false;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int i = 4 * j + q;
            keep[q] = false;
            if (i >= V) continue;
            zs[q] = zval(i);
            const unsigned k = key_of(zs[q]);
            bool kq = k >= thr_k && k >= thr_p;
            if (kq && minp > 0.0) kq = exp((double)zs[q] - m) >= minp;
            keep[q] = kq; any |= kq;
        }
        if (!any) continue;
        const uint4 w = philox(make_uint4((unsigned)j, ctr, 0u, 0u), seed_lo, seed_hi);
        const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (!keep[q]) continue;
            const double sc = (double)zs[q] + gumbel(ws[q]);
            const int i = 4 * j + q;
            if (sc > best || (sc == best && i < best_i)) { best = sc; best_i = i; }
        }
    }
    reduce_max_d(s, best, best_i);
    if (t == 0) { result[2 * b] = best_i; result[2 * b + 1] = 0; }
}

template __global__ void sample_rows<float>(const float*, const int*, int, int, const float*, const int*, const int*,
                                            const long long*, unsigned char*, int*);
template __global__ void sample_rows<__half>(const __half*, const int*, int, int, const float*, const int*, const int*,
                                             const long long*, unsigned char*, int*);

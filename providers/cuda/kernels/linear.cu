// Linear layers: Y[M, N] = A[M, K] @ W  (MatMul with a dense W [K, N]; MatMulNBits with a
// block-quantized W stored [N, n_blocks, blob]).  fp32 accumulation, output in A's dtype.
//
// Batch invariance (docs/cuda.md "Batch-invariant kernels"): the reduction order of every
// output element is fixed by (K, chunk) alone:
//   K is cut into chunks of CK consecutive indices (CK = 16 for dense W, CK = block_size for
//   MatMulNBits).  For chunk c, p_c = fmaf(a[k], w[k], p) for k ascending inside the chunk,
//   starting from p = 0.  Then acc = 0; acc = acc + p_c for c ascending (__fadd_rn, no
//   contraction).  Y = acc (+ bias[n]).
// Threads own (8 columns x one chunk x RT rows); chunk partials go to shared memory and are
// folded in ascending chunk order.  The block shape (CT column threads x CS chunk slots), the
// number of rows per block RT and the grid are free launch choices: none of them changes the
// arithmetic of any output element, so a row's result is the same bits for every M.
// Dequantisation (q - zp) * scale is computed in fp32 (__fsub_rn/__fmul_rn), as cpu_reference.
#include <cuda_fp16.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

// 8 consecutive weights w[k, n0 .. n0+8) of a dense [K, N] matrix as floats.
__device__ __forceinline__ void load8(const __half* w, long long off, bool vec, int nvalid, float* out) {
    if (vec) {
        uint4 u = *reinterpret_cast<const uint4*>(w + off);
        const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
        for (int j = 0; j < 4; ++j) { float2 f = __half22float2(h[j]); out[2 * j] = f.x; out[2 * j + 1] = f.y; }
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) out[j] = j < nvalid ? __half2float(w[off + j]) : 0.f;
    }
}
__device__ __forceinline__ void load8(const float* w, long long off, bool vec, int nvalid, float* out) {
    if (vec) {
        float4 a = *reinterpret_cast<const float4*>(w + off);
        float4 b = *reinterpret_cast<const float4*>(w + off + 4);
        out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
        out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) out[j] = j < nvalid ? w[off + j] : 0.f;
    }
}

// Fold the chunk partials of this wave (part[slot][r][col]) into accbuf in ascending chunk order.
template <int RT>
__device__ __forceinline__ void fold(float* part, float* accbuf, int nslots, int ncol, int tid, int nthreads) {
    __syncthreads();
    for (int o = tid; o < RT * ncol; o += nthreads) {
        float s = accbuf[o];
        for (int t = 0; t < nslots; ++t) s = __fadd_rn(s, part[t * RT * ncol + o]);
        accbuf[o] = s;
    }
    __syncthreads();
}

template <int RT, typename T>
__device__ __forceinline__ void write_out(const float* accbuf, T* y, const T* bias, int M, int N,
                                          int m0, int n0blk, int ncol, int tid, int nthreads) {
    for (int o = tid; o < RT * ncol; o += nthreads) {
        int r = o / ncol, col = o % ncol, m = m0 + r, n = n0blk + col;
        if (m < M && n < N) {
            float v = accbuf[o];
            if (bias) v = __fadd_rn(v, to_f(bias[n]));
            store(y + (long long)m * N + n, v);
        }
    }
}

// Dense W [K, N].  grid (ceil(N / (8*CT)), ceil(M / RT)); block (CT, CS); dynamic shared
// memory (CS + 1) * RT * 8 * CT floats.
template <int RT, typename T, typename TW>
__device__ void dense_body(const T* __restrict__ a, const TW* __restrict__ w, const T* __restrict__ bias,
                           T* __restrict__ y, int M, int N, int K) {
    extern __shared__ float smem[];
    const int CT = blockDim.x, CS = blockDim.y, tid = threadIdx.x + threadIdx.y * CT, nthreads = CT * CS;
    const int ncol = 8 * CT, n0blk = blockIdx.x * ncol, m0 = blockIdx.y * RT;
    const int n0 = n0blk + 8 * threadIdx.x;
    float* accbuf = smem;
    float* part = smem + RT * ncol;
    for (int o = tid; o < RT * ncol; o += nthreads) accbuf[o] = 0.f;
    const int CK = 16, nC = (K + CK - 1) / CK;
    const bool vec = ((N & 7) == 0) && (n0 + 8 <= N);
    const int nvalid = N - n0;
    for (int c0 = 0; c0 < nC; c0 += CS) {
        const int c = c0 + threadIdx.y;
        if (c < nC && n0 < N) {
            float p[RT][8];
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int j = 0; j < 8; ++j) p[r][j] = 0.f;
            const int kbeg = c * CK, kend = min(K, (c + 1) * CK);
            if constexpr (sizeof(TW) == 2) {
                if (vec && kend - kbeg == CK) {  // full chunk: all CK loads in flight first
                    uint4 raw[CK];
#pragma unroll
                    for (int i = 0; i < CK; ++i) raw[i] = *reinterpret_cast<const uint4*>(w + (long long)(kbeg + i) * N + n0);
#pragma unroll
                    for (int i = 0; i < CK; ++i) {
                        float wv[8];
                        const __half2* h = reinterpret_cast<const __half2*>(&raw[i]);
#pragma unroll
                        for (int j = 0; j < 4; ++j) { float2 f = __half22float2(h[j]); wv[2 * j] = f.x; wv[2 * j + 1] = f.y; }
#pragma unroll
                        for (int r = 0; r < RT; ++r) {
                            const float av = (m0 + r < M) ? to_f(a[(long long)(m0 + r) * K + kbeg + i]) : 0.f;
#pragma unroll
                            for (int j = 0; j < 8; ++j) p[r][j] = fmaf(av, wv[j], p[r][j]);
                        }
                    }
                    goto done;
                }
            }
#pragma unroll 4
            for (int k = kbeg; k < kend; ++k) {
                float wv[8];
                load8(w, (long long)k * N + n0, vec, nvalid, wv);
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    const float av = (m0 + r < M) ? to_f(a[(long long)(m0 + r) * K + k]) : 0.f;
#pragma unroll
                    for (int j = 0; j < 8; ++j) p[r][j] = fmaf(av, wv[j], p[r][j]);
                }
            }
        done:
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int j = 0; j < 8; ++j) part[(threadIdx.y * RT + r) * ncol + 8 * threadIdx.x + j] = p[r][j];
        }
        fold<RT>(part, accbuf, min(CS, nC - c0), ncol, tid, nthreads);
    }
    write_out<RT>(accbuf, y, bias, M, N, m0, n0blk, ncol, tid, nthreads);
}

// Block-quantized W: codes uint8 [N, nb, blob] (LSB-first), scales S [N, nb],
// zp_mode 0: zp = 2^(bits-1); 1: packed uint8 [N, zp_stride] (same LSB-first packing along
// blocks); 2: float zero points of type T [N, nb].  bits in {2, 4, 8}; blob % 4 == 0.
template <int RT, typename T, typename S>
__device__ void nbits_body(const T* __restrict__ a, const unsigned char* __restrict__ q,
                           const S* __restrict__ scales, const void* __restrict__ zp, int zp_mode, int zp_stride,
                           const T* __restrict__ bias, T* __restrict__ y, int M, int N, int K, int bits, int bs) {
    extern __shared__ float smem[];
    const int CT = blockDim.x, CS = blockDim.y, tid = threadIdx.x + threadIdx.y * CT, nthreads = CT * CS;
    const int ncol = 8 * CT, n0blk = blockIdx.x * ncol, m0 = blockIdx.y * RT;
    const int n0 = n0blk + 8 * threadIdx.x;
    float* accbuf = smem;
    float* part = smem + RT * ncol;
    for (int o = tid; o < RT * ncol; o += nthreads) accbuf[o] = 0.f;
    const int nb = (K + bs - 1) / bs, blob = bs * bits / 8, words = blob / 4, per_word = 32 / bits;
    const unsigned mask = (1u << bits) - 1u;
    for (int c0 = 0; c0 < nb; c0 += CS) {
        const int c = c0 + threadIdx.y;
        if (c < nb && n0 < N) {
            float p[RT][8], sc[8], z[8];
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int j = 0; j < 8; ++j) p[r][j] = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int n = min(n0 + j, N - 1);
                sc[j] = to_f(scales[(long long)n * nb + c]);
                if (zp_mode == 0) z[j] = (float)(1 << (bits - 1));
                else if (zp_mode == 1) {
                    const int e = c * bits;
                    z[j] = (float)((((const unsigned char*)zp)[(long long)n * zp_stride + (e >> 3)] >> (e & 7)) & mask);
                } else z[j] = to_f(((const T*)zp)[(long long)n * nb + c]);
            }
            const bool vec4 = (words & 3) == 0;
            for (int w0 = 0; w0 < words; w0 += (vec4 ? 4 : 1)) {
                unsigned wd[8][4];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int n = min(n0 + j, N - 1);
                    const unsigned* base = reinterpret_cast<const unsigned*>(q + ((long long)n * nb + c) * blob) + w0;
                    if (vec4) { uint4 u = *reinterpret_cast<const uint4*>(base); wd[j][0] = u.x; wd[j][1] = u.y; wd[j][2] = u.z; wd[j][3] = u.w; }
                    else { wd[j][0] = base[0]; }
                }
                const int nw = vec4 ? 4 : 1;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if (i >= nw) break;
                    for (int e = 0; e < per_word; ++e) {
                        const int k = c * bs + (w0 + i) * per_word + e;
                        if (k >= K) break;
                        float av[RT];
#pragma unroll
                        for (int r = 0; r < RT; ++r) av[r] = (m0 + r < M) ? to_f(a[(long long)(m0 + r) * K + k]) : 0.f;
#pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            const float wv = __fmul_rn(__fsub_rn((float)((wd[j][i] >> (e * bits)) & mask), z[j]), sc[j]);
#pragma unroll
                            for (int r = 0; r < RT; ++r) p[r][j] = fmaf(av[r], wv, p[r][j]);
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int j = 0; j < 8; ++j) part[(threadIdx.y * RT + r) * ncol + 8 * threadIdx.x + j] = p[r][j];
        }
        fold<RT>(part, accbuf, min(CS, nb - c0), ncol, tid, nthreads);
    }
    write_out<RT>(accbuf, y, bias, M, N, m0, n0blk, ncol, tid, nthreads);
}

template <int RT, typename T, typename TW>
__global__ void dense(const T* a, const TW* w, const T* bias, T* y, int M, int N, int K) {
    PDL_ENTER();
    dense_body<RT, T, TW>(a, w, bias, y, M, N, K);
}

template <int RT, typename T, typename S>
__global__ void nbits(const T* a, const unsigned char* q, const S* scales, const void* zp, int zp_mode,
                      int zp_stride, const T* bias, T* y, int M, int N, int K, int bits, int bs) {
    PDL_ENTER();
    nbits_body<RT, T, S>(a, q, scales, zp, zp_mode, zp_stride, bias, y, M, N, K, bits, bs);
}

// Embedding lookups.  Pure copies / per-element dequantisation: no reductions, so any grid is
// batch-invariant.  Grid y walks the indices with a stride (grid y <= 65,535 for any count).
// gather_rows: out[i, :] = data[idx[i], :] (row of `row_bytes` bytes, copied in 16-byte units
//   when row_bytes % 16 == 0, else bytes); negative indices wrap; out-of-range rows are zero.
// gather_columns: out[i, k] = w[k, idx[i]] for a row-major W [K, N] (lockstep.GatherColumns, the
//   tied-embedding lookup read from the lm_head weight); T is a bit container of the element
//   (unsigned short for fp16, unsigned int for fp32); negative indices wrap, out-of-range
//   columns are zero.
// gather_packed_columns: the same for an fp16 W held in linear_mma.cu's fragment order
//   (providers/cuda/ops/_mma.py pack): element (k, n) is at
//   ((((((nt*KC + kc)*4 + v)*8 + g)*4 + t)*2 + e2)*2 + e1)*2 + e0 with
//   k = 64 kc + 16 t + 4 v + 2 e2 + e0, n = 16 nt + 8 e1 + g, KC = ceil(K / 64).
// gather_block_quantized: out[i, d] = (q(row, d) - zp) * scale[row, d / bs] in fp32 (docs/ops.md 5),
//   codes LSB-first, zp = 2^(bits-1) or packed uint8; out-of-range rows are zero.
#include <cuda_fp16.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

// Entry i of idx as a row of [0, rows) in r: a negative index counts from the end (ONNX Gather),
// once; returns whether r is in range (out-of-range rows are read as zeros by every kernel here).
__device__ __forceinline__ bool wrap_index(const long long* idx, long long i, long long rows, long long& r) {
    r = idx[i];
    if (r < 0) r += rows;
    return r >= 0 && r < rows;
}

__global__ void gather_rows(const unsigned char* data, const long long* idx, unsigned char* out,
                            long long nidx, long long rows, long long row_bytes) {
    PDL_ENTER();
    for (long long i = blockIdx.y; i < nidx; i += gridDim.y) {
        long long r;
        const bool ok = wrap_index(idx, i, rows, r);
        if (row_bytes % 16 == 0) {
            const long long n = row_bytes / 16;
            for (long long u = blockIdx.x * (long long)blockDim.x + threadIdx.x; u < n; u += (long long)gridDim.x * blockDim.x) {
                uint4 v = make_uint4(0, 0, 0, 0);
                if (ok) v = reinterpret_cast<const uint4*>(data + r * row_bytes)[u];
                reinterpret_cast<uint4*>(out + i * row_bytes)[u] = v;
            }
        } else {
            for (long long u = blockIdx.x * (long long)blockDim.x + threadIdx.x; u < row_bytes; u += (long long)gridDim.x * blockDim.x)
                out[i * row_bytes + u] = ok ? data[r * row_bytes + u] : 0;
        }
    }
}

template <typename S>
__global__ void gather_block_quantized(const unsigned char* data, const long long* idx, const S* scales,
                                       const unsigned char* zp, S* out, long long rows, int D, int bits, int bs,
                                       int row_bytes, int zp_bytes, long long nidx) {
    PDL_ENTER();
    for (long long i = blockIdx.y; i < nidx; i += gridDim.y) {
        long long r;
        const bool ok = wrap_index(idx, i, rows, r);
        const int nb = (D + bs - 1) / bs;
        const unsigned mask = (1u << bits) - 1u;
        for (int d = blockIdx.x * blockDim.x + threadIdx.x; d < D; d += gridDim.x * blockDim.x) {
            float v = 0.f;
            if (ok) {
                const int e = d * bits, blk = d / bs;
                const float q = (float)((data[r * row_bytes + (e >> 3)] >> (e & 7)) & mask);
                float z = (float)(1 << (bits - 1));
                if (zp) { const int ez = blk * bits; z = (float)((zp[r * zp_bytes + (ez >> 3)] >> (ez & 7)) & mask); }
                v = __fmul_rn(__fsub_rn(q, z), to_f(scales[r * nb + blk]));
            }
            store(out + i * D + d, v);
        }
    }
}

template <typename T>
__global__ void gather_columns(const T* w, const long long* idx, T* out, long long nidx, int K, long long N) {
    PDL_ENTER();
    for (long long i = blockIdx.y; i < nidx; i += gridDim.y) {
        long long c;
        const bool ok = wrap_index(idx, i, N, c);
        for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < K; k += gridDim.x * blockDim.x)
            out[i * K + k] = ok ? w[(long long)k * N + c] : (T)0;
    }
}

__global__ void gather_packed_columns(const unsigned short* w, const long long* idx, unsigned short* out,
                                      long long nidx, int K, long long N) {
    PDL_ENTER();
    const long long KC = (K + 63) / 64;
    for (long long i = blockIdx.y; i < nidx; i += gridDim.y) {
        long long c;
        const bool ok = wrap_index(idx, i, N, c);
        const long long nt = c >> 4;
        const int e1 = (int)((c >> 3) & 1), g = (int)(c & 7);
        for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < K; k += gridDim.x * blockDim.x) {
            const int kc = k >> 6, t = (k >> 4) & 3, v = (k >> 2) & 3, e2 = (k >> 1) & 1, e0 = k & 1;
            const long long p = ((((((nt * KC + kc) * 4 + v) * 8 + g) * 4 + t) * 2 + e2) * 2 + e1) * 2 + e0;
            out[i * K + k] = ok ? w[p] : (unsigned short)0;
        }
    }
}

// gather_block_quantized on an int4 table in the tensor-core kernels' packed layout
// (kernels/linear_mma.cu, the int4 section; the tied lm_head's packed weight): the same values,
// (q - z) * scale in fp32, read there.  qp: codes of rows x D; sp: scales and zq (1024 + z, or
// null: z = 8) per row and block, nbp blocks of 2^lbs per row.
template <typename S>
__global__ void gather_packed_int4(const unsigned char* qp, const long long* idx, const S* sp, const __half* zq,
                                   S* out, long long rows, int D, int nbp, int lbs, long long nidx) {
    PDL_ENTER();
    const long long nc = (D + 63) / 64;
    for (long long i = blockIdx.y; i < nidx; i += gridDim.y) {
        long long r;
        const bool ok = wrap_index(idx, i, rows, r);
        const long long nt = r >> 4;
        const int hi = (int)((r >> 3) & 1), g = (int)(r & 7);
        for (int d = blockIdx.x * blockDim.x + threadIdx.x; d < D; d += gridDim.x * blockDim.x) {
            float v = 0.f;
            if (ok) {
                const int t = (d >> 2) & 3, vt = (d >> 4) & 3, i0 = d & 1, i1 = (d >> 1) & 1;
                const unsigned char byte = qp[((nt * nc + (d >> 6)) * 32 + g * 4 + t) * 16 + vt * 4 + 2 * i0 + i1];
                const float q = (float)((byte >> (4 * hi)) & 15u);
                const long long s = ((nt * nbp + (d >> lbs)) * 8 + g) * 2 + hi;
                const float z = zq ? __half2float(zq[s]) - 1024.f : 8.f;
                v = __fmul_rn(__fsub_rn(q, z), to_f(sp[s]));
            }
            store(out + i * D + d, v);
        }
    }
}

// Embedding lookups.  Pure copies / per-element dequantisation: no reductions, so any grid is
// batch-invariant.  Grid y walks the indices with a stride (grid y <= 65,535 for any count).
// gather_rows: out[i, :] = data[idx[i], :] (row of `row_bytes` bytes, copied in 16-byte units
//   when row_bytes % 16 == 0, else bytes); negative indices wrap; out-of-range rows are zero.
// gather_block_quantized: out[i, d] = (q(row, d) - zp) * scale[row, d / bs] in fp32 (docs/ops.md 5),
//   codes LSB-first, zp = 2^(bits-1) or packed uint8; out-of-range rows are zero.
#include <cuda_fp16.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

__global__ void gather_rows(const unsigned char* data, const long long* idx, unsigned char* out,
                            long long nidx, long long rows, long long row_bytes) {
    PDL_ENTER();
  for (long long i = blockIdx.y; i < nidx; i += gridDim.y) {
    long long r = idx[i];
    if (r < 0) r += rows;
    const bool ok = r >= 0 && r < rows;
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
    long long r = idx[i];
    if (r < 0) r += rows;
    const bool ok = r >= 0 && r < rows;
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

// lockstep.ReduceSumSubCast over an int64 attention mask (core.fusion): out[r] = int32(sum over
// t of x[r, t] - b), the GroupQueryAttention seqlens_k the builder computes with ReduceSum, Sub
// and Cast.  One block of 128 threads per row: each thread sums a strided slice, then a warp
// tree and the four warp sums in order.  Integer sums are exact, so the order changes no bit and
// a row's result never depends on the other rows (batch-invariant).  Cast to int32 keeps the low
// 32 bits, as ONNX Cast of an int64 does.
#define MASK_NT 128

__global__ void __launch_bounds__(MASK_NT) rowsum_sub_i32(const long long* __restrict__ x, long long T, long long b,
                                                       int* __restrict__ out) {
    PDL_ENTER();  // the mask is written by the step's decode_advance, the launch before
    const long long* row = x + (long long)blockIdx.x * T;
    long long s = 0;
    for (long long t = threadIdx.x; t < T; t += MASK_NT) s += row[t];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    __shared__ long long warp_sums[MASK_NT / 32];
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        long long total = 0;
        for (int w = 0; w < MASK_NT / 32; ++w) total += warp_sums[w];
        out[blockIdx.x] = (int)(total - b);
    }
}

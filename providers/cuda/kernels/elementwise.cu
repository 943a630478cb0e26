// Same-shape elementwise ops (the SiLU of the MLP: Sigmoid, Mul), fp32 math, rounded once to
// T.  No reductions: batch-invariant by construction.  op: 0 mul, 1 add, 2 sub, 3 div.
#include <cuda_fp16.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

template <typename T>
__global__ void binary(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ y, long long n, int op) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float x = to_f(a[i]), z = to_f(b[i]);
        store(y + i, op == 0 ? __fmul_rn(x, z) : op == 1 ? __fadd_rn(x, z) : op == 2 ? __fsub_rn(x, z) : __fdiv_rn(x, z));
    }
}

template <typename T>
__global__ void sigmoid(const T* __restrict__ x, T* __restrict__ y, long long n) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        store(y + i, __fdiv_rn(1.f, __fadd_rn(1.f, expf(-to_f(x[i])))));
}

// SiluMul (lockstep fusion of Sigmoid(x) -> Mul(x, sig) -> Mul(., up)): each step rounded to T
// exactly as the unfused ops are (sigmoid, then x * s, then * up).
__device__ __forceinline__ float rt(float v, float*) { return v; }
__device__ __forceinline__ float rt(float v, __half*) { return __half2float(__float2half_rn(v)); }
template <typename T>
__global__ void silu_mul(const T* __restrict__ x, const T* __restrict__ up, T* __restrict__ y, long long n) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float xv = to_f(x[i]);
        const float s = rt(__fdiv_rn(1.f, __fadd_rn(1.f, expf(-xv))), (T*)nullptr);
        const float t = rt(__fmul_rn(xv, s), (T*)nullptr);
        store(y + i, __fmul_rn(t, to_f(up[i])));
    }
}

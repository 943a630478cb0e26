// Elementwise activations the builder's Gemma/Phi graphs use, fp32 math rounded once to T:
//   gelu:  0.5 x (1 + erf(x / sqrt 2))                                     (approximate "none")
//   gelu_tanh / FastGelu: 0.5 x (1 + tanh(0.7978845608 (x + 0.044715 x^3)))  (bias added first)
//   quick_gelu: x * sigmoid(alpha x)
//   tanh: tanhf(x)
// No reductions: batch-invariant by construction.  Also split_copy, the copy of one output of
// an ONNX Split: x viewed as [outer, axis, inner], out = x[:, offset:offset + width, :].
#include <cuda_fp16.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

// kind: 0 gelu (erf), 1 gelu tanh, 2 quick gelu (alpha), 3 tanh.  bias (may be null) has
// bias_n elements and is added to x first (FastGelu), broadcast over the last axis.
template <typename T>
__global__ void activation(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                           long long n, long long bias_n, int kind, float alpha) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = to_f(x[i]);
        if (bias != nullptr) v = __fadd_rn(v, to_f(bias[i % bias_n]));
        float r;
        if (kind == 0) {
            r = __fmul_rn(__fmul_rn(0.5f, v), __fadd_rn(1.f, erff(__fmul_rn(v, 0.70710678118654752f))));
        } else if (kind == 1) {
            const float cube = __fmul_rn(__fmul_rn(0.044715f, v), __fmul_rn(v, v));
            const float inner = __fmul_rn(0.7978845608028654f, __fadd_rn(v, cube));
            r = __fmul_rn(__fmul_rn(0.5f, v), __fadd_rn(1.f, tanhf(inner)));
        } else if (kind == 2) {
            r = __fdiv_rn(v, __fadd_rn(1.f, expf(-__fmul_rn(alpha, v))));
        } else {
            r = tanhf(v);
        }
        store(y + i, r);
    }
}

template <typename T>
__global__ void split_copy(const T* __restrict__ x, T* __restrict__ y, long long outer, long long axis,
                           long long inner, long long offset, long long width) {
    PDL_ENTER();
    const long long n = outer * width * inner;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long k = i % inner, w = (i / inner) % width, o = i / (inner * width);
        y[i] = x[(o * axis + offset + w) * inner + k];
    }
}

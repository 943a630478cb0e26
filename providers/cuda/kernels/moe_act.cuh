// The expert activations of moe.cu's moe_up and moe_paged.cu's moe_up_paged (docs/moe.md,
// "What the ops compute"), in fp32 with explicit rounding, so both kernels give the same bits.
// Prepended to moe.cu (providers/cuda/module.py HEADERS), hence seen by moe_paged.cu too.

// act: 0 relu, 1 gelu (tanh approximation), 2 silu, 3 identity (4, swiglu: moe_swiglu).
__device__ __forceinline__ float moe_act(int act, float g) {
    if (act == 0) return fmaxf(g, 0.f);
    if (act == 1) {
        const float inner = __fmul_rn(0.7978845608028654f, __fadd_rn(g, __fmul_rn(__fmul_rn(0.044715f, g), __fmul_rn(g, g))));
        return __fmul_rn(__fmul_rn(0.5f, g), __fadd_rn(1.f, tanhf(inner)));
    }
    if (act == 2) return __fdiv_rn(g, __fadd_rn(1.f, expf(-g)));
    return g;
}

// SwiGLU of gate g and linear lin: G = min(g, limit), L = clamp(lin, -limit, limit) when
// has_limit, then G * sigmoid(alpha * G) * (L + beta).
__device__ __forceinline__ float moe_swiglu(float g, float lin, float alpha, float beta, float limit, int has_limit) {
    if (has_limit) {
        g = fminf(g, limit);
        lin = fminf(fmaxf(lin, -limit), limit);
    }
    const float gate = __fdiv_rn(g, __fadd_rn(1.f, expf(__fmul_rn(-alpha, g))));
    return __fmul_rn(gate, __fadd_rn(lin, beta));
}

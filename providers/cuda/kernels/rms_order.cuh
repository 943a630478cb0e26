// The RMSNorm's order of sum(v^2), prepended (after pdl.cuh) to every kernel source by
// providers/cuda/module.py, so that every kernel that normalises a row adds its squares the same
// way and a row's bits never depend on which kernel, or which batch size, ran it:
//   group sums:  g_p = fmaf chain over v[d]^2 for d = 16 p .. min(16 p + 15, D - 1) ascending,
//                from 0 (P = ceil(D / 16) groups: one per 16-feature output tile of the
//                projection that produced the row, so that projection's epilogue can make them);
//   lane sums:   s_q = __fadd_rn chain over g_p, from 0, for the p with (p / 4) % 4 == q, in
//                ascending p (four contiguous groups at a time: one float4 load);
//   total:       (s_0 + s_1) + (s_2 + s_3).
// inv = 1 / sqrtf(total / D + eps), and y = fp16((v * inv) * gamma) as before.
#define RMS_GROUP 16

__host__ __device__ constexpr int rms_groups(int D) { return (D + RMS_GROUP - 1) / RMS_GROUP; }

// g_p of a row whose values v (fp32) are readable at v[0 .. D - 1] (shared memory).
__device__ __forceinline__ float rms_group_sum(const float* v, int D, int p) {
    float s = 0.f;
    const int d1 = min(D, (p + 1) * RMS_GROUP);
    for (int d = p * RMS_GROUP; d < d1; ++d) s = fmaf(v[d], v[d], s);
    return s;
}

// The total of the P group sums g[0 .. P - 1] (readable by every thread, e.g. shared memory):
// the four lane sums as independent chains (four contiguous groups at a time), then the pair tree.
__device__ __forceinline__ float rms_total_of(const float* g, int P) {
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    for (int p0 = 0; p0 < P; p0 += 16)
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (p0 + 4 * q + e < P) s[q] = __fadd_rn(s[q], g[p0 + 4 * q + e]);
    return __fadd_rn(__fadd_rn(s[0], s[1]), __fadd_rn(s[2], s[3]));
}

__device__ __forceinline__ float rms_inv(float total, int D, float eps) {
    return __fdiv_rn(1.f, sqrtf(__fadd_rn(__fdiv_rn(total, (float)D), eps)));
}

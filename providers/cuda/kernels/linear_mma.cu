// Tensor-core linear layers for fp16 activations: Y[M, N] = X[M, K] @ W, fp32 accumulation.
// mma.sync.aligned.m16n8k16 fp16 x fp16 -> fp32 with the weights on the MMA M side (16 output
// features per warp tile) and tokens on the MMA N side ("swap-AB"); used for EVERY M, so the
// rounding of a row never switches with the batch size.
//
// Batch invariance: each output (m, n) is produced by the same sequence of mma instructions
// whatever M is: K is cut into fixed segments of SEG_K = 256 (a function of K alone, never of M);
// inside a segment one accumulator chain walks ascending 16-wide k steps; the segment partials
// are added in ascending segment order (__fadd_rn, starting from 0).  Token columns of an mma
// are independent (column j of D depends on column j of B only), so how tokens are tiled
// (NJ n8-tiles per block, the grid's y) is free.  Padding tokens / features are zeros.
//
// dense16: W pre-packed (host side, once) into fragment order: Wp[nt][kt][lane][8] halves
// (K, N zero-padded to multiples of 16).  A lane's 8 halves are its a0..a7 registers.
// nbits4: int4 MatMulNBits weights read in place (codes [N, nb, blob], 2 per byte, LSB first):
// per 64-wide k chunk lane (g, t) reads 8 bytes of rows g and g+8 (codes k0+16t .. +15);
// virtual tile v (0..3) of the chunk maps its k slots (2t, 2t+1, 2t+8, 2t+9) to actual
// k0 + 16t + 4v + (0, 1, 2, 3), and the activations use the same map.
// Dequantisation keeps the fp32 weight of cpu_reference, w = (q - zp) * scale: w is split into
// hi = fp16(w) and lo = fp16(w - hi), and each virtual tile is two mmas (hi, then lo) into the
// same accumulator.  With an integer zero point and fp16 scales, w is exact in fp32 (a 5-bit
// integer times an 11-bit scale) and hi + lo == w, so int4 logits carry no weight rounding
// (rounding w to fp16 alone cost ~2% top-1 agreement with cpu_reference on SmolLM2-shaped
// models).  That case is computed in fp16x2 arithmetic (q via the 0x6400 exponent trick,
// hi = q*s, lo = fma(q, s, -hi): both exact or correctly rounded, so bitwise the fp32 route);
// float zero points or fp32 scales take the fp32 route.
//
// mma_dense NORM = true (NJ = 1): the RMSNorm prologue (norm_rows, below) computes the block's
// activation rows in shared memory first: one launch for SkipSimplifiedLayerNormalization and the
// projection that reads its output (lockstep.RMSNormMatMul), bitwise the two launches.
//
// Kernels, all with the arithmetic above, so the choice between them never changes a bit:
//   mma_dense / mma_nbits4  one 16-feature tile per block, 8 NJ tokens, a warp per K segment
//                           (PIPE: the pipelined load schedule and token-major grid, see mma_dense);
//   mma_wide / mma_wide4    the tiled kernels for 64 rows and more (see mma_wide).
// Which one runs is the launcher's choice (providers/cuda/ops/_mma.py, measured defaults).
#include <cuda_fp16.h>

#define SEG_K 256

__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned ld_x2(const __half* x, long long row, int K, int k, bool ok) {
    // two consecutive halves x[row, k], x[row, k + 1] (k even), zeros past K / invalid rows
    if (!ok) return 0u;
    if (k + 1 < K) return *reinterpret_cast<const unsigned*>(x + row * K + k);
    __half2 h = __halves2half2(k < K ? x[row * K + k] : __float2half(0.f), __float2half(0.f));
    return *reinterpret_cast<unsigned*>(&h);
}

// SiluMul of a gate and an up value, each already rounded to fp16 as MatMul stores them, with
// every step rounded to fp16 exactly as kernels/elementwise.cu ``silu_mul`` does (sigmoid,
// x * s, then * up): the GLU epilogue is bitwise MatMul, MatMul, SiluMul.
__device__ __forceinline__ __half silu_mul_h(__half gate, __half up) {
    const float xv = __half2float(gate);
    const float s = __half2float(__float2half_rn(__fdiv_rn(1.f, __fadd_rn(1.f, expf(-xv)))));
    const float t = __half2float(__float2half_rn(__fmul_rn(xv, s)));
    return __float2half_rn(__fmul_rn(t, __half2float(up)));
}

// Combine the segment partials in ascending order and store.  part: [nseg][16][8*NJ] floats.
// GLU: the block's 16 weight rows are 8 gate rows (0..7) and the 8 up rows of the same output
// features (8..15); output feature n0/2 + r (r < 8) is silu_mul(gate, up), y has n_out columns.
// The accumulators of K segment ``seg`` into part[seg] (one warp's 16 x 8 NJ tile).
template <int NJ>
__device__ __forceinline__ void store_partial(float* part, const float (*acc)[4], int seg) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    constexpr int TM = 8 * NJ;
    float* p = part + seg * 16 * TM;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        p[g * TM + j * 8 + 2 * t] = acc[j][0];
        p[g * TM + j * 8 + 2 * t + 1] = acc[j][1];
        p[(g + 8) * TM + j * 8 + 2 * t] = acc[j][2];
        p[(g + 8) * TM + j * 8 + 2 * t + 1] = acc[j][3];
    }
}

template <int NJ, bool GLU>
__device__ __forceinline__ void finish(float* part, int nseg, const __half* bias,
                                       __half* y, int M, int N, int n0, int m0, int n_out) {
    constexpr int TM = 8 * NJ;
    __syncthreads();
    if constexpr (GLU) {
        for (int o = threadIdx.x; o < 8 * TM; o += blockDim.x) {
            const int r = o / TM, col = o % TM, n = n0 / 2 + r, m = m0 + col;
            if (n < n_out && m < M) {
                float sg = 0.f, su = 0.f;
                for (int w = 0; w < nseg; ++w) {
                    sg = __fadd_rn(sg, part[w * 16 * TM + o]);
                    su = __fadd_rn(su, part[w * 16 * TM + o + 8 * TM]);
                }
                y[(long long)m * n_out + n] = silu_mul_h(__float2half_rn(sg), __float2half_rn(su));
            }
        }
    } else {
        for (int o = threadIdx.x; o < 16 * TM; o += blockDim.x) {
            const int r = o / TM, col = o % TM, n = n0 + r, m = m0 + col;
            if (n < N && m < M) {
                float s = 0.f;
                for (int w = 0; w < nseg; ++w) s = __fadd_rn(s, part[w * 16 * TM + o]);
                if (bias) s = __fadd_rn(s, __half2float(bias[n]));
                y[(long long)m * N + n] = __float2half_rn(s);
            }
        }
    }
}

// Activations x[m, kl .. kl + 15] (16 halves) of one lane for a 64-wide chunk, zeros past K.
__device__ __forceinline__ void ld_x16(const __half* x, long long m, int K, int kl, bool ok, uint4* out) {
    if (ok && kl + 16 <= K && (K & 7) == 0) {
        const uint4* p = reinterpret_cast<const uint4*>(x + m * K + kl);
        out[0] = p[0]; out[1] = p[1];
    } else {
        __half h[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) h[i] = (ok && kl + i < K) ? x[m * K + kl + i] : __float2half(0.f);
        out[0] = *reinterpret_cast<uint4*>(&h[0]); out[1] = *reinterpret_cast<uint4*>(&h[8]);
    }
}

// RMSNorm prologue (NORM kernels, lockstep.RMSNormMatMul): the block's rows m0 .. m0 + R - 1
// (R = min(8, M - m0)) of v = x (+ skip) are normalised with exactly the arithmetic of
// kernels/rms_norm.cu, so the fused launch is bitwise SkipSimplifiedLayerNormalization followed
// by the projection:
//   sum(v^2): 256 virtual threads t, each an fmaf chain over d = t, t + 256, ... ascending; per
//     virtual warp the xor-shuffle tree (lane 0's value); the 8 warp sums added in ascending order.
//   inv = 1 / sqrtf(sum / K + eps); y = fp16((v * inv) * gamma) (v in fp32: x + skip, __fadd_rn).
// Virtual warp vw runs on real warp vw % nwarps (same lanes), so the xor trees are the same.
// Shared memory after the GEMM's partials: x, skip [R][K] and gamma [K] as halves (cp.async, one
// round trip), inv [8], red [8][8], then xs [R][K + 8] halves (y; the pad keeps the rows on
// distinct banks; rows >= R are read as zeros, never stored).  The blocks of column 0 also store v rounded to fp16 (output 3, the residual sum)
// into sum_out.  Needs K % 8 == 0.
struct NormArgs {
    const __half* skip;   // [M, K] or null
    const __half* gamma;  // [K]
    __half* sum_out;      // [M, K] or null
    float eps;
};

// Shared floats of the prologue before xs: raw x, skip (R rows each) and gamma as halves
// (rounded up to floats), inv [8], red [64].
__host__ __device__ constexpr int norm_floats(int rows, int K) { return (2 * rows * K + K + 1) / 2 + 72; }

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}

__device__ void norm_rows(const __half* __restrict__ x, const NormArgs& na, int M, int K, int m0,
                          bool first_tile, float* sm, __half* xs) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5, nt = blockDim.x;
    const int R = min(8, M - m0), xst = K + 8, u8 = K / 8;
    __half* xh = reinterpret_cast<__half*>(sm);  // [R][K]
    __half* sh = xh + R * K;                     // [R][K] (skip)
    __half* gh = sh + R * K;                     // [K]
    float* inv = sm + norm_floats(R, K) - 72; float* red = inv + 8;
    // one memory round trip: every 16-byte piece of x, skip and gamma copied asynchronously
    const int units = (na.skip ? 2 * R + 1 : R + 1) * u8;
    for (int u = threadIdx.x; u < units; u += nt) {
        const int r = u / u8, d0 = (u - r * u8) * 8;
        if (r < R) cp_async16(xh + r * K + d0, x + (long long)(m0 + r) * K + d0);
        else if (r == R) cp_async16(gh + d0, na.gamma + d0);
        else cp_async16(sh + (r - R - 1) * K + d0, na.skip + (long long)(m0 + r - R - 1) * K + d0);
    }
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();
    auto v = [&](int r, int d) {
        const float t = __half2float(xh[r * K + d]);
        return na.skip ? __fadd_rn(t, __half2float(sh[r * K + d])) : t;
    };
    for (int vw = warp; vw < 8; vw += nw) {  // all rows' chains of this virtual warp, then the trees
        float s[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            s[r] = 0.f;
            if (r < R)
                for (int d = vw * 32 + lane; d < K; d += 256) { const float t = v(r, d); s[r] = fmaf(t, t, s[r]); }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int r = 0; r < 8; ++r) s[r] = __fadd_rn(s[r], __shfl_xor_sync(0xffffffffu, s[r], o));
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < 8; ++r) red[r * 8 + vw] = s[r];
    }
    __syncthreads();
    if (threadIdx.x < R) {
        float tot = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) tot = __fadd_rn(tot, red[threadIdx.x * 8 + w]);
        inv[threadIdx.x] = __fdiv_rn(1.f, sqrtf(__fadd_rn(__fdiv_rn(tot, (float)K), na.eps)));
    }
    __syncthreads();
    const bool store_sum = na.sum_out && na.skip && first_tile;
    for (int r = 0; r < R; ++r) {
        const float ir = inv[r];
        for (int d = threadIdx.x; d < K; d += nt) {
            const float t = v(r, d);
            xs[r * xst + d] = __float2half_rn(__fmul_rn(__fmul_rn(t, ir), __half2float(gh[d])));
            if (store_sum) na.sum_out[(long long)(m0 + r) * K + d] = __float2half_rn(t);
        }
    }
    __syncthreads();
}

// Row g's normalised activations xs[g, kl .. kl + 15] (16 halves), zeros past K and for rows
// g >= R (the block's live rows, never written).
__device__ __forceinline__ void ld_xs16(const __half* xs, int g, int K, int kl, int R, uint4* out) {
    const __half* row = xs + g * (K + 8);
    if (g >= R) {
        out[0] = make_uint4(0, 0, 0, 0); out[1] = out[0];
    } else if (kl + 16 <= K) {
        const uint4* p = reinterpret_cast<const uint4*>(row + kl);
        out[0] = p[0]; out[1] = p[1];
    } else {
        __half h[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) h[i] = kl + i < K ? row[kl + i] : __float2half(0.f);
        out[0] = *reinterpret_cast<uint4*>(&h[0]); out[1] = *reinterpret_cast<uint4*>(&h[8]);
    }
}

// 64-wide k chunks of K segment s (SEG_K / 64 but the last one's).
__device__ __forceinline__ int seg_chunks(int K, int s) { return (min(K, (s + 1) * SEG_K) - s * SEG_K + 63) >> 6; }

// k tile i (16 wide) of segment s of a lane's packed dense weight column (base: tile 0, lane's uint4).
__device__ __forceinline__ uint4 ld_tile(const uint4* base, int s, int i) { return base[(long long)(s * 16 + i) * 32]; }

// grid (ceil(N/16), ceil(M/(8 NJ))) (swapped under PIPE, below), block 32 * min(nseg, 8) (nseg = ceil(K / SEG_K); warp w
// computes segments w, w + 8, ..., each its own chain from 0, kept apart until the fold),
// shared nseg * 16 * 8 NJ floats.  wp: [N/16][Kp/16][32] uint4, Kp = K rounded up to 64; the
// 4 tiles of 64-chunk c are virtual tiles v = 0..3 with the nbits4 k-slot map.
// GLU = false: y [M, N] (n_out unused).  GLU = true: the N packed weight rows are gate and up
// interleaved in groups of 8 (rows 16b..16b+7: gate features 8b..8b+7; rows 16b+8..16b+15: the
// up features of the same indices) and y [M, n_out] = silu_mul(x @ gate, x @ up) (see finish).
//
// PIPE picks the weight-load schedule only; the mma sequence of every segment, and so every bit
// of y, is the same for both.  PIPE = false holds 8 k tiles (128 k) of weights per lane: load
// 8, wait, 8 mmas, load the next 8.  PIPE = true holds a whole segment (16 tiles, 256 bytes per
// lane, 8 KB per warp in flight) and refills each tile's registers with the same tile of the
// warp's next segment as soon as its mma has issued, so the loads of segment s + nwarps overlap
// the mmas of segment s and a warp never waits for more than its first round trip.
template <int NJ, bool GLU, bool NORM, bool PIPE>
__global__ void __launch_bounds__(256) mma_dense(const __half* __restrict__ x, const uint4* __restrict__ wp,
                                                 const __half* __restrict__ bias, __half* __restrict__ y,
                                                 int M, int N, int K, int n_out, const __half* n_skip, const __half* n_gamma,
                                                 __half* n_sum, float n_eps) {
    const NormArgs norm{n_skip, n_gamma, n_sum, n_eps};
    static_assert(!NORM || NJ == 1, "the RMSNorm prologue holds 8 rows");
    extern __shared__ float part[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int nseg = (K + SEG_K - 1) / SEG_K, nwarps = blockDim.x >> 5, ktiles = ((K + 63) >> 6) << 2;
    const int nt = PIPE ? blockIdx.y : blockIdx.x, m0 = (PIPE ? blockIdx.x : blockIdx.y) * 8 * NJ;
    const uint4* base = wp + ((long long)nt * ktiles) * 32 + lane;
    constexpr int NA = PIPE ? 16 : 8;  // k tiles of weights held per lane
    uint4 a[NA];
    // The first weights of the warp's first segment are loaded before PDL_ENTER (weights are
    // constants of the step, kernels/pdl.cuh): their latency overlaps the end of the previous kernel.
    {
        const int first = min(NA, 4 * seg_chunks(K, warp));
#pragma unroll
        for (int i = 0; i < NA; ++i) if (i < first) a[i] = ld_tile(base, warp, i);
    }
    PDL_ENTER_GEMM();
    float* nsm = part + nseg * 16 * 8 * NJ;  // NORM: the prologue's shared memory (norm_rows)
    __half* xs = reinterpret_cast<__half*>(nsm + norm_floats(min(8, M - m0), K));
    if constexpr (NORM) norm_rows(x, norm, M, K, m0, nt == 0, nsm, xs);
    // activations of 64-chunk starting at kc for every token tile: 16 halves per lane
    auto load_x = [&](uint4 (*xa)[2], int kc) {
        const int kl = kc + 16 * t;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const int m = m0 + j * 8 + g;
            if constexpr (NORM) ld_xs16(xs, j * 8 + g, K, kl, M - m0, xa[j]);
            else ld_x16(x, m, K, kl, m < M, xa[j]);
        }
    };
    auto mma_tile = [&](float (*acc)[4], const uint4& w, uint4 (*xa)[2], int v) {
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const unsigned* xw = reinterpret_cast<const unsigned*>(&xa[j][0]);
            mma16816(acc[j], reinterpret_cast<const unsigned*>(&w), xw[2 * v], xw[2 * v + 1]);
        }
    };
    for (int seg = warp; seg < nseg; seg += nwarps) {  // K segments: warp w takes w, w + nwarps, ...
        float acc[NJ][4];
#pragma unroll
        for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        const int tiles = 4 * seg_chunks(K, seg), kbeg = seg * SEG_K;
        if constexpr (PIPE) {
            const int next = seg + nwarps, refill = next < nseg ? 4 * seg_chunks(K, next) : 0;
            // one token tile (NJ = 1): the segment's activations are loaded up front (32 bytes
            // per lane per chunk), so no chunk waits for its own activation round trip
            constexpr int XC = NJ == 1 ? 4 : 1;
            uint4 xall[XC][NJ][2];
            if constexpr (NJ == 1) {
#pragma unroll
                for (int c = 0; c < 4; ++c) if (4 * c < tiles) load_x(xall[c], kbeg + 64 * c);
            }
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                if (4 * c >= tiles) break;
                uint4 (*xa)[2] = xall[NJ == 1 ? c : 0];
                if constexpr (NJ != 1) load_x(xa, kbeg + 64 * c);
#pragma unroll
                for (int v = 0; v < 4; ++v) {
                    mma_tile(acc, a[4 * c + v], xa, v);
                    if (4 * c + v < refill) a[4 * c + v] = ld_tile(base, next, 4 * c + v);
                }
            }
        } else {
            for (int i0 = 0; i0 < tiles; i0 += 8) {  // 8 tiles (two 64-chunks) at a time
                const bool two = i0 + 4 < tiles;
                if (i0 != 0 || seg != warp) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) if (i < 4 || two) a[i] = ld_tile(base, seg, i0 + i);
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (h == 1 && !two) break;
                    uint4 xa[NJ][2];
                    load_x(xa, kbeg + 16 * (i0 + 4 * h));
#pragma unroll
                    for (int v = 0; v < 4; ++v) mma_tile(acc, a[4 * h + v], xa, v);
                }
            }
        }
        store_partial<NJ>(part, acc, seg);
    }
    PDL_LATE_TRIGGER();
    finish<NJ, GLU>(part, nseg, bias, y, M, N, nt * 16, m0, n_out);
}

// Tiled dense GEMM for many rows (mma_wide): the per-element arithmetic of mma_dense (per K
// segment one mma chain over the 16-wide k tiles in ascending order, the same k-slot map; the
// segment partials added in ascending order from 0, then the bias, then fp16), so every row is
// bitwise its mma_dense result; only the tiling differs.  The segment fold runs in registers:
// after a segment's last chunk tot = tot + acc (finish's order), then acc restarts from 0.
// Block: 8 warps = 2 token warps x 4 feature warps; a warp's tile is 32 tokens (4 n8 tiles) x
// F 16-feature tiles, the block's 64 tokens x 64 F features.  grid (ceil(M / 64),
// ceil(N / (64 F))): token-major, so the token blocks of one weight tile run together.
// Per 64-wide k chunk the block's activations x[64 tokens][64 k] and its 4 F packed weight tiles'
// 4 k tiles are copied to shared memory with cp.async, WIDE_STAGES chunks deep (WIDE_STAGES - 1
// in flight while one computes); each weight
// fragment is then read by both token warps and each activation row by all 4 feature warps.
// Shared: WIDE_STAGES * (4 F * 128 + 64 * WIDE_XS / 8) uint4.  Needs K % 8 == 0.
#define WIDE_STAGES 3
#define WIDE_XS 72  // halves per staged token row: 64 + 8, so the rows fall on distinct banks

__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool ok) {
    // 16 bytes, or 16 zero bytes when !ok (src is then not read)
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0));
}


// Activations of 64-wide k chunk c for the block's 64 tokens (from m0) into xdst [64][WIDE_XS]
// halves, zeros for tokens past M and k past K (K % 8 == 0: a 16-byte piece is all in or all out).
__device__ __forceinline__ void wide_stage_x(__half* xdst, const __half* __restrict__ x, int M, int K, int m0, int c) {
    for (int p = threadIdx.x; p < 64 * 8; p += blockDim.x) {
        const int r = p >> 3, k = 64 * c + 8 * (p & 7), m = m0 + r;
        const bool ok = m < M && k < K;
        cp_async16_zfill(xdst + r * WIDE_XS + 8 * (p & 7), x + (ok ? (long long)m * K + k : 0), ok);
    }
}

// A token warp's B fragments for chunk stage xst (the block's staged activations): token tile j,
// row g's halves 16 t .. 16 t + 15 of the chunk, as ld_x16 gives them to mma_dense.
__device__ __forceinline__ void wide_load_x(uint4 (*xa)[2], const __half* xst, int wt, int g, int t) {
    const __half* row = xst + (wt * 32 + g) * WIDE_XS + 16 * t;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        xa[j][0] = *reinterpret_cast<const uint4*>(row + j * 8 * WIDE_XS);
        xa[j][1] = *reinterpret_cast<const uint4*>(row + j * 8 * WIDE_XS + 8);
    }
}

// A warp's accumulators (the current segment's chain) and segment totals, from 0.
template <int F>
__device__ __forceinline__ void wide_zero(float (*acc)[4][4], float (*tot)[4][4]) {
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[f][j][e] = tot[f][j][e] = 0.f;
}

// After a K segment's last chunk: tot = tot + acc (finish's fold order), acc restarts from 0.
template <int F>
__device__ __forceinline__ void wide_fold(float (*acc)[4][4], float (*tot)[4][4]) {
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) { tot[f][j][e] = __fadd_rn(tot[f][j][e], acc[f][j][e]); acc[f][j][e] = 0.f; }
}

// The epilogue of finish() for a warp's tiles: lane (g, t) holds, per 16-row weight tile
// tile0 + f and token tile j, rows g (e 0, 1) and g + 8 (e 2, 3) at tokens 2t, 2t + 1.
template <int F, bool GLU>
__device__ __forceinline__ void wide_store(float (*tot)[4][4], const __half* __restrict__ bias, __half* __restrict__ y,
                                           int M, int N, int n_out, int m0, int tile0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, ntiles = (N + 15) >> 4;
#pragma unroll
    for (int f = 0; f < F; ++f) {
        const int tile = tile0 + f;
        if (tile >= ntiles) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = m0 + j * 8 + 2 * t + h;
                if (m >= M) continue;
                if constexpr (GLU) {  // row g: gate feature 8 tile + g; row g + 8: its up
                    const int n = tile * 8 + g;
                    if (n < n_out)
                        y[(long long)m * n_out + n] = silu_mul_h(__float2half_rn(tot[f][j][h]), __float2half_rn(tot[f][j][2 + h]));
                } else {
#pragma unroll
                    for (int rr = 0; rr < 2; ++rr) {
                        const int n = tile * 16 + g + 8 * rr;
                        if (n >= N) continue;
                        float s = tot[f][j][2 * rr + h];
                        if (bias) s = __fadd_rn(s, __half2float(bias[n]));
                        y[(long long)m * N + n] = __float2half_rn(s);
                    }
                }
            }
    }
}

template <int F, bool GLU>
__global__ void __launch_bounds__(256, 2) mma_wide(const __half* __restrict__ x, const uint4* __restrict__ wp,
                                                   const __half* __restrict__ bias, __half* __restrict__ y,
                                                   int M, int N, int K, int n_out) {
    extern __shared__ uint4 wsm[];
    constexpr int TILES = 4 * F, WS = TILES * 128, XS = 64 * WIDE_XS / 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int wt = warp >> 2, wf = warp & 3;  // token warp 0..1, feature warp 0..3
    const int m0 = blockIdx.x * 64, tile0 = blockIdx.y * TILES;
    const int ntiles = (N + 15) >> 4, ktiles = ((K + 63) >> 6) << 2, nchunks = (K + 63) >> 6;
    uint4* ws = wsm;                                                    // [STAGES][TILES][4 k tiles][32 lanes]
    __half* xs = reinterpret_cast<__half*>(wsm + WIDE_STAGES * WS);     // [STAGES][64 tokens][WIDE_XS]
    PDL_ENTER_GEMM();
    // chunk c into stage c % WIDE_STAGES: zeros for tiles past N (and the activations' zeros)
    auto stage = [&](int c) {
        uint4* wdst = ws + (c % WIDE_STAGES) * WS;
        for (int p = threadIdx.x; p < WS; p += blockDim.x) {
            const int tile = tile0 + (p >> 7);
            const bool ok = tile < ntiles;
            cp_async16_zfill(wdst + p, wp + (ok ? ((long long)tile * ktiles + 4 * c) * 32 + (p & 127) : 0), ok);
        }
        wide_stage_x(xs + (c % WIDE_STAGES) * XS * 8, x, M, K, m0, c);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    float acc[F][4][4], tot[F][4][4];
    wide_zero<F>(acc, tot);
    // chunks 0 .. WIDE_STAGES - 2 in flight; one commit group per chunk (empty past K), so
    // waiting for all but the newest WIDE_STAGES - 2 groups means chunk c has landed
#pragma unroll
    for (int c = 0; c < WIDE_STAGES - 1; ++c) {
        if (c < nchunks) stage(c); else asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    for (int c = 0; c < nchunks; ++c) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(WIDE_STAGES - 2) : "memory");  // this thread's chunk c landed
        __syncthreads();  // everyone's; and every warp is done with chunk c - 1, whose stage is refilled next
        if (c + WIDE_STAGES - 1 < nchunks) stage(c + WIDE_STAGES - 1);
        else asm volatile("cp.async.commit_group;\n" ::: "memory");
        const uint4* wst = ws + (c % WIDE_STAGES) * WS + wf * F * 128 + lane;
        uint4 xa[4][2];
        wide_load_x(xa, xs + (c % WIDE_STAGES) * XS * 8, wt, g, t);
#pragma unroll
        for (int v = 0; v < 4; ++v)
#pragma unroll
            for (int f = 0; f < F; ++f) {
                const uint4 w = wst[(f * 4 + v) * 32];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const unsigned* xw = reinterpret_cast<const unsigned*>(&xa[j][0]);
                    mma16816(acc[f][j], reinterpret_cast<const unsigned*>(&w), xw[2 * v], xw[2 * v + 1]);
                }
            }
        if ((c & 3) == 3 || c == nchunks - 1) wide_fold<F>(acc, tot);  // the end of a K segment (4 chunks)
    }
    PDL_LATE_TRIGGER();
    wide_store<F, GLU>(tot, bias, y, M, N, n_out, m0 + wt * 32, tile0 + wf * F);
}

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

template <typename S> struct is_half_t { static constexpr bool value = false; };
template <> struct is_half_t<__half> { static constexpr bool value = true; };

// fp32 route: weights w0, w1 (fp32) -> hi = fp16(w), lo = fp16(w - hi), as packed half2 words.
__device__ __forceinline__ void split_f32(float w0, float w1, unsigned& hi, unsigned& lo) {
    __half2 h = __floats2half2_rn(w0, w1);
    const float2 hf = __half22float2(h);
    hi = *reinterpret_cast<unsigned*>(&h);
    lo = pack2(__fsub_rn(w0, hf.x), __fsub_rn(w1, hf.y));
}

// fp16 route: two codes at bits 0-3 and 16-19 of ``codes``; zq = 1024 + zp, s = scale (half2).
__device__ __forceinline__ void split_f16(unsigned codes, __half2 zq, __half2 s, unsigned& hi, unsigned& lo) {
    const unsigned biased = codes | 0x64006400u;  // halves 1024 + q (exact)
    const __half2 q = __hsub2(*reinterpret_cast<const __half2*>(&biased), zq);  // q - zp, exact
    const __half2 h = __hmul2_rn(q, s);
    const __half2 l = __hfma2(q, s, __hneg2(h));
    hi = *reinterpret_cast<const unsigned*>(&h);
    lo = *reinterpret_cast<const unsigned*>(&l);
}

// One 64-wide k chunk of int4 weights as one lane holds it: 16 codes of rows g and g + 8 of
// the block's tile (ca, cb), their scales and zero points as floats.
struct Chunk4 {
    uint2 ca, cb;
    float sa, sb, za, zb;
};

// Scale s and zero point z (floats) of weight row ``row`` (a valid index) for quantisation block
// blk; s = 0 for rows past N (``valid`` false).  zp_mode: 0 none (8), 1 packed uint8 nibbles
// [N, zp_stride], 2 fp16 [N, nb].
template <typename S>
__device__ __forceinline__ void scale_zp(const S* __restrict__ scales, const void* __restrict__ zp, int zp_mode,
                                         int zp_stride, int nb, int row, bool valid, int blk, float& s, float& z) {
    s = valid ? (float)scales[(long long)row * nb + blk] : 0.f;
    z = 8.f;
    if (zp_mode == 1) {
        const int e = blk * 4;
        z = (float)((((const unsigned char*)zp)[(long long)row * zp_stride + (e >> 3)] >> (e & 7)) & 15u);
    } else if (zp_mode == 2) {
        z = __half2float(((const __half*)zp)[(long long)row * nb + blk]);
    }
}

// The hi and lo A fragments of virtual k tile v (codes 4v .. 4v + 3 of each row) of a lane's chunk.
// a[0]: row g, slots 2t, 2t+1 <- k 4v, 4v+1; a[1]: row g + 8, same slots;
// a[2]: row g, slots 2t+8, 2t+9 <- k 4v+2, 4v+3; a[3]: row g + 8, same slots.
// f16: the fp16 route (fp16 scales, integer zero points), else fp32 (see the file header).
__device__ __forceinline__ void dequant4(const Chunk4& w, int v, bool f16, unsigned* hi, unsigned* lo) {
    const unsigned wa = ((v < 2 ? w.ca.x : w.ca.y) >> (16 * (v & 1))) & 0xffffu;
    const unsigned wb = ((v < 2 ? w.cb.x : w.cb.y) >> (16 * (v & 1))) & 0xffffu;
    if (f16) {
        const __half2 zqa = __float2half2_rn(1024.f + w.za), zqb = __float2half2_rn(1024.f + w.zb);
        const __half2 s2a = __float2half2_rn(w.sa), s2b = __float2half2_rn(w.sb);
        split_f16((wa & 0xfu) | ((wa & 0xf0u) << 12), zqa, s2a, hi[0], lo[0]);
        split_f16((wb & 0xfu) | ((wb & 0xf0u) << 12), zqb, s2b, hi[1], lo[1]);
        split_f16(((wa >> 8) & 0xfu) | ((wa & 0xf000u) << 4), zqa, s2a, hi[2], lo[2]);
        split_f16(((wb >> 8) & 0xfu) | ((wb & 0xf000u) << 4), zqb, s2b, hi[3], lo[3]);
    } else {
        float fa[4], fb[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            fa[e] = __fmul_rn(__fsub_rn((float)((wa >> (4 * e)) & 15u), w.za), w.sa);
            fb[e] = __fmul_rn(__fsub_rn((float)((wb >> (4 * e)) & 15u), w.zb), w.sb);
        }
        split_f32(fa[0], fa[1], hi[0], lo[0]);
        split_f32(fb[0], fb[1], hi[1], lo[1]);
        split_f32(fa[2], fa[3], hi[2], lo[2]);
        split_f32(fb[2], fb[3], hi[3], lo[3]);
    }
}

// int4 MatMulNBits.  grid/block/shared/GLU as mma_dense (GLU: the rows of q, scales and zero
// points interleaved as dense's packed rows).  Requires K % 16 == 0 and fp16 X.  PIPE as in
// mma_dense: false holds one 64-chunk of weights per lane (load, wait, 8 mmas); true holds the
// segment's 4 chunks and refills each with the warp's next segment once its mmas have issued.
// NORM (NJ = 1): mma_dense's RMSNorm prologue (norm_rows), the activations then read from shared
// memory (lockstep.RMSNormMatMul, opt-in: measured slower than the two launches, see
// providers/cuda/ops/rms_norm_matmul.py).  The mma sequence, and so y, is the same for every schedule.
template <int NJ, typename S, bool GLU, bool NORM, bool PIPE>
__global__ void __launch_bounds__(256) mma_nbits4(const __half* __restrict__ x, const unsigned char* __restrict__ q,
                                                  const S* __restrict__ scales, const void* __restrict__ zp,
                                                  int zp_mode, int zp_stride, const __half* __restrict__ bias,
                                                  __half* __restrict__ y, int M, int N, int K, int bs,
                                                  int n_out, const __half* n_skip, const __half* n_gamma,
                                                  __half* n_sum, float n_eps) {
    static_assert(!NORM || NJ == 1, "the RMSNorm prologue holds 8 rows");
    extern __shared__ float part[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int nseg = (K + SEG_K - 1) / SEG_K, nwarps = blockDim.x >> 5;
    const int nb = (K + bs - 1) / bs;
    const long long rowbytes = (long long)nb * (bs / 2);
    const int n0 = (PIPE ? blockIdx.y : blockIdx.x) * 16, m0 = (PIPE ? blockIdx.x : blockIdx.y) * 8 * NJ;
    const int na = min(n0 + g, N - 1), nbr = min(n0 + g + 8, N - 1);
    const bool va = n0 + g < N, vb = n0 + g + 8 < N;
    // Codes, scales and zero points of the 64-wide k chunk at k0 (weights: constants of the step).
    auto load_w = [&](Chunk4& w, int k0) {
        const int kl = k0 + 16 * t;
        w.ca = make_uint2(0, 0); w.cb = make_uint2(0, 0);
        w.sa = 0.f; w.sb = 0.f; w.za = 8.f; w.zb = 8.f;
        if (kl < K) {
            w.ca = *reinterpret_cast<const uint2*>(q + na * rowbytes + kl / 2);
            w.cb = *reinterpret_cast<const uint2*>(q + nbr * rowbytes + kl / 2);
            scale_zp(scales, zp, zp_mode, zp_stride, nb, na, va, kl / bs, w.sa, w.za);
            scale_zp(scales, zp, zp_mode, zp_stride, nb, nbr, vb, kl / bs, w.sb, w.zb);
        }
    };
    constexpr int NC = PIPE ? 4 : 1;  // 64-chunks of weights held per lane
    Chunk4 w[NC];
    {  // before PDL_ENTER: overlaps the end of the previous kernel (kernels/pdl.cuh)
        const int first = min(NC, seg_chunks(K, warp));
#pragma unroll
        for (int c = 0; c < NC; ++c) if (c < first) load_w(w[c], warp * SEG_K + 64 * c);
    }
    PDL_ENTER_GEMM();
    float* nsm = part + nseg * 16 * 8 * NJ;  // NORM: the prologue's shared memory (norm_rows)
    __half* xs = reinterpret_cast<__half*>(nsm + norm_floats(min(8, M - m0), K));
    if constexpr (NORM) norm_rows(x, NormArgs{n_skip, n_gamma, n_sum, n_eps}, M, K, m0, n0 == 0, nsm, xs);
    // the 8 mmas of the chunk at k0 (weights wc) into acc
    auto mma_chunk = [&](float (*acc)[4], const Chunk4& wc, int k0) {
        const int kl = k0 + 16 * t;            // this lane's 16 codes: kl .. kl + 15
        const bool kv = kl < K;
        // activations: x[m, kl .. kl + 15] (32 bytes) per token tile
        uint4 xa[NJ][2];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const int m = m0 + j * 8 + g;
            if constexpr (NORM) {
                ld_xs16(xs, j * 8 + g, K, kl, M - m0, xa[j]);
            } else if (m < M && kv) {
                const uint4* p = reinterpret_cast<const uint4*>(x + (long long)m * K + kl);
                xa[j][0] = p[0]; xa[j][1] = p[1];
            } else {
                xa[j][0] = make_uint4(0, 0, 0, 0); xa[j][1] = xa[j][0];
            }
        }
        const bool f16 = is_half_t<S>::value && zp_mode != 2;
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            unsigned hi[4], lo[4];
            dequant4(wc, v, f16, hi, lo);
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const unsigned* xw = reinterpret_cast<const unsigned*>(&xa[j][0]);  // 8 words = 16 halves
                mma16816(acc[j], hi, xw[2 * v], xw[2 * v + 1]);
                mma16816(acc[j], lo, xw[2 * v], xw[2 * v + 1]);
            }
        }
    };
    for (int seg = warp; seg < nseg; seg += nwarps) {  // K segments: warp w takes w, w + nwarps, ...
        float acc[NJ][4];
#pragma unroll
        for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        const int chunks = seg_chunks(K, seg), kbeg = seg * SEG_K;
        const int next = seg + nwarps, refill = PIPE && next < nseg ? seg_chunks(K, next) : 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) {  // SEG_K / 64 chunks, ascending
            if (c >= chunks) break;
            if constexpr (PIPE) {
                mma_chunk(acc, w[c], kbeg + 64 * c);
                if (c < refill) load_w(w[c], next * SEG_K + 64 * c);
            } else {
                if (c != 0 || seg != warp) load_w(w[0], kbeg + 64 * c);
                mma_chunk(acc, w[0], kbeg + 64 * c);
            }
        }
        store_partial<NJ>(part, acc, seg);
    }
    PDL_LATE_TRIGGER();
    finish<NJ, GLU>(part, nseg, bias, y, M, N, n0, m0, n_out);
}

// Tiled int4 GEMM for many rows (mma_wide4): mma_wide's tiling with mma_nbits4's arithmetic (per
// k tile the hi then the lo mma of the exact dequantised weight, dequant4), so every row is
// bitwise its mma_nbits4 result.  Per chunk the block's 64 F weight rows' 32 code bytes and the
// activations are staged by cp.async; each lane's scales and zero points of the next chunk are
// loaded into registers while the current chunk computes.  grid (ceil(M / 64), ceil(N / (64 F))),
// shared WIDE_STAGES * (128 F + 64 * WIDE_XS / 8) uint4.  Needs K % 32 == 0 and row bytes
// (n_blocks * bs / 2) % 16 == 0.
template <int F, typename S, bool GLU>
__global__ void __launch_bounds__(256) mma_wide4(const __half* __restrict__ x, const unsigned char* __restrict__ q,
                                                 const S* __restrict__ scales, const void* __restrict__ zp,
                                                 int zp_mode, int zp_stride, const __half* __restrict__ bias,
                                                 __half* __restrict__ y, int M, int N, int K, int bs, int n_out) {
    extern __shared__ uint4 wsm[];
    constexpr int ROWS = 64 * F, CS = 2 * ROWS, XS = 64 * WIDE_XS / 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int wt = warp >> 2, wf = warp & 3;
    const int m0 = blockIdx.x * 64, r0 = blockIdx.y * ROWS, nchunks = (K + 63) >> 6;
    const int nb = (K + bs - 1) / bs;
    const long long rowbytes = (long long)nb * (bs / 2);
    uint4* cs = wsm;                                                 // [STAGES][ROWS][32 bytes]
    __half* xs = reinterpret_cast<__half*>(wsm + WIDE_STAGES * CS);  // [STAGES][64 tokens][WIDE_XS]
    PDL_ENTER_GEMM();
    auto stage = [&](int c) {
        uint4* cdst = cs + (c % WIDE_STAGES) * CS;
        for (int p = threadIdx.x; p < CS; p += blockDim.x) {
            const int row = r0 + (p >> 1), k = 64 * c + 32 * (p & 1);
            const bool ok = row < N && k < K;
            cp_async16_zfill(cdst + p, q + (ok ? row * rowbytes + k / 2 : 0), ok);
        }
        wide_stage_x(xs + (c % WIDE_STAGES) * XS * 8, x, M, K, m0, c);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    // scales and zero points of chunk c for the lane's rows g and g + 8 of each of its tiles
    auto load_sz = [&](float (*sz)[4], int c) {
        const int kl = 64 * c + 16 * t;
#pragma unroll
        for (int f = 0; f < F; ++f) {
            sz[f][0] = 0.f; sz[f][1] = 0.f; sz[f][2] = 8.f; sz[f][3] = 8.f;
            if (kl < K) {
                const int ra = r0 + (wf * F + f) * 16 + g, rb = ra + 8;
                scale_zp(scales, zp, zp_mode, zp_stride, nb, min(ra, N - 1), ra < N, kl / bs, sz[f][0], sz[f][2]);
                scale_zp(scales, zp, zp_mode, zp_stride, nb, min(rb, N - 1), rb < N, kl / bs, sz[f][1], sz[f][3]);
            }
        }
    };
    const bool f16 = is_half_t<S>::value && zp_mode != 2;
    float acc[F][4][4], tot[F][4][4], cur[F][4], nxt[F][4];
    wide_zero<F>(acc, tot);
    load_sz(cur, 0);
    // chunks 0 .. WIDE_STAGES - 2 in flight; one commit group per chunk (empty past K), so
    // waiting for all but the newest WIDE_STAGES - 2 groups means chunk c has landed
#pragma unroll
    for (int c = 0; c < WIDE_STAGES - 1; ++c) {
        if (c < nchunks) stage(c); else asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    for (int c = 0; c < nchunks; ++c) {
        if (c + 1 < nchunks) load_sz(nxt, c + 1);
        asm volatile("cp.async.wait_group %0;\n" ::"n"(WIDE_STAGES - 2) : "memory");  // this thread's chunk c landed
        __syncthreads();  // everyone's; and every warp is done with chunk c - 1, whose stage is refilled next
        if (c + WIDE_STAGES - 1 < nchunks) stage(c + WIDE_STAGES - 1);
        else asm volatile("cp.async.commit_group;\n" ::: "memory");
        const unsigned char* cst = reinterpret_cast<const unsigned char*>(cs + (c % WIDE_STAGES) * CS);
        const bool kv = 64 * c + 16 * t < K;
        uint4 xa[4][2];
        wide_load_x(xa, xs + (c % WIDE_STAGES) * XS * 8, wt, g, t);
        Chunk4 w[F];
#pragma unroll
        for (int f = 0; f < F; ++f) {  // codes 16 t .. 16 t + 15 of rows g and g + 8 (zeros past K)
            const int la = (wf * F + f) * 16 + g;
            w[f].ca = kv ? *reinterpret_cast<const uint2*>(cst + la * 32 + 8 * t) : make_uint2(0, 0);
            w[f].cb = kv ? *reinterpret_cast<const uint2*>(cst + (la + 8) * 32 + 8 * t) : make_uint2(0, 0);
            w[f].sa = cur[f][0]; w[f].sb = cur[f][1]; w[f].za = cur[f][2]; w[f].zb = cur[f][3];
        }
#pragma unroll
        for (int v = 0; v < 4; ++v)
#pragma unroll
            for (int f = 0; f < F; ++f) {
                unsigned hi[4], lo[4];
                dequant4(w[f], v, f16, hi, lo);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const unsigned* xw = reinterpret_cast<const unsigned*>(&xa[j][0]);
                    mma16816(acc[f][j], hi, xw[2 * v], xw[2 * v + 1]);
                    mma16816(acc[f][j], lo, xw[2 * v], xw[2 * v + 1]);
                }
            }
        if ((c & 3) == 3 || c == nchunks - 1) wide_fold<F>(acc, tot);
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) cur[f][e] = nxt[f][e];
    }
    PDL_LATE_TRIGGER();
    wide_store<F, GLU>(tot, bias, y, M, N, n_out, m0 + wt * 32, r0 / 16 + wf * F);
}

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
// nbits4: int4 MatMulNBits weights read in place (codes [N, nb, blob], 2 per byte, LSB first);
// per 64-wide k chunk lane (g, t) reads 8 bytes of rows g and g+8 (codes k0+16t .. +15) and a
// quad transpose gives every lane its 4 codes of each natural 16-wide k tile.  The products
// (q - z) x are exact and summed by the tensor core per 32-wide group, then scaled once in fp32
// ("scale after", the int4 section below; fp16 zero points and blocks under 32 are refused, the
// CUDA-core kernel of linear.cu serves them).
//
// Kernels, all with the arithmetic above, so the choice between them never changes a bit:
//   mma_dense / mma_nbits4  one 16-feature tile per block, 8 NJ tokens, a warp per K segment
//                           (PIPE: the pipelined load schedule and token-major grid, see mma_dense;
//                           mma_nbits4 split-K: a tile's segments over several blocks, see split_last);
//   mma_wide / mma_wide4    the tiled kernels for 64 rows and more (see mma_wide).
// Which one runs is the launcher's choice (providers/cuda/ops/_mma.py, measured defaults).
#include <cuda_fp16.h>

#define SEG_K 256

__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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

// Split-K of mma_nbits4 (NJ = 1 and gridDim.z > 1, the launcher's choice: split_count in
// providers/cuda/ops/_mma.py).  Block z of a feature tile computes K segments z spb ..
// min(nseg, (z + 1) spb) - 1 and stores their partials in the global workspace sk_part
// ([tile (blockIdx.y * gridDim.x + blockIdx.x)][nseg][16][8] floats) instead of shared memory.
// The tile's last block to finish (an atomic ticket in sk_tickets, which that block resets to 0)
// folds all nseg partials with finish: the same values added in the same ascending order, so a
// split launch is bitwise the unsplit one.
// After a split block stored its partials: whether it is the tile's last (then it folds).
__device__ __forceinline__ bool split_last(int* tickets, int tile_block) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int t = atomicAdd(tickets + tile_block, 1);
        last = t == (int)gridDim.z - 1;
        if (last) tickets[tile_block] = 0;  // every block of this tile has taken its ticket
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// Activations x[m, kl .. kl + 15] (16 halves) of one lane for a 64-wide chunk, zeros past K.
__device__ __forceinline__ void ld_x16(const __half* x, long long m, int K, int kl, bool ok, uint4* out) {
    if (!ok) {  // a row past M (most lanes of a one-row launch): no element loop
        out[0] = make_uint4(0, 0, 0, 0); out[1] = out[0];
    } else if (kl + 16 <= K && (K & 7) == 0) {
        const uint4* p = reinterpret_cast<const uint4*>(x + m * K + kl);
        out[0] = p[0]; out[1] = p[1];
    } else {
        __half h[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) h[i] = kl + i < K ? x[m * K + kl + i] : __float2half(0.f);
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
template <int NJ, bool GLU, bool PIPE>
__global__ void __launch_bounds__(256) mma_dense(const __half* __restrict__ x, const uint4* __restrict__ wp,
                                                 const __half* __restrict__ bias, __half* __restrict__ y,
                                                 int M, int N, int K, int n_out) {
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
    PDL_ENTER();
    // activations of 64-chunk starting at kc for every token tile: 16 halves per lane
    auto load_x = [&](uint4 (*xa)[2], int kc) {
        const int kl = kc + 16 * t;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const int m = m0 + j * 8 + g;
            ld_x16(x, m, K, kl, m < M, xa[j]);
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
// Shared: ST * (FW F * 128 + ROWS * WIDE_XS / 8) uint4 (ST = wide_stages(F, TW), FW = wide_fw(F, TW)).
// Needs K % 8 == 0.
#define WIDE_STAGES 3
// Stages of the one-token-warp tiles of one 16-feature tile a warp (TW = 1, F = 1: Llama-3.2-1B's
// gate/up at 17 to 32 rows): 3 chunks in flight a block, enough to cover the copy latency (more
// stages measured no faster).  The 128-feature-per-warp-pair form (F = 2) keeps WIDE_STAGES: a
// fourth stage would cost it a block a multiprocessor.
#define WIDE32_STAGES 4
#define WIDE_XS 72  // halves per staged token row: 64 + 8, so the rows fall on distinct banks
// Feature warps of those tiles (TW = 1, F = 1): 8, a block of 128 features, so each staged
// activation chunk serves 8 warps and the grid copies the activations half as often as with 4
// (measured faster on Llama-3.2-1B's gate/up at 32 rows).  Other forms: 4.
#define WIDE32_FW 8

__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool ok) {
    // 16 bytes, or 16 zero bytes when !ok (src is then not read)
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0));
}


// Activations of 64-wide k chunk c for the block's 64 tokens (from m0) into xdst [64][XS]
// halves, zeros for tokens past M and k past K (K % 8 == 0: a 16-byte piece is all in or all out).
template <int XS>
__device__ __forceinline__ void wide_stage_x(__half* xdst, const __half* __restrict__ x, int M, int K, int m0, int c) {
    for (int p = threadIdx.x; p < 64 * 8; p += blockDim.x) {
        const int r = p >> 3, k = 64 * c + 8 * (p & 7), m = m0 + r;
        const bool ok = m < M && k < K;
        cp_async16_zfill(xdst + r * XS + 8 * (p & 7), x + (ok ? (long long)m * K + k : 0), ok);
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

__host__ __device__ constexpr int wide_stages(int F, int TW) { return TW == 1 && F == 1 ? WIDE32_STAGES : WIDE_STAGES; }
// feature warps of a block (each F 16-feature tiles wide)
__host__ __device__ constexpr int wide_fw(int F, int TW) { return TW == 1 && F == 1 ? WIDE32_FW : 4; }

// TW = 2 is the block above; TW = 1 (launches of at most 32 rows) has one token warp and FW =
// wide_fw(F, 1) feature warps (8 for F = 1, else 4): 32 tokens x 16 FW F features, the same
// per-warp tiles, so each staged activation row serves the FW feature warps and no token warp
// computes only padding.
template <int F, bool GLU, int TW>
__global__ void __launch_bounds__(32 * TW * wide_fw(F, TW), 16 / (TW * wide_fw(F, TW))) mma_wide(const __half* __restrict__ x, const uint4* __restrict__ wp,
                                                   const __half* __restrict__ bias, __half* __restrict__ y,
                                                   int M, int N, int K, int n_out) {
    extern __shared__ uint4 wsm[];
    constexpr int ST = wide_stages(F, TW), FW = wide_fw(F, TW);
    constexpr int TILES = FW * F, WS = TILES * 128, ROWS = 32 * TW, XS = ROWS * WIDE_XS / 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int wt = warp / FW, wf = warp % FW;  // token warp 0..TW - 1, feature warp 0..FW - 1
    const int m0 = blockIdx.x * ROWS, tile0 = blockIdx.y * TILES;
    const int ntiles = (N + 15) >> 4, ktiles = ((K + 63) >> 6) << 2, nchunks = (K + 63) >> 6;
    uint4* ws = wsm;                                                    // [STAGES][TILES][4 k tiles][32 lanes]
    __half* xs = reinterpret_cast<__half*>(wsm + ST * WS);              // [STAGES][ROWS tokens][WIDE_XS]
    PDL_ENTER();
    // stage(c): chunk c into stage c % ST, zeros for tiles past N, tokens past M and k past K.
    // The copies start from per-thread bases worked out once: thread i copies weight pieces
    // p = i + j NT (j < WPT; tile tile0 + p / 128, lane piece i % 128, as NT is a multiple of 128)
    // and activation pieces p = i + j NT (j < XPT; row p / 8, 8 halves at 8 (p % 8)); chunk c adds
    // 128 c pieces (its 4 k tiles) and 64 c halves.  Unrolled and without per-copy index
    // arithmetic, a chunk's copies are about 50 instructions instead of 110, on the tiles'
    // critical path.
    constexpr int NT = 32 * TW * FW, WPT = WS / NT, XPT = ROWS * 8 / NT;
    static_assert(WS % NT == 0 && (ROWS * 8) % NT == 0 && NT % 128 == 0, "whole pieces per thread");
    const long long wstep = (long long)(NT >> 7) * ktiles * 32;  // one thread's tiles are NT / 128 apart
    const int wtile = tile0 + (threadIdx.x >> 7);
    const uint4* wbase = wp + ((long long)wtile * ktiles) * 32 + (threadIdx.x & 127);
    const int xcol = 8 * (threadIdx.x & 7), xrow = threadIdx.x >> 3;
    const __half* xbase = x + (long long)(m0 + xrow) * K + xcol;
    auto stage = [&](int c) {
        uint4* wdst = ws + (c % ST) * WS + threadIdx.x;
#pragma unroll
        for (int j = 0; j < WPT; ++j) {
            const bool ok = wtile + j * (NT >> 7) < ntiles;
            cp_async16_zfill(wdst + j * NT, ok ? wbase + j * wstep + 128 * c : wp, ok);
        }
        __half* xdst = xs + (c % ST) * XS * 8 + xrow * WIDE_XS + xcol;
        const bool kok = 64 * c + xcol < K;
#pragma unroll
        for (int j = 0; j < XPT; ++j) {
            const bool ok = kok && m0 + xrow + j * (NT >> 3) < M;
            cp_async16_zfill(xdst + j * (NT >> 3) * WIDE_XS, ok ? xbase + (long long)j * (NT >> 3) * K + 64 * c : x, ok);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    float acc[F][4][4], tot[F][4][4];
    wide_zero<F>(acc, tot);
    // chunks 0 .. ST - 2 in flight; one commit group per chunk (empty past K), so
    // waiting for all but the newest ST - 2 groups means chunk c has landed
#pragma unroll
    for (int c = 0; c < ST - 1; ++c) {
        if (c < nchunks) stage(c); else asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    for (int c = 0; c < nchunks; ++c) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 2) : "memory");  // this thread's chunk c landed
        __syncthreads();  // everyone's; and every warp is done with chunk c - 1, whose stage is refilled next
        if (c + ST - 1 < nchunks) stage(c + ST - 1);
        else asm volatile("cp.async.commit_group;\n" ::: "memory");
        const uint4* wst = ws + (c % ST) * WS + wf * F * 128 + lane;
        uint4 xa[4][2];
        wide_load_x(xa, xs + (c % ST) * XS * 8, wt, g, t);
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
    wide_store<F, GLU>(tot, bias, y, M, N, n_out, m0 + wt * 32, tile0 + wf * F);
}

// ---- int4 (MatMulNBits) ------------------------------------------------------------------------
// k-slot map: virtual k tile v (0..3) of the 64-wide chunk at k0 is the natural tile
// k0 + 16 v .. k0 + 16 v + 15 (tiles 2h, 2h + 1 form a 32-wide group, one quantisation block
// as block_size >= 32); lane (g, t)'s slots (2t, 2t+1, 2t+8, 2t+9) hold k0 + 16 v + 4 t + (0..3),
// for the weights and the activations alike.
//
// Packed layout (made once at plan time by providers/cuda/ops/_mma.py pack_int4; rows and k
// zero-padded to 16 and 64; tile nt = rows 16 nt .. 16 nt + 15, chunk c = k 64 c .. 64 c + 63):
//   codes uint4 qp[nt][c][lane]: lane (g, t)'s 16 bytes, word v = the 8 codes of its slots in
//     tile v, nibble p = hi + 2 i1 + 4 i0 (LSB first) holding row 16 nt + 8 hi + g at
//     k = 64 c + 16 v + 4 t + 2 i1 + i0.  So (W >> 4 j) & 0x000f000f puts the A fragment pair
//     a[j] in the low nibbles of its two halves: a[0] row g (k +0, +1), a[1] row g + 8 (k +0, +1),
//     a[2] row g (k +2, +3), a[3] row g + 8 (k +2, +3); or-ing 0x6400 makes each half 1024 + q.
//   scales S sp[nt][b][g][hi] (nbp blocks b of block_size bs = 2^lbs per row: the model's own
//     n_blocks when K is a multiple of 64 and bs, else padded to cover the chunks): the scale of
//     row 16 nt + 8 hi + g for k in b bs .. b bs + bs - 1 (0 for rows past N and blocks past the
//     model's n_blocks; a block that ends past K keeps its scale, its codes there are 0).  Group h of chunk c
//     (k 64 c + 32 h .. + 31) lies in block (64 c + 32 h) >> lbs.
//   zero points (optional) __half zq[nt][b][g][hi], the same indexing: 1024 + z (z = 8 when absent).
// One 16-byte code load and one or two (bs = 32) scale-pair loads per lane per chunk, and no
// shuffles: the layout does what a quad transpose and per-lane scale loads did on the raw
// MatMulNBits bytes.
//
// Arithmetic of output (m, n) ("scale after", exact products): per 32-wide k group (tiles
// 2h, 2h + 1 of a chunk, inside one quantisation block),
//   T = mma(q - z, x) over the group's 32 k: two mmas, the first from 0 (fp32 accumulation),
//       q - z an exact fp16 integer (1024 + q minus 1024 + z);
//   acc = fmaf(T, s, acc), s = float(scale[n, the group's block]);
// acc runs over a K segment's groups in ascending order from 0; segments fold as in finish().
// Every product (q - z) x is exact in fp32, so the one rounding of the weight side is the
// fmaf by s.  mma_nbits4 (every schedule) and mma_wide4 run this same sequence per element.

// A lane's (row g, row g + 8) scale pair of one block (sp's last axis) as loaded.
template <typename S> struct ScalePair { using type = float2; };
template <> struct ScalePair<__half> { using type = __half2; };
__device__ __forceinline__ float2 scale_f2(__half2 s) { return __half22float2(s); }
__device__ __forceinline__ float2 scale_f2(float2 s) { return s; }

// Where a launch's packed int4 weights are: codes, scales, zero points (or null) and blocks.
template <typename S> struct Packed4 {
    const uint4* __restrict__ qp;
    const typename ScalePair<S>::type* __restrict__ sp;
    const __half2* __restrict__ zq;
    int nchunks, nbp, lbs;  // chunks per tile, scale blocks per tile row, log2(block_size)
};

// One 64-wide k chunk of packed int4 weights as one lane holds it.
template <typename S> struct Chunk4 {
    uint4 c;                                 // codes (qp)
    typename ScalePair<S>::type s[2];        // scales of groups h = 0, 1
    __half2 zq[2];                           // 1024 + z of groups h = 0, 1 (ZP kernels only)
};

// Chunk c of feature tile ``tile`` (nchunks per tile) for lane (g, t).
// The scales (and zero points) of chunk c of feature tile ``tile`` for lane (g, t): one pair,
// used by both groups, when bs >= 64; two when bs = 32.  mma_wide4 stages the codes apart.
template <typename S, bool ZP>
__device__ __forceinline__ void load_scales4(Chunk4<S>& w, const Packed4<S>& p, long long tile, int c) {
    const long long b0 = (tile * p.nbp + ((64 * c) >> p.lbs)) * 8 + ((threadIdx.x & 31) >> 2);
    w.s[0] = p.sp[b0];
    w.s[1] = p.lbs == 5 ? p.sp[b0 + 8] : w.s[0];
    if constexpr (ZP) {
        w.zq[0] = p.zq[b0];
        w.zq[1] = p.lbs == 5 ? p.zq[b0 + 8] : w.zq[0];
    }
}
template <typename S, bool ZP>
__device__ __forceinline__ void load_chunk4(Chunk4<S>& w, const Packed4<S>& p, long long tile, int c) {
    w.c = p.qp[(tile * p.nchunks + c) * 32 + (threadIdx.x & 31)];
    load_scales4<S, ZP>(w, p, tile, c);
}

// 1024 + q of the two nibbles at bits 0-3 and 16-19 of w, as two halves, minus zq (exact).
__device__ __forceinline__ unsigned codes_minus_z(unsigned w, __half2 zq) {
    const unsigned b = (w & 0x000f000fu) | 0x64006400u;
    const __half2 d = __hsub2(*reinterpret_cast<const __half2*>(&b), zq);
    return *reinterpret_cast<const unsigned*>(&d);
}

// d = A B (C = 0): the tile's products summed by the tensor core, from zero.
__device__ __forceinline__ void mma16816_zero(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}

// The 2 k groups of one chunk (weights ``w`` as loaded, activations xq[j][v]: token tile j's B
// fragment of tile v) into acc[j] with the arithmetic above.
template <int NJ, typename S, bool ZP>
__device__ __forceinline__ void mma4_chunk(float (*acc)[4], const Chunk4<S>& w, uint2 (*xq)[4]) {
    const unsigned words[4] = {w.c.x, w.c.y, w.c.z, w.c.w};
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // tiles 2h, 2h + 1: one 32-wide group
        const float2 s = scale_f2(w.s[h]);
        const unsigned nozp = 0x64086408u;  // 1024 + 8 in both halves: no zero points
        __half2 zq = *reinterpret_cast<const __half2*>(&nozp);
        if constexpr (ZP) zq = w.zq[h];
        const __half2 zqa = __low2half2(zq), zqb = __high2half2(zq);
        float d[NJ][4];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int v = 2 * h + u;
            const unsigned W = words[v];
            unsigned a[4];  // rows g (a[0], a[2]) and g + 8 (a[1], a[3]) at k (+0, +1) and (+2, +3)
            a[0] = codes_minus_z(W, zqa);
            a[1] = codes_minus_z(W >> 4, zqb);
            a[2] = codes_minus_z(W >> 8, zqa);
            a[3] = codes_minus_z(W >> 12, zqb);
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                if (u == 0) mma16816_zero(d[j], a, xq[j][v].x, xq[j][v].y);
                else mma16816(d[j], a, xq[j][v].x, xq[j][v].y);
            }
        }
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            acc[j][0] = fmaf(d[j][0], s.x, acc[j][0]);
            acc[j][1] = fmaf(d[j][1], s.x, acc[j][1]);
            acc[j][2] = fmaf(d[j][2], s.y, acc[j][2]);
            acc[j][3] = fmaf(d[j][3], s.y, acc[j][3]);
        }
    }
}

// Activations of row m for the chunk at k0 in the int4 slot map: xq[v] = x[m, k0 + 16 v + 4 t .. + 3]
// (zeros for an invalid row or tiles past K; K % 16 == 0, so a piece is all in or all out).
__device__ __forceinline__ void ld_x4q(const __half* x, long long m, int K, int k0, int t, bool ok, uint2* xq) {
#pragma unroll
    for (int v = 0; v < 4; ++v) {
        const int k = k0 + 16 * v + 4 * t;
        xq[v] = ok && k < K ? *reinterpret_cast<const uint2*>(x + m * K + k) : make_uint2(0, 0);
    }
}

// int4 MatMulNBits on packed weights (qp, sp, zqp: the layout above; ZP: zero points present).
// grid/block/shared/GLU as mma_dense (GLU: the packed rows are gate and up interleaved as
// dense's), but for split-K: grid z is the split (block 32 * min(spb, 8), spb = segments per
// split block, nseg unsplit; warp w computes segments s_lo + w, s_lo + w + 8, ...; no shared
// partials when split, see split_last).  Requires K % 16 == 0 and fp16 X.  PIPE as in mma_dense:
// false holds one 64-chunk of weights per lane (load, wait, 4 tiles); true holds the segment's 4
// chunks and refills each with the warp's next segment once its tiles have issued.  The sequence of every element (the header of this
// section) is the same for every schedule.
template <int NJ, typename S, bool GLU, bool PIPE, bool ZP>
__global__ void __launch_bounds__(256, NJ == 1 ? 4 : NJ == 4 ? 2 : 1) mma_nbits4(const __half* __restrict__ x, const uint4* __restrict__ qp,
                                                  const typename ScalePair<S>::type* __restrict__ sp,
                                                  const __half2* __restrict__ zqp, int nbp, int lbs,
                                                  const __half* __restrict__ bias,
                                                  __half* __restrict__ y, int M, int N, int K,
                                                  int n_out, float* sk_part, int* sk_tickets, int spb) {
    extern __shared__ float part[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int nseg = (K + SEG_K - 1) / SEG_K, nwarps = blockDim.x >> 5, nchunks = (K + 63) >> 6;
    // split-K only for one token tile (the launcher's rule; NJ > 1 keeps its unsplit registers)
    constexpr bool CAN_SPLIT = NJ == 1;
    const bool split = CAN_SPLIT && gridDim.z > 1;
    const int s_lo = split ? blockIdx.z * spb : 0, s_hi = split ? min(nseg, s_lo + spb) : nseg, seg0 = s_lo + warp;
    const int tile_block = blockIdx.y * gridDim.x + blockIdx.x;
    float* pout = split ? sk_part + (long long)tile_block * nseg * 16 * 8 * NJ : part;
    const int nt = PIPE ? blockIdx.y : blockIdx.x, n0 = nt * 16, m0 = (PIPE ? blockIdx.x : blockIdx.y) * 8 * NJ;
    // Codes, scales and zero points of 64-chunk c (weights: constants of the step).
    const Packed4<S> pk{qp, sp, zqp, nchunks, nbp, lbs};
    auto load_w = [&](Chunk4<S>& w, int c) { load_chunk4<S, ZP>(w, pk, nt, c); };
    constexpr int NC = PIPE ? 4 : 1;  // 64-chunks of weights held per lane
    Chunk4<S> w[NC];
    {  // before PDL_ENTER: overlaps the end of the previous kernel (kernels/pdl.cuh)
        const int first = seg0 < s_hi ? min(NC, seg_chunks(K, seg0)) : 0;
#pragma unroll
        for (int c = 0; c < NC; ++c) if (c < first) load_w(w[c], seg0 * (SEG_K / 64) + c);
    }
    PDL_ENTER();
    // the 4 tiles of the chunk at k0 (weights wc) into acc
    auto mma_chunk = [&](float (*acc)[4], const Chunk4<S>& wc, int k0) {
        uint2 xq[NJ][4];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const int m = m0 + j * 8 + g;
            ld_x4q(x, m, K, k0, t, m < M, xq[j]);
        }
        mma4_chunk<NJ, S, ZP>(acc, wc, xq);
    };
    for (int seg = seg0; seg < s_hi; seg += nwarps) {  // K segments: warp w takes s_lo + w, + nwarps, ...
        float acc[NJ][4];
#pragma unroll
        for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        const int chunks = seg_chunks(K, seg), kbeg = seg * SEG_K, cbeg = seg * (SEG_K / 64);
        const int next = seg + nwarps, refill = PIPE && next < s_hi ? seg_chunks(K, next) : 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) {  // SEG_K / 64 chunks, ascending
            if (c >= chunks) break;
            if constexpr (PIPE) {
                mma_chunk(acc, w[c], kbeg + 64 * c);
                if (c < refill) load_w(w[c], next * (SEG_K / 64) + c);
            } else {
                if (c != 0 || seg != seg0) load_w(w[0], cbeg + c);
                mma_chunk(acc, w[0], kbeg + 64 * c);
            }
        }
        store_partial<NJ>(pout, acc, seg);
    }
    if (split && !split_last(sk_tickets, tile_block)) return;
    finish<NJ, GLU>(pout, nseg, bias, y, M, N, n0, m0, n_out);
}

// Activations of int4 chunk stage xst for a token warp in the int4 slot map: token tile j, row g,
// xq[j][v] = halves 16 v + 4 t .. + 3 of the chunk.  WIDE_XS4 (80 halves, 40 words) puts the 4
// rows x 4 lanes of a half warp's 8-byte reads on distinct banks.
#define WIDE_XS4 80
__device__ __forceinline__ void wide_load_x4q(uint2 (*xq)[4], const __half* xst, int wt, int g, int t) {
    const __half* row = xst + (wt * 32 + g) * WIDE_XS4 + 4 * t;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) xq[j][v] = *reinterpret_cast<const uint2*>(row + j * 8 * WIDE_XS4 + 16 * v);
}

// Tiled int4 GEMM for many rows (mma_wide4): mma_wide's tiling with mma_nbits4's arithmetic (the
// groups of mma4_chunk in ascending k, the segment fold after every 4 chunks), so every row is
// bitwise its mma_nbits4 result.  Per chunk the block's 4 F packed tiles (512 bytes each) and the
// activations are staged by cp.async; each lane's scales and zero points of the next chunk are
// loaded into registers while the current chunk computes.  grid (ceil(M / 64), ceil(N / (64 F))),
// shared WIDE_STAGES * (128 F + 64 * WIDE_XS4 / 8) uint4.  Needs K % 16 == 0.
template <int F, typename S, bool GLU, bool ZP>
__global__ void __launch_bounds__(256) mma_wide4(const __half* __restrict__ x, const uint4* __restrict__ qp,
                                                 const typename ScalePair<S>::type* __restrict__ sp,
                                                 const __half2* __restrict__ zqp, int nbp, int lbs,
                                                 const __half* __restrict__ bias,
                                                 __half* __restrict__ y, int M, int N, int K, int n_out) {
    extern __shared__ uint4 wsm[];
    constexpr int TILES = 4 * F, CS = TILES * 32, XS = 64 * WIDE_XS4 / 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int wt = warp >> 2, wf = warp & 3;
    const int m0 = blockIdx.x * 64, tile0 = blockIdx.y * TILES, nchunks = (K + 63) >> 6, ntiles = (N + 15) >> 4;
    const Packed4<S> pk{qp, sp, zqp, nchunks, nbp, lbs};
    uint4* cs = wsm;                                                 // [STAGES][TILES][32 lanes]
    __half* xs = reinterpret_cast<__half*>(wsm + WIDE_STAGES * CS);  // [STAGES][64 tokens][WIDE_XS4]
    PDL_ENTER();
    auto stage = [&](int c) {
        uint4* cdst = cs + (c % WIDE_STAGES) * CS;
        for (int p = threadIdx.x; p < CS; p += blockDim.x) {
            const int tile = tile0 + (p >> 5);
            const bool ok = tile < ntiles;
            cp_async16_zfill(cdst + p, qp + (ok ? ((long long)tile * nchunks + c) * 32 + (p & 31) : 0), ok);
        }
        wide_stage_x<WIDE_XS4>(xs + (c % WIDE_STAGES) * XS * 8, x, M, K, m0, c);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    // scales and zero points of chunk c for the lane's rows of each of its tiles (tiles past N: 0)
    auto load_sz = [&](Chunk4<S>* w, int c) {
#pragma unroll
        for (int f = 0; f < F; ++f) {
            load_scales4<S, ZP>(w[f], pk, min(tile0 + wf * F + f, ntiles - 1), c);  // past N: never stored
        }
    };
    float acc[F][4][4], tot[F][4][4];
    wide_zero<F>(acc, tot);
    Chunk4<S> cur[F], nxt[F];
    load_sz(cur, 0);
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
        const uint4* cst = cs + (c % WIDE_STAGES) * CS;
        uint2 xq[4][4];
        wide_load_x4q(xq, xs + (c % WIDE_STAGES) * XS * 8, wt, g, t);
#pragma unroll
        for (int f = 0; f < F; ++f) {
            cur[f].c = cst[(wf * F + f) * 32 + lane];
            mma4_chunk<4, S, ZP>(acc[f], cur[f], xq);
        }
        if ((c & 3) == 3 || c == nchunks - 1) wide_fold<F>(acc, tot);
#pragma unroll
        for (int f = 0; f < F; ++f) cur[f] = nxt[f];
    }
    wide_store<F, GLU>(tot, bias, y, M, N, n_out, m0 + wt * 32, tile0 + wf * F);
}

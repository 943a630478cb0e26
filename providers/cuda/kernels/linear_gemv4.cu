// Int4 GEMV for launches of 1 to 8 rows (gemv4): Y[M, N] = X[M, K] @ dequant(W)^T on the packed int4
// layout of linear_mma.cu (its int4 section), bitwise mma_nbits4 / mma_wide4.  Compiled after
// linear_mma.cu (providers/cuda/module.py AFTER), whose device functions and types it uses.
//
// Arithmetic of output (m, n): exactly mma_nbits4's.  Per K segment of SEG_K = 256 one chain from
// 0: per 32-wide k group (one quantisation block) the exact products (q - z) x summed by two
// m16n8k16 mmas (the first from 0), then acc = fmaf(T, scale, acc); the segment partials added in
// ascending segment order from 0 with __fadd_rn, then the bias, then fp16 (GLU: silu_mul_h of the
// gate and up sums, as finish() does).  The A operand holds the same exact fp16 integers q - z in
// the same slots and the B operand the same activations, so every mma and every rounding is the
// same instruction on the same values: the bits do not depend on which of the int4 kernels runs,
// nor on M (token columns of an mma are independent), so a batch's row 0 is its batch-1 run.
//
// What differs from mma_nbits4 is the schedule, for the one-tile launches of few rows that are
// bound by the weight stream:
// - q - z in fewer instructions: (W & 0x00f000f0) | 0x64006400 is 1024 + 16 q, and one fused
//   __hfma2 by 1/16 adding 960 - (1024 + z) gives q - z exactly (both steps exact), so the
//   nibbles at bits 4-7 need no shift; one shift by 8 serves the other two (9 instructions per
//   code word instead of 11).
// - a block takes TB feature tiles (tb, a launch argument) and its warps split the K segments:
//   warp w walks its units (tile, segment) segment-major (segments w, w + warps, ...; for each,
//   the block's tiles in order), so the 16 B fragments of the segment's activations stay in
//   registers across TB tiles instead of being loaded again for each chunk;
// - UP units (4 chunks of 16 bytes a lane each) of codes and scales are in flight per warp: a
//   chunk's registers are refilled with the same chunk of the unit UP ahead as soon as its mmas
//   have issued, so the weight stream of a warp runs across units, segments and tiles;
// - the unit's partials go to shared memory ([TB][nseg][16][8] floats) and the block folds them
//   once at the end (no split-K workspace, no tickets).
// grid (ceil(ceil(N / 16) / tb)), block 32 * warps (warps <= 16), shared tb * nseg * 512 bytes.
// Needs K % 16 == 0 and fp16 X, contiguous; M <= 8.

// 1024 + 16 q -> q - z: times 1/16 plus zs = 960 - (1024 + z) (exact, one rounding of an exact value).
__device__ __forceinline__ unsigned gemv4_hi(unsigned w, __half2 zs) {
    const unsigned b = (w & 0x00f000f0u) | 0x64006400u;
    const unsigned sixteenth = 0x2c002c00u;  // 1/16 in both halves
    const __half2 d = __hfma2(*reinterpret_cast<const __half2*>(&b), *reinterpret_cast<const __half2*>(&sixteenth), zs);
    return *reinterpret_cast<const unsigned*>(&d);
}

// The 2 k groups of one chunk (weights w as loaded, activations xq[v] of one token tile) into acc:
// mma4_chunk<1, S, ZP>'s arithmetic with gemv4_hi for the nibbles at bits 4-7 and 12-15.
template <typename S, bool ZP>
__device__ __forceinline__ void gemv4_chunk(float* acc, const Chunk4<S>& w, const uint2* xq) {
    const unsigned words[4] = {w.c.x, w.c.y, w.c.z, w.c.w};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float2 s = scale_f2(w.s[h]);
        const unsigned nozp = 0x64086408u;  // 1024 + 8 in both halves: no zero points
        __half2 zq = *reinterpret_cast<const __half2*>(&nozp);
        if constexpr (ZP) zq = w.zq[h];
        const unsigned k960 = 0x63806380u, k72 = 0xd480d480u;  // 960, and 960 - 1032 = -72, in both halves
        const __half2 zqa = __low2half2(zq);
        __half2 zsb = *reinterpret_cast<const __half2*>(&k72);
        if constexpr (ZP) zsb = __hsub2(*reinterpret_cast<const __half2*>(&k960), __high2half2(zq));
        float d[4];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const unsigned W = words[2 * h + u], W8 = W >> 8;
            unsigned a[4];  // as mma4_chunk: rows g (a[0], a[2]) and g + 8 (a[1], a[3])
            a[0] = codes_minus_z(W, zqa);
            a[1] = gemv4_hi(W, zsb);
            a[2] = codes_minus_z(W8, zqa);
            a[3] = gemv4_hi(W8, zsb);
            const uint2 b = xq[2 * h + u];
            if (u == 0) mma16816_zero(d, a, b.x, b.y);
            else mma16816(d, a, b.x, b.y);
        }
        acc[0] = fmaf(d[0], s.x, acc[0]);
        acc[1] = fmaf(d[1], s.x, acc[1]);
        acc[2] = fmaf(d[2], s.y, acc[2]);
        acc[3] = fmaf(d[3], s.y, acc[3]);
    }
}

// Codes, scales and zero points of chunk c (0..3) of unit (tile, seg) for this lane: load_chunk4's
// addresses from the unit's bases.
template <typename S, bool ZP>
__device__ __forceinline__ void gemv4_load(Chunk4<S>& w, const Packed4<S>& p, long long tile, int seg, int c) {
    w.c = p.qp[(tile * p.nchunks + seg * (SEG_K / 64) + c) * 32 + (threadIdx.x & 31)];
    load_scales4<S, ZP>(w, p, tile, seg * (SEG_K / 64) + c);
}

// The unit after (seg, tl) in a warp's order: the block's next tile, else tile 0 of its next segment.
__device__ __forceinline__ void gemv4_next(int& seg, int& tl, int tiles, int nwarps) {
    if (++tl == tiles) { tl = 0; seg += nwarps; }
}

template <typename S, bool GLU, bool ZP, int UP>
__global__ void __launch_bounds__(512) gemv4(const __half* __restrict__ x, const uint4* __restrict__ qp,
                                             const typename ScalePair<S>::type* __restrict__ sp,
                                             const __half2* __restrict__ zqp, int nbp, int lbs,
                                             const __half* __restrict__ bias, __half* __restrict__ y,
                                             int M, int N, int K, int n_out, int tb) {
    extern __shared__ float part[];  // [tiles][nseg][16][8]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int nseg = (K + SEG_K - 1) / SEG_K, nwarps = blockDim.x >> 5, nchunks = (K + 63) >> 6;
    const int tile0 = blockIdx.x * tb, tiles = min(tb, ((N + 15) >> 4) - tile0);
    const Packed4<S> pk{qp, sp, zqp, nchunks, nbp, lbs};
    Chunk4<S> w[UP][4];
    int lseg = warp, ltl = 0;  // the next unit to load
    // the first UP units before PDL_ENTER (weights: constants of the step, kernels/pdl.cuh)
#pragma unroll
    for (int i = 0; i < UP; ++i) {
        const int chunks = lseg < nseg ? seg_chunks(K, lseg) : 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) if (c < chunks) gemv4_load<S, ZP>(w[i][c], pk, tile0 + ltl, lseg, c);
        gemv4_next(lseg, ltl, tiles, nwarps);
    }
    PDL_ENTER();
    uint2 xq[4][4];  // the current segment's activations, chunk c, tile v (row g; zeros past M and K)
    int xseg = -1;
    for (int seg = warp, tl = 0; seg < nseg;) {
#pragma unroll
        for (int i = 0; i < UP; ++i) {
            if (seg >= nseg) break;
            if (seg != xseg) {
#pragma unroll
                for (int c = 0; c < 4; ++c) ld_x4q(x, g, K, seg * SEG_K + 64 * c, t, g < M, xq[c]);
                xseg = seg;
            }
            const int chunks = seg_chunks(K, seg), lchunks = lseg < nseg ? seg_chunks(K, lseg) : 0;
            float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
#pragma unroll
            for (int c = 0; c < 4; ++c) {  // ascending, as mma_nbits4
                if (c < chunks) gemv4_chunk<S, ZP>(acc[0], w[i][c], xq[c]);
                if (c < lchunks) gemv4_load<S, ZP>(w[i][c], pk, tile0 + ltl, lseg, c);
            }
            gemv4_next(lseg, ltl, tiles, nwarps);
            store_partial<1>(part + tl * nseg * 128, acc, seg);
            gemv4_next(seg, tl, tiles, nwarps);
        }
    }
    __syncthreads();
    // finish()'s fold for the block's outputs of rows m < M: (tile, feature r, row m)
    const int rows = GLU ? 8 : 16;
    for (int o = threadIdx.x; o < tiles * rows * M; o += blockDim.x) {
        const int m = o % M, r = (o / M) % rows, tl = o / (M * rows);
        const float* p = part + tl * nseg * 128 + r * 8 + m;
        const int n0 = (tile0 + tl) * 16;
        float s = 0.f, su = 0.f;
        for (int s_ = 0; s_ < nseg; ++s_) {
            s = __fadd_rn(s, p[s_ * 128]);
            if constexpr (GLU) su = __fadd_rn(su, p[s_ * 128 + 64]);
        }
        if constexpr (GLU) {
            const int n = n0 / 2 + r;
            if (n < n_out) y[(long long)m * n_out + n] = silu_mul_h(__float2half_rn(s), __float2half_rn(su));
        } else {
            const int n = n0 + r;
            if (n < N) {
                if (bias) s = __fadd_rn(s, __half2float(bias[n]));
                y[(long long)m * N + n] = __float2half_rn(s);
            }
        }
    }
}

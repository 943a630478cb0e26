// Expert residency on cuda (docs/moe.md, "Expert streaming on cuda"): the experts of a MoE node
// are pages of their own. Compiled after moe.cu (providers/cuda/module.py AFTER), whose
// moe_f / moe_store / moe_dot and (moe_act.cuh) moe_act / moe_swiglu it calls, so a pair's
// arithmetic is moe.cu's to the bit.
//   moe_plan:       one block: the step's routed experts -> resident storage or a ring slot
//                   (first in first out, never a slot the current wave uses), the copy list per
//                   wave, the step's pointer table, the counters.  ``waves`` is fixed by the
//                   launcher (ceil(min(T*k, cold experts) / slots)), never by the routing.
//   moe_page_in:    grid (blocks, slots): wave w's copies, slot s <- the expert's page in mapped
//                   pinned host memory (16-byte loads over the bus).
//   moe_up_paged:   moe_up for the pairs whose expert is in wave w, weights through the table.
//   moe_down_paged: moe_down likewise.
// Reduction order: that of moe.cu (each output one warp's dot product, lane l summing columns
// l, l + 32, ... with fmaf, then the xor tree 16..1); every routed (row, slot) pair is computed
// exactly once, in its expert's wave, and moe_mix sums the ranks as in the resident run, so the
// outputs are bitwise the resident run's, whatever the waves, the ring or the batch.
// A page is one expert's tensors at fixed byte offsets (``offsets``, 256-byte aligned, -1 for an
// absent tensor): fc1 (weights, scales, zero points, bias), fc2 (...), fc3 (...).
#define MOE_NT 12

__global__ void moe_plan(const int* __restrict__ experts, long long pairs, long long rows, int num_experts,
                         const int* __restrict__ resident_row, const unsigned char* resident, long long node_bytes,
                         const unsigned char* ring, long long slot_bytes, int slots,
                         const long long* __restrict__ offsets, int key_base, int waves,
                         int* __restrict__ holds, int* __restrict__ next, int* __restrict__ pinned,
                         unsigned long long* __restrict__ ptr, int* __restrict__ wave_of, int* __restrict__ copies,
                         long long* __restrict__ counters, unsigned long long* __restrict__ routes) {
    PDL_ENTER();
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) wave_of[e] = -1;
    for (int i = threadIdx.x; i < waves * slots; i += blockDim.x) copies[i] = -1;
    for (int s = threadIdx.x; s < slots; s += blockDim.x) pinned[s] = -1;
    __syncthreads();
    for (long long p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int e = experts[p];
        wave_of[e] = -2;  // routed, not placed yet (every writer stores the same value)
        atomicAdd(routes + e, 1ull);
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    long long routed = 0, hits = 0, page_ins = 0;
    int wave = 0, used = 0, cursor = *next;
    for (int e = 0; e < num_experts; ++e) {  // ascending expert index, as cpu_reference's pager
        if (wave_of[e] != -2) continue;
        ++routed;
        const unsigned char* base;
        if (resident_row[e] >= 0) {
            ++hits;
            wave_of[e] = 0;
            base = resident + resident_row[e] * node_bytes;
        } else {
            const int key = key_base + e;
            int s = -1;
            for (int i = 0; i < slots; ++i)
                if (holds[i] == key) s = i;
            if (s >= 0) {  // still in the ring from an earlier call
                ++hits;
            } else {
                if (used == slots) {  // the ring is full of this wave: the next wave reuses it
                    ++wave;
                    used = 0;
                    if (wave >= waves) __trap();  // cannot happen: waves bounds the cold experts routed
                }
                for (int i = 0; i < slots; ++i) {
                    const int c = cursor;
                    cursor = cursor + 1 == slots ? 0 : cursor + 1;
                    if (pinned[c] != wave) {
                        s = c;
                        break;
                    }
                }
                holds[s] = key;
                copies[wave * slots + s] = e;
                ++page_ins;
            }
            pinned[s] = wave;
            ++used;
            wave_of[e] = wave;
            base = ring + s * slot_bytes;
        }
        for (int t = 0; t < MOE_NT; ++t)
            ptr[e * MOE_NT + t] = offsets[t] < 0 ? 0ull : (unsigned long long)(base + offsets[t]);
    }
    *next = cursor;
    counters[0] += routed;
    counters[1] += hits;
    counters[2] += page_ins;
    counters[3] += rows;
}

// Grid (blocks, slots), node_bytes and slot_bytes multiples of 16: slot s <- bank[e] for the
// expert e that wave ``wave`` pages into it (none: the block exits).
__global__ void moe_page_in(const int* __restrict__ copies, int wave, int slots, const uint4* __restrict__ bank,
                            long long node_bytes, uint4* __restrict__ ring, long long slot_bytes) {
    PDL_ENTER();
    const int e = copies[wave * slots + blockIdx.y];
    if (e < 0) return;
    const long long n = node_bytes / 16;
    const uint4* src = bank + e * n;
    uint4* dst = ring + blockIdx.y * (slot_bytes / 16);
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {  // four loads in flight a thread
        const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) dst[i] = src[i];
}

// moe_up (moe.cu) for the pairs whose expert is in wave ``wave``; expert e's fc1 and SwiGLU's
// linear projection (table entries lin_base..lin_base+3: fc1 itself, or fc3) through ptr [E, 12].
template <typename T, int BITS>
__global__ void moe_up_paged(const T* __restrict__ x, const int* __restrict__ experts,
                             const int* __restrict__ wave_of, int wave, const unsigned long long* __restrict__ ptr,
                             long long k_routed, long long hidden, long long inter, long long n1, int lin_base,
                             long long nl, int g_step, int g_off, int l_step, int l_off, int block, int act,
                             float alpha, float beta, float limit, int has_limit, float* __restrict__ a) {
    PDL_ENTER();
    const long long slot = blockIdx.x;
    const long long i = (long long)blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= inter) return;
    const int e = experts[slot];
    if (wave_of[e] != wave) return;
    const unsigned long long* p = ptr + (long long)e * MOE_NT;
    const T* b1 = reinterpret_cast<const T*>(p[3]);
    const T* row = x + (slot / k_routed) * hidden;
    const long long gi = i * g_step + g_off;
    float g = moe_dot<T, T, BITS>(row, reinterpret_cast<const void*>(p[0]), reinterpret_cast<const T*>(p[1]),
                                  reinterpret_cast<const unsigned char*>(p[2]), 0, n1, hidden, block, gi);
    if (b1 != nullptr) g = __fadd_rn(g, moe_f(b1[gi]));
    float r;
    if (act != 4) {
        r = moe_act(act, g);
    } else {
        const unsigned long long* q = p + lin_base;
        const T* bl = reinterpret_cast<const T*>(q[3]);
        const long long li = i * l_step + l_off;
        float lin = moe_dot<T, T, BITS>(row, reinterpret_cast<const void*>(q[0]), reinterpret_cast<const T*>(q[1]),
                                        reinterpret_cast<const unsigned char*>(q[2]), 0, nl, hidden, block, li);
        if (bl != nullptr) lin = __fadd_rn(lin, moe_f(bl[li]));
        r = moe_swiglu(g, lin, alpha, beta, limit, has_limit);
    }
    if ((threadIdx.x & 31) == 0) a[slot * inter + i] = r;
}

// moe_down (moe.cu) for the pairs whose expert is in wave ``wave``; fc2 is table entries 4..7.
template <typename T, int BITS>
__global__ void moe_down_paged(const float* __restrict__ a, const int* __restrict__ experts,
                               const int* __restrict__ wave_of, int wave, const unsigned long long* __restrict__ ptr,
                               long long hidden, long long inter, int block, float* __restrict__ y) {
    PDL_ENTER();
    const long long slot = blockIdx.x;
    const long long n = (long long)blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= hidden) return;
    const int e = experts[slot];
    if (wave_of[e] != wave) return;
    const unsigned long long* p = ptr + (long long)e * MOE_NT + 4;
    const T* b2 = reinterpret_cast<const T*>(p[3]);
    float v = moe_dot<T, float, BITS>(a + slot * inter, reinterpret_cast<const void*>(p[0]),
                                      reinterpret_cast<const T*>(p[1]), reinterpret_cast<const unsigned char*>(p[2]),
                                      0, hidden, inter, block, n);
    if (b2 != nullptr) v = __fadd_rn(v, moe_f(b2[n]));
    if ((threadIdx.x & 31) == 0) y[slot * hidden + n] = v;
}

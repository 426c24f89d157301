// Sampling kernels; numpy twins in sampling_ref.py and sampling_prims.py.
// A section of graphburst/kernels.cu (one translation unit); include it through that file.
#pragma once

#include "common.cuh"

// =====================================================================================
// Sampling: speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023)
// =====================================================================================
//
// Contract with the numpy twins (sampling_prims.py, sampling_ref.py), which reproduce every
// output bit:
//   * Rows are cut into tiles of GB_SAMPLE_TILE elements, one block of GB_SAMPLE_THREADS per
//     (row, tile): several blocks per row, whatever the batch. Thread t of a tile owns the
//     float4s j = 0 .. GB_SAMPLE_NVEC-1 at tile offset (j * GB_SAMPLE_THREADS + t) * 4, so a
//     warp reads 512 consecutive bytes per access. The tile size, not the grid, fixes every
//     float reduction order: a thread adds its elements in order (j outer, lane inner), a
//     warp reduces by xor butterfly, the warp totals by the same halving tree; tile values
//     are combined by one warp (lane l adds tiles l, l + 32, ... then the butterfly).
//     Integer and (value, index) reductions are order-free. Float ops are explicit _rn
//     intrinsics (no FMA contraction); there are no float atomics.
//   * Probabilities in two passes: spec_probs_tiles writes e_i = exp((l_i - m_t) / T)
//     relative to its tile's maximum m_t plus the tile's sum; spec_probs_normalize combines
//     the tiles, s_t = exp((m_t - max) / T), total = sum_t sum_t * s_t, and writes
//     p_i = e_i * s_t / total. exp is gb_exp_neg (float * + rint only), computed once per
//     element. Top-k/top-p run in spec_probs_select (a radix select over integer counts and
//     masses, many blocks per row, then the row's last block), which returns at once for
//     the rows without filters, the common case.
//   * Sampling is an exponential race: token = argmax_i w_i / E_i over w_i > 0, ties to the
//     lower index, E_i = -log(1 - v_i) exponential from Philox4x32-10 keyed by the request
//     seed (key = [lo32, hi32]), counter [position, draw, i / 4, 0], word i % 4. The winner
//     is distributed as w / sum(w) with no normalisation and no scan, and an argmax of
//     (value, index) keys is the same under any parallel split. The draft's race runs on
//     e_i inside spec_probs_tiles; its tile winners are rescaled by s_t when combined.
//   * The accept uniforms stay gb_uniform: counter [position, GB_DRAW_ACCEPT, 0, 0], word 0.
//   * Flush to zero: cuda_ops builds this module through cupy.RawModule, and CuPy appends
//     -ftz=true to every NVRTC compile. So every float op here, the _rn intrinsics and the
//     comparisons (setp.ftz) included, reads a subnormal input as a signed zero and flushes
//     a subnormal result. sampling_prims.ftz models exactly that. The nvcc build in CI has
//     no -ftz=true: it checks syntax only, its numerics are not the contract.
//   * Order for top-k/top-p/argmax: the 64-bit key (orderable logit bits << 32 | ~index),
//     i.e. larger logit first and the lower index first among equal logits; every key is
//     distinct, so top-k keeps exactly k tokens. Top-p uses integer masses
//     floor(e * 2^32) (e = exp((l - max) / T) <= 1), so its cut is exact and order-free.
//   * Scratch (sel_thr, tile_key, tile_sum, race_key, race_w, sel_part, sel_tick, sel_hist)
//     is the decoder's, at fixed addresses, indexed [b, row < S, ...] with S its rows per
//     sequence; every cell a kernel reads was written earlier in the same call, so stale
//     contents never matter, except the select's sel_tick and sel_hist, zero between calls.

#define GB_SAMPLE_THREADS 256
#define GB_SAMPLE_WARPS (GB_SAMPLE_THREADS / 32)
#define GB_SAMPLE_TILE 2048
#define GB_SAMPLE_VEC 4
#define GB_SAMPLE_NVEC (GB_SAMPLE_TILE / (GB_SAMPLE_VEC * GB_SAMPLE_THREADS))
static_assert(GB_SAMPLE_NVEC * GB_SAMPLE_VEC * GB_SAMPLE_THREADS == GB_SAMPLE_TILE, "whole float4s per thread");
#define GB_DRAW_DRAFT 0u
#define GB_DRAW_ACCEPT 1u
#define GB_DRAW_RESAMPLE 2u
#define GB_RACES_PER_ROW 2  // race partials per scratch row: [0] draft / residual, [1] bonus p

struct GbTileSmem {
    u64 warp_u[GB_SAMPLE_WARPS];
    u64 warp_r[GB_SAMPLE_WARPS];
    float warp_f[GB_SAMPLE_WARPS];
    float warp_w[GB_SAMPLE_WARPS];
    float f0, f1;
    u64 u0;
    int i0;
};

// Philox4x32-10 (Salmon et al., SC'11), in place on the 4-word counter.
__device__ __forceinline__ void gb_philox4x32_10(u32 c[4], u32 k0, u32 k1) {
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        u32 hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        u32 hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        u32 n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
    }
}

// Uniform in [0, 1) with 24 random bits for (seed, position, draw index).
__device__ __forceinline__ float gb_uniform(u64 seed, int pos, u32 draw) {
    u32 c[4] = {(u32)pos, draw, 0u, 0u};
    gb_philox4x32_10(c, (u32)seed, (u32)(seed >> 32));
    return __fmul_rn((float)(c[0] >> 8), 0x1p-24f);
}

// e^x for x <= 0 from 2^y, y = x*log2(e) = n + f, |f| <= 1/2: degree-7 Taylor in f
// (relative error ~1e-7), scaled by 2^n. Results below 2^-125 (and NaN) flush to 0.
__device__ __forceinline__ float gb_exp_neg(float x) {
    float y = __fmul_rn(x, 0x1.715476p+0f);
    if (!(y >= -125.0f)) return 0.0f;
    y = fminf(y, 0.0f);
    float n = rintf(y);
    float f = __fsub_rn(y, n);
    float r = 0x1.ffcbfcp-17f;
    r = __fadd_rn(__fmul_rn(r, f), 0x1.430912p-13f);
    r = __fadd_rn(__fmul_rn(r, f), 0x1.5d87fep-10f);
    r = __fadd_rn(__fmul_rn(r, f), 0x1.3b2ab6p-7f);
    r = __fadd_rn(__fmul_rn(r, f), 0x1.c6b08ep-5f);
    r = __fadd_rn(__fmul_rn(r, f), 0x1.ebfbe0p-3f);
    r = __fadd_rn(__fmul_rn(r, f), 0x1.62e430p-1f);
    r = __fadd_rn(__fmul_rn(r, f), 1.0f);
    return __fmul_rn(r, __int_as_float(((int)n + 127) << 23));
}

// -log(1 - v) for 0 < v < 1 (relative error ~1e-7). v < 1/4: log1p(f) with f = -v exactly,
// so E keeps full relative precision as v -> 0. Otherwise u = 1 - v = m * 2^e with m in
// [3/4, 3/2] and f = m - 1 (exact). log1p(f) = 2 atanh(s), s = f / (2 + f), |s| <= 1/5,
// by its series to z^5, z = s^2. For v >= 2^-32 every intermediate is a normal float.
__device__ __forceinline__ float gb_neg_log1m(float v) {
    float f, e;
    if (v < 0.25f) {
        f = -v;
        e = 0.0f;
    } else {
        float u = __fsub_rn(1.0f, v);
        u32 bits = __float_as_uint(u);
        int ex = (int)((bits >> 23) & 0xffu) - 127;
        float m = __uint_as_float((bits & 0x7fffffu) | 0x3f800000u);
        if (m > 1.5f) {
            m = __fmul_rn(m, 0.5f);
            ex += 1;
        }
        f = __fsub_rn(m, 1.0f);
        e = (float)ex;
    }
    float s = __fdiv_rn(f, __fadd_rn(2.0f, f));
    float z = __fmul_rn(s, s);
    float r = 0x1.745d18p-4f;                          // 1/11
    r = __fadd_rn(__fmul_rn(r, z), 0x1.c71c72p-4f);    // 1/9
    r = __fadd_rn(__fmul_rn(r, z), 0x1.24924ap-3f);    // 1/7
    r = __fadd_rn(__fmul_rn(r, z), 0x1.99999ap-3f);    // 1/5
    r = __fadd_rn(__fmul_rn(r, z), 0x1.555556p-2f);    // 1/3
    r = __fadd_rn(__fmul_rn(r, z), 1.0f);
    float lg = __fmul_rn(__fmul_rn(2.0f, s), r);
    return -__fadd_rn(__fmul_rn(e, 0x1.62e430p-1f), lg);
}

// Standard exponential from one Philox word: v = (word | 1) * 2^-32, capped below 1.
__device__ __forceinline__ float gb_expo(u32 word) {
    float v = __fmul_rn(__uint2float_rn(word | 1u), 0x1p-32f);
    return gb_neg_log1m(fminf(v, 0x1.fffffep-1f));
}

// The four race variates of elements 4g .. 4g+3 of a row (g = i / 4).
__device__ __forceinline__ void gb_race_expo4(u64 seed, int pos, u32 draw, int g, float out[4]) {
    u32 c[4] = {(u32)pos, draw, (u32)g, 0u};
    gb_philox4x32_10(c, (u32)seed, (u32)(seed >> 32));
    for (int w = 0; w < 4; ++w) out[w] = gb_expo(c[w]);
}

// Order key of a logit: larger logit -> larger key, then lower index -> larger key.
__device__ __forceinline__ u64 gb_order_key(float x, int i) {
    u32 b = x == 0.0f ? 0u : __float_as_uint(x);  // -0 ranks as +0
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)b << 32) | (u64)(~(u32)i);
}

// The logit of an order key (a flushed or negative zero comes back as +0).
__device__ __forceinline__ float gb_key_logit(u64 key) {
    u32 hb = (u32)(key >> 32);
    return __uint_as_float((hb & 0x80000000u) ? (hb & 0x7fffffffu) : ~hb);
}

// Race key of a candidate: r >= 0 bits (orderable as unsigned) << 32 | ~index; 0 = none.
__device__ __forceinline__ u64 gb_race_key(float r, int i) {
    return ((u64)__float_as_uint(r) << 32) | (u64)(~(u32)i);
}

__device__ __forceinline__ u64 gb_max_u64(u64 a, u64 b) { return a > b ? a : b; }

__device__ __forceinline__ u64 gb_warp_max_u64(u64 v) {
    for (int o = 16; o > 0; o >>= 1) v = gb_max_u64(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Warp max of a key carrying a float payload (keys distinct unless both 0).
__device__ __forceinline__ void gb_warp_max_pay(u64& key, float& pay) {
    for (int o = 16; o > 0; o >>= 1) {
        u64 k2 = __shfl_xor_sync(0xffffffffu, key, o);
        float p2 = __shfl_xor_sync(0xffffffffu, pay, o);
        if (k2 > key) {
            key = k2;
            pay = p2;
        }
    }
}

__device__ __forceinline__ float gb_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block max of a u64 (order-free); every thread gets the result.
__device__ __forceinline__ u64 gb_tile_max_u64(u64 v, u64* warp_u) {
    v = gb_warp_max_u64(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) warp_u[threadIdx.x >> 5] = v;
    __syncthreads();
    u64 r = warp_u[0];
    for (int w = 1; w < GB_SAMPLE_WARPS; ++w) r = gb_max_u64(r, warp_u[w]);
    return r;
}

// Block max of a race key with its weight, and the block sum of per-thread float sums in
// the fixed tree (warp butterfly, then the warp totals halved the same way). Thread 0 gets
// the results in key, pay, sum.
__device__ __forceinline__ void gb_tile_reduce(u64& key, float& pay, float& sum, GbTileSmem& sm) {
    gb_warp_max_pay(key, pay);
    sum = gb_warp_sum(sum);
    __syncthreads();
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) {
        sm.warp_r[w] = key;
        sm.warp_w[w] = pay;
        sm.warp_f[w] = sum;
    }
    __syncthreads();
    if (w == 0) {
        u64 k = lane < GB_SAMPLE_WARPS ? sm.warp_r[lane] : 0ull;
        float p = lane < GB_SAMPLE_WARPS ? sm.warp_w[lane] : 0.0f;
        float s = lane < GB_SAMPLE_WARPS ? sm.warp_f[lane] : 0.0f;
        gb_warp_max_pay(k, p);
        for (int o = GB_SAMPLE_WARPS / 2; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
        key = k;
        pay = p;
        sum = s;
    }
}

// A thread's float4 j of a tile: element base = tile start + (j * THREADS + tid) * 4.
__device__ __forceinline__ int gb_vec_base(int tile, int j) {
    return tile * GB_SAMPLE_TILE + (j * GB_SAMPLE_THREADS + (int)threadIdx.x) * GB_SAMPLE_VEC;
}

__device__ __forceinline__ void gb_load4(const float* row, int i0, int vocab, bool aligned, float x[4], float pad) {
    if (aligned && i0 + 3 < vocab) {
        float4 v = *reinterpret_cast<const float4*>(row + i0);
        x[0] = v.x;
        x[1] = v.y;
        x[2] = v.z;
        x[3] = v.w;
    } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) x[c] = i0 + c < vocab ? row[i0 + c] : pad;
    }
}

__device__ __forceinline__ void gb_store4(float* row, int i0, int vocab, bool aligned, const float x[4]) {
    if (aligned && i0 + 3 < vocab) {
        *reinterpret_cast<float4*>(row + i0) = make_float4(x[0], x[1], x[2], x[3]);
    } else {
#pragma unroll
        for (int c = 0; c < 4; ++c)
            if (i0 + c < vocab) row[i0 + c] = x[c];
    }
}

__device__ __forceinline__ bool gb_aligned16(const float* p) { return (reinterpret_cast<u64>(p) & 15ull) == 0ull; }

__device__ __forceinline__ int gb_n_tiles(int vocab) { return (vocab + GB_SAMPLE_TILE - 1) / GB_SAMPLE_TILE; }

// e_i = exp((l_i - ref) / T) of a logit row.
__device__ __forceinline__ float gb_scaled_exp(float l, float ref, float temp) {
    return gb_exp_neg(__fdiv_rn(__fsub_rn(l, ref), temp));
}

// ------------------------------------------------------------------ top-k / top-p select
//
// sel_thr[b, r] = the smallest order key kept, as the numpy twin's select_thr: the k-th
// largest key (top-k), then, among the keys >= it, the key at which the integer mass
// floor(e_i * 2^32) summed in key order first reaches max(1, ceil(top_p * total)) (the
// row's largest key when the total is 0). Every quantity is an integer count or mass, so
// any split of the work gives the same bits.
//
// One launch, radix select on the compressed key ck = (logit key bits << nb) |
// (~i & (2^nb - 1)), nb = bits of V - 1 (the order of the 64-bit key, constant index bits
// dropped), GB_SEL_DIGIT bits per pass from the top:
//   1. Blocks of GB_SEL_THREADS per (chunk, row): the chunk's max key into sel_part and,
//      with top-k, the counts of the first digit, added into the row's global histogram
//      sel_hist with integer atomics. A ticket (sel_tick) finds the row's last block.
//   2. That block alone finishes the row: the row max, then passes over the row (group =
//      keys sharing the chosen prefix; counts for top-k, masses for top-p, warp-aggregated
//      into a shared histogram) until the group holds at most GB_SEL_CAP keys; then it
//      gathers the group (for top-k with top-p, every key >= the group when that fits: then
//      top-p is read off the same list), sorts it in shared memory and reads the threshold
//      off prefix sums. Top-k then top-p without that shortcut run one after the other.
// sel_tick and sel_hist are zero between calls: the last block re-zeroes its row's cells
// (they are allocated zeroed). Rows without filters write 0 and return at once.

#define GB_SEL_THREADS 512
#define GB_SEL_WARPS (GB_SEL_THREADS / 32)
#define GB_SEL_V4 4  // float4s per thread per sweep: 32 KB in flight per block
#define GB_SEL_SPAN (GB_SEL_V4 * GB_SAMPLE_VEC * GB_SEL_THREADS)
#define GB_SEL_DIGIT 11
#define GB_SEL_BINS (1 << GB_SEL_DIGIT)
#define GB_SEL_CAP 2048  // the most keys gathered and sorted in one block
#define GB_SEL_PER_THREAD (GB_SEL_BINS / GB_SEL_THREADS)
#define GB_SEL_MAX_STEPS 16  // in-block passes and gathers: 2 * (52 / 11 + 1) + 2 at most
#define GB_SEL_NONE 0xffffffffu  // digit of a key outside the group
#define GB_SEL_DONE 0u
#define GB_SEL_HIST 1u
#define GB_SEL_GATHER_EQ 2u  // gather the group
#define GB_SEL_GATHER_GE 3u  // gather the group and every key above it
static_assert(GB_SEL_CAP == GB_SEL_BINS, "a thread owns GB_SEL_PER_THREAD bins and list entries");
static_assert(GB_SEL_PER_THREAD * GB_SEL_THREADS == GB_SEL_BINS, "whole bins per thread");

// The select of one row, uniform over the block (written by one thread between barriers).
struct GbSelState {
    u64 prefix;     // ck bits fixed so far (above H)
    u64 rem;        // units still needed inside the group
    u64 floor_key;  // candidates: order key >= floor_key (top-p after top-k)
    u64 above;      // keys above the group (top-k)
    u64 result;     // sel_thr once op == GB_SEL_DONE
    u32 op, phase;  // phase 0: top-k (counts), 1: top-p (masses)
    int H;          // low ck bits not fixed yet
};

struct GbSelectSmem {
    union {
        struct {
            u32 c[GB_SEL_BINS];  // keys per digit
            u64 w[GB_SEL_BINS];  // mass per digit (top-p)
        } hist;
        struct {
            u64 key[GB_SEL_CAP];  // gathered order keys, sorted in place (descending)
            u64 w[GB_SEL_CAP];    // their masses
        } list;
    } u;
    u64 warp_u[GB_SEL_WARPS];
    u64 warp_v[GB_SEL_WARPS];
    GbSelState st;
    u32 n;  // gathered keys
    int last, found;
};

// Bits to index a row of `vocab` (0 for one token).
__device__ __forceinline__ int gb_sel_nb(int vocab) { return vocab > 1 ? 32 - __clz((unsigned)(vocab - 1)) : 0; }

__device__ __forceinline__ u64 gb_sel_ck(u64 key, int i, int nb) {
    return ((key >> 32) << nb) | ((u64)(~(u32)i) & ((1ull << nb) - 1ull));
}

__device__ __forceinline__ u64 gb_sel_mass(float l, float l_max, float temp) {
    return (u64)__float2ull_rz(__fmul_rn(gb_scaled_exp(l, l_max, temp), 0x1p32f));
}

// Element c of float4 v of a sweep starting at base.
__device__ __forceinline__ int gb_sel_index(int base, int v, int c) {
    return base + (v * GB_SEL_THREADS + (int)threadIdx.x) * GB_SAMPLE_VEC + c;
}

// A thread's GB_SEL_V4 float4s of the sweep at base (a multiple of 4) over [.., end).
__device__ __forceinline__ void gb_sel_load(const float* row, int base, int end, bool aligned,
                                            float x[GB_SEL_V4][GB_SAMPLE_VEC]) {
#pragma unroll
    for (int v = 0; v < GB_SEL_V4; ++v) gb_load4(row, gb_sel_index(base, v, 0), end, aligned, x[v], 0.0f);
}

// Block max of a u64 (order-free); every thread gets it.
__device__ __forceinline__ u64 gb_sel_max(u64 v, GbSelectSmem& sm) {
    v = gb_warp_max_u64(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sm.warp_u[threadIdx.x >> 5] = v;
    __syncthreads();
    u64 r = sm.warp_u[0];
    for (int w = 1; w < GB_SEL_WARPS; ++w) r = gb_max_u64(r, sm.warp_u[w]);
    __syncthreads();
    return r;
}

// Block scans of two u64s: every thread gets the totals and the sums over the threads
// after it (suffix) or before it (prefix). Starts and ends with a barrier.
__device__ __forceinline__ void gb_sel_scan2(u64 a, u64 b, bool suffix, u64& excl_a, u64& excl_b, u64& tot_a,
                                             u64& tot_b, GbSelectSmem& sm) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    u64 sa = a, sb = b;
    for (int o = 1; o < 32; o <<= 1) {
        u64 xa = suffix ? __shfl_down_sync(0xffffffffu, sa, o) : __shfl_up_sync(0xffffffffu, sa, o);
        u64 xb = suffix ? __shfl_down_sync(0xffffffffu, sb, o) : __shfl_up_sync(0xffffffffu, sb, o);
        if (suffix ? lane + o < 32 : lane >= o) {
            sa += xa;
            sb += xb;
        }
    }
    __syncthreads();
    if (lane == (suffix ? 0 : 31)) {
        sm.warp_u[w] = sa;
        sm.warp_v[w] = sb;
    }
    __syncthreads();
    excl_a = sa - a;
    excl_b = sb - b;
    tot_a = 0;
    tot_b = 0;
    for (int j = 0; j < GB_SEL_WARPS; ++j) {
        u64 ua = sm.warp_u[j], ub = sm.warp_v[j];
        tot_a += ua;
        tot_b += ub;
        if (suffix ? j > w : j < w) {
            excl_a += ua;
            excl_b += ub;
        }
    }
    __syncthreads();
}

// Adds one key's digit d (GB_SEL_NONE: not in the group) and mass m to the shared
// histogram, one atomic per digit per warp: a few digits hold most of a row. Called by
// all 32 lanes. Masses are summed as two 16-bit halves (m <= 2^32: no u32 overflow).
__device__ __forceinline__ void gb_sel_count(u32 d, u64 m, bool by_mass, GbSelectSmem& sm) {
    u32 peers = __match_any_sync(0xffffffffu, d);
    u64 msum = 0;
    if (by_mass) {
        u32 hi = __reduce_add_sync(peers, (u32)(m >> 16)), lo = __reduce_add_sync(peers, (u32)(m & 0xffffull));
        msum = ((u64)hi << 16) + (u64)lo;
    }
    if (d != GB_SEL_NONE && (int)(__ffs(peers) - 1) == (int)(threadIdx.x & 31)) {
        atomicAdd(&sm.u.hist.c[d], (u32)__popc(peers));
        if (msum) atomicAdd(&sm.u.hist.w[d], (unsigned long long)msum);
    }
}

__device__ __forceinline__ void gb_sel_zero_hist(GbSelectSmem& sm) {
    for (int d = threadIdx.x; d < GB_SEL_BINS; d += GB_SEL_THREADS) {
        sm.u.hist.c[d] = 0u;
        sm.u.hist.w[d] = 0ull;
    }
}

// One pass over the whole row by this block: the group's histogram of the next digit.
__device__ void gb_sel_hist_row(const float* row, int vocab, bool aligned, int nb, const GbSelState& s, float l_max,
                                float temp, GbSelectSmem& sm) {
    gb_sel_zero_hist(sm);
    __syncthreads();
    int width = s.H < GB_SEL_DIGIT ? s.H : GB_SEL_DIGIT, sh = s.H - width;
    u32 dmask = (1u << width) - 1u;
    u64 want = s.prefix >> s.H;
    bool by_mass = s.phase != 0u;
    for (int base = 0; base < vocab; base += GB_SEL_SPAN) {  // trip count uniform over the block
        float x[GB_SEL_V4][GB_SAMPLE_VEC];
        gb_sel_load(row, base, vocab, aligned, x);
#pragma unroll
        for (int v = 0; v < GB_SEL_V4; ++v) {
#pragma unroll
            for (int c = 0; c < GB_SAMPLE_VEC; ++c) {
                int i = gb_sel_index(base, v, c);
                u32 d = GB_SEL_NONE;
                u64 m = 0;
                if (i < vocab) {
                    u64 key = gb_order_key(x[v][c], i);
                    u64 ck = gb_sel_ck(key, i, nb);
                    if (key >= s.floor_key && (ck >> s.H) == want) {
                        d = (u32)(ck >> sh) & dmask;
                        if (by_mass) m = gb_sel_mass(x[v][c], l_max, temp);
                    }
                }
                gb_sel_count(d, m, by_mass, sm);
            }
        }
    }
    __syncthreads();
}

// After a histogram pass: the digit holding the rem-th unit (counts for top-k, masses for
// top-p) becomes part of the prefix; the first top-p pass (H == L) first sets rem =
// max(1, ceil(top_p * total)). Writes sm.st (one thread).
__device__ void gb_sel_pick(const GbSelState& s, int L, bool p_on, float tp, u64 max_key, GbSelectSmem& sm) {
    int t = threadIdx.x;
    int width = s.H < GB_SEL_DIGIT ? s.H : GB_SEL_DIGIT, sh = s.H - width;
    bool by_mass = s.phase != 0u;
    u32 c[GB_SEL_PER_THREAD];
    u64 wt[GB_SEL_PER_THREAD];
    u64 lc = 0, lw = 0;
#pragma unroll
    for (int e = 0; e < GB_SEL_PER_THREAD; ++e) {
        int d = t * GB_SEL_PER_THREAD + e;
        c[e] = sm.u.hist.c[d];
        wt[e] = by_mass ? sm.u.hist.w[d] : (u64)c[e];
        lc += c[e];
        lw += wt[e];
    }
    u64 above_c, above_w, tot_c, tot_w;
    gb_sel_scan2(lc, lw, true, above_c, above_w, tot_c, tot_w, sm);
    u64 rem = s.rem;
    if (by_mass && s.H == L) {  // the first top-p pass: need from the candidates' total mass
        double want = ceil(__dmul_rn((double)tp, (double)tot_w));
        rem = want < 1.0 ? 1ull : (u64)want;
        if (tot_w < rem) {  // no mass at all: the twin keeps the row's largest key
            if (t == 0) {
                sm.st.result = gb_max_u64(max_key, s.floor_key);
                sm.st.op = GB_SEL_DONE;
            }
            __syncthreads();
            return;
        }
    }
#pragma unroll
    for (int e = GB_SEL_PER_THREAD - 1; e >= 0; --e) {
        int d = t * GB_SEL_PER_THREAD + e;
        if (above_w < rem && above_w + wt[e] >= rem) {  // exactly one (thread, e) in the block
            u64 above = s.above + above_c;
            u32 op = c[e] > (u32)GB_SEL_CAP ? GB_SEL_HIST
                     : (!by_mass && p_on && above + c[e] <= (u64)GB_SEL_CAP) ? GB_SEL_GATHER_GE
                                                                             : GB_SEL_GATHER_EQ;
            sm.st.op = op;
            sm.st.prefix = s.prefix | ((u64)d << sh);
            sm.st.H = sh;
            sm.st.rem = rem - above_w;
            sm.st.above = above;
        }
        above_w += wt[e];
        above_c += c[e];
    }
    __syncthreads();
}

// One pass over the whole row by this block: the group (GATHER_EQ) or the group and every
// key above it (GATHER_GE) into the shared list, with masses when top-p needs them.
__device__ void gb_sel_gather_row(const float* row, int vocab, bool aligned, int nb, const GbSelState& s, float l_max,
                                  float temp, GbSelectSmem& sm) {
    if (threadIdx.x == 0) sm.n = 0u;
    __syncthreads();
    bool ge = s.op == GB_SEL_GATHER_GE, mass = s.phase != 0u || ge;
    u64 want = s.prefix >> s.H;
    int lane = threadIdx.x & 31;
    for (int base = 0; base < vocab; base += GB_SEL_SPAN) {
        float x[GB_SEL_V4][GB_SAMPLE_VEC];
        gb_sel_load(row, base, vocab, aligned, x);
#pragma unroll
        for (int v = 0; v < GB_SEL_V4; ++v) {
#pragma unroll
            for (int c = 0; c < GB_SAMPLE_VEC; ++c) {
                int i = gb_sel_index(base, v, c);
                u64 key = 0;
                bool in = false;
                if (i < vocab) {
                    key = gb_order_key(x[v][c], i);
                    u64 hi = gb_sel_ck(key, i, nb) >> s.H;
                    in = key >= s.floor_key && (ge ? hi >= want : hi == want);
                }
                u32 bal = __ballot_sync(0xffffffffu, in);
                if (bal) {  // warp-uniform
                    u32 first = 0;
                    if (lane == 0) first = atomicAdd(&sm.n, (u32)__popc(bal));
                    first = __shfl_sync(0xffffffffu, first, 0);
                    u32 at = first + (u32)__popc(bal & ((1u << lane) - 1u));
                    if (in && at < (u32)GB_SEL_CAP) {  // always: the pick gathers only what fits
                        sm.u.list.key[at] = key;
                        sm.u.list.w[at] = mass ? gb_sel_mass(x[v][c], l_max, temp) : 0ull;
                    }
                }
            }
        }
    }
    __syncthreads();
}

// The list entry holding the need-th unit (1 per key, or its mass) in sorted order, or 0
// when the list holds less (the twin's argmax of an all-false crossing). Every thread gets it.
__device__ int gb_sel_cross(int n, bool by_mass, u64 need, GbSelectSmem& sm) {
    int t = threadIdx.x;
    u64 lw = 0;
#pragma unroll
    for (int e = 0; e < GB_SEL_PER_THREAD; ++e) {
        int j = t * GB_SEL_PER_THREAD + e;
        if (j < n) lw += by_mass ? sm.u.list.w[j] : 1ull;
    }
    if (t == 0) sm.found = 0;
    u64 before, unused_b, tot, unused_t;
    gb_sel_scan2(lw, 0ull, false, before, unused_b, tot, unused_t, sm);
#pragma unroll
    for (int e = 0; e < GB_SEL_PER_THREAD; ++e) {
        int j = t * GB_SEL_PER_THREAD + e;
        if (j < n) {
            u64 w = by_mass ? sm.u.list.w[j] : 1ull;
            if (before < need && before + w >= need) sm.found = j;
            before += w;
        }
    }
    __syncthreads();
    int j = sm.found;
    __syncthreads();
    return j;
}

// After a gather: sorts the list (descending keys, bitonic) and reads the threshold off
// it; top-k hands over to top-p, or the row is done. Writes sm.st (thread 0).
__device__ void gb_sel_finish(const GbSelState& s, int L, bool p_on, float tp, GbSelectSmem& sm) {
    int t = threadIdx.x;
    int n = (int)sm.n;
    n = n < GB_SEL_CAP ? n : GB_SEL_CAP;
    int n2 = 1;
    while (n2 < n) n2 <<= 1;
    for (int j = n + t; j < n2; j += GB_SEL_THREADS) {
        sm.u.list.key[j] = 0ull;  // below every real key
        sm.u.list.w[j] = 0ull;
    }
    __syncthreads();
    for (int k = 2; k <= n2; k <<= 1) {
        for (int h = k >> 1; h > 0; h >>= 1) {
            for (int i = t; i < n2; i += GB_SEL_THREADS) {
                int p = i ^ h;
                if (p > i) {
                    u64 a = sm.u.list.key[i], b = sm.u.list.key[p];
                    if ((i & k) == 0 ? a < b : a > b) {
                        sm.u.list.key[i] = b;
                        sm.u.list.key[p] = a;
                        u64 wa = sm.u.list.w[i];
                        sm.u.list.w[i] = sm.u.list.w[p];
                        sm.u.list.w[p] = wa;
                    }
                }
            }
            __syncthreads();
        }
    }
    bool ge = s.op == GB_SEL_GATHER_GE;
    if (s.phase == 0u) {  // top-k: the rem-th key of the group, or the k-th of a list holding all above
        int jk = gb_sel_cross(n, false, ge ? s.rem + s.above : s.rem, sm);
        u64 thr_k = sm.u.list.key[jk];
        if (!p_on) {
            if (t == 0) {
                sm.st.result = thr_k;
                sm.st.op = GB_SEL_DONE;
            }
        } else if (ge) {  // every top-k survivor is in the list: top-p here too
            u64 mine = 0;
#pragma unroll
            for (int e = 0; e < GB_SEL_PER_THREAD; ++e) {
                int j = t * GB_SEL_PER_THREAD + e;
                if (j <= jk) mine += sm.u.list.w[j];
            }
            u64 unused_e, unused_f, mass, unused_t;
            gb_sel_scan2(mine, 0ull, false, unused_e, unused_f, mass, unused_t, sm);
            double want = ceil(__dmul_rn((double)tp, (double)mass));
            u64 need = want < 1.0 ? 1ull : (u64)want;
            int jp = gb_sel_cross(n, true, need, sm);
            if (t == 0) {
                sm.st.result = gb_max_u64(thr_k, sm.u.list.key[jp]);
                sm.st.op = GB_SEL_DONE;
            }
        } else if (t == 0) {  // top-p over the keys >= thr_k, from its first pass
            sm.st.op = GB_SEL_HIST;
            sm.st.phase = 1u;
            sm.st.prefix = 0ull;
            sm.st.H = L;
            sm.st.rem = 0ull;
            sm.st.floor_key = thr_k;
            sm.st.above = 0ull;
        }
    } else {
        int jp = gb_sel_cross(n, true, s.rem, sm);
        if (t == 0) {
            sm.st.result = gb_max_u64(sm.u.list.key[jp], s.floor_key);
            sm.st.op = GB_SEL_DONE;
        }
    }
    __syncthreads();
}

// Ticket: true in the last block of the row to finish (after every block's global writes);
// it re-arms the ticket. Called by every thread of every block of a filtered row.
__device__ __forceinline__ bool gb_sel_last(u32* tick, int n_chunks, GbSelectSmem& sm) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 t = atomicAdd(tick, 1u);
        sm.last = t == (u32)(n_chunks - 1);
        if (sm.last) *tick = 0u;
    }
    __syncthreads();
    bool last = sm.last != 0;
    if (last) __threadfence();
    return last;
}

// Two blocks per SM (<= 64 registers): the chunks' sweeps are latency bound.
extern "C" __global__ __launch_bounds__(GB_SEL_THREADS, 2) void spec_probs_select(
    int n_rows, int vocab, int step, int s_rows, int n_chunks, const float* __restrict__ logits,
    const float* __restrict__ temperature, const int* __restrict__ top_k, const float* __restrict__ top_p,
    const float* __restrict__ min_p, u64* __restrict__ sel_thr, u64* __restrict__ sel_part, u32* __restrict__ sel_tick,
    u32* __restrict__ sel_hist);

// Threads: GB_SEL_THREADS per (chunk, sequence b) on blockIdx.x = b * n_chunks + chunk
// (chunks of ceil(V / n_chunks) tokens rounded up to whole float4s, n_chunks <= n_tiles),
// row r on y (r = step, or every row when step < 0). sel_thr[b, r] <- the smallest order
// key kept by min-p (min_p null, <= 0 or NaN = off) and top-k (0 or >= V = off), then
// top-p (>= 1 or NaN = off); 0 (keep all) for a row without filters or at temperature <= 0,
// without reading the row. Min-p keeps e = exp((l - max) / T) >= min_p: a run of the largest
// keys, like top-k, so the two meet in the larger threshold; top-p then runs over both's
// survivors (sampling_ref.select_thr).
extern "C" __global__ void spec_probs_select(int n_rows, int vocab, int step, int s_rows, int n_chunks,
                                             const float* __restrict__ logits,       // [B, T, V]
                                             const float* __restrict__ temperature,  // [B]
                                             const int* __restrict__ top_k,          // [B]
                                             const float* __restrict__ top_p,        // [B]
                                             const float* __restrict__ min_p,        // [B] or null
                                             u64* __restrict__ sel_thr,              // [B, S]
                                             u64* __restrict__ sel_part,             // [B, S, n_tiles] chunk maxima
                                             u32* __restrict__ sel_tick,             // [B, S] zero between calls
                                             u32* __restrict__ sel_hist) {           // [B, S, BINS] zero between calls
    __shared__ GbSelectSmem sm;
    int t = threadIdx.x;
    int b = blockIdx.x / n_chunks, chunk = blockIdx.x % n_chunks;
    int r = step >= 0 ? step : (int)blockIdx.y;
    long long cell = (long long)b * s_rows + r;
    float temp = temperature[b];
    int kk = top_k[b];
    float tp = top_p[b];
    float mp = min_p != nullptr ? min_p[b] : 0.0f;
    bool k_on = kk > 0 && kk < vocab, p_on = tp < 1.0f, m_on = mp > 0.0f;
    if (!(temp > 0.0f) || !(k_on || p_on || m_on)) {  // uniform per row: no barrier is skipped by part of it
        if (chunk == 0 && t == 0) sel_thr[cell] = 0ull;
        return;
    }
    const float* row = logits + ((long long)b * n_rows + r) * vocab;
    bool aligned = gb_aligned16(row);
    int nb = gb_sel_nb(vocab), L = 32 + nb, nt = gb_n_tiles(vocab);
    int clen = ((vocab + n_chunks - 1) / n_chunks + GB_SAMPLE_VEC - 1) / GB_SAMPLE_VEC * GB_SAMPLE_VEC;
    int i0 = min(vocab, chunk * clen), i1 = min(vocab, i0 + clen);
    u32* hist = sel_hist + cell * GB_SEL_BINS;
    // 1. The chunk's max key and (top-k) its counts of the first digit.
    if (k_on) gb_sel_zero_hist(sm);
    __syncthreads();
    u64 best = 0;
    for (int base = i0; base < i1; base += GB_SEL_SPAN) {
        float x[GB_SEL_V4][GB_SAMPLE_VEC];
        gb_sel_load(row, base, i1, aligned, x);
#pragma unroll
        for (int v = 0; v < GB_SEL_V4; ++v) {
#pragma unroll
            for (int c = 0; c < GB_SAMPLE_VEC; ++c) {
                int i = gb_sel_index(base, v, c);
                u32 d = GB_SEL_NONE;
                if (i < i1) {
                    u64 key = gb_order_key(x[v][c], i);
                    best = gb_max_u64(best, key);
                    d = (u32)(gb_sel_ck(key, i, nb) >> (L - GB_SEL_DIGIT));
                }
                if (k_on) gb_sel_count(d, 0ull, false, sm);
            }
        }
    }
    best = gb_sel_max(best, sm);  // its barriers also end the shared histogram's atomics
    if (t == 0) sel_part[cell * nt + chunk] = best;
    if (k_on) {
        for (int d = t; d < GB_SEL_BINS; d += GB_SEL_THREADS) {
            u32 c = sm.u.hist.c[d];
            if (c) atomicAdd(hist + d, c);
        }
    }
    if (!gb_sel_last(sel_tick + cell, n_chunks, sm)) return;
    // 2. The row's last block: the row max, then the rest of the select alone.
    u64 m = 0;
    for (int c = t; c < n_chunks; c += GB_SEL_THREADS) m = gb_max_u64(m, __ldcg(sel_part + cell * nt + c));
    u64 max_key = gb_sel_max(m, sm);
    float l_max = gb_key_logit(max_key);
    // Min-p: its threshold, the smallest key it keeps (e = exp((l - max) / T) >= min_p); with
    // top-k, a second pass counts the keys >= it: top-k matters only when k is fewer.
    u64 thr_m = 0ull;
    bool k_run = k_on;
    if (m_on) {
        u64 low = 0ull;  // max of ~key over the kept keys: ~ the smallest of them
        for (int base = 0; base < vocab; base += GB_SEL_SPAN) {  // trip count uniform over the block
            float x[GB_SEL_V4][GB_SAMPLE_VEC];
            gb_sel_load(row, base, vocab, aligned, x);
#pragma unroll
            for (int v = 0; v < GB_SEL_V4; ++v) {
#pragma unroll
                for (int c = 0; c < GB_SAMPLE_VEC; ++c) {
                    int i = gb_sel_index(base, v, c);
                    if (i < vocab && !(gb_scaled_exp(x[v][c], l_max, temp) < mp))
                        low = gb_max_u64(low, ~gb_order_key(x[v][c], i));
                }
            }
        }
        thr_m = ~gb_sel_max(low, sm);  // the top key is always kept (e = 1 >= min_p)
        if (k_on) {
            if (t == 0) sm.n = 0u;
            u32 above = 0u;
            for (int base = 0; base < vocab; base += GB_SEL_SPAN) {
                float x[GB_SEL_V4][GB_SAMPLE_VEC];
                gb_sel_load(row, base, vocab, aligned, x);
#pragma unroll
                for (int v = 0; v < GB_SEL_V4; ++v) {
#pragma unroll
                    for (int c = 0; c < GB_SAMPLE_VEC; ++c) {
                        int i = gb_sel_index(base, v, c);
                        if (i < vocab && gb_order_key(x[v][c], i) >= thr_m) ++above;
                    }
                }
            }
            for (int o = 16; o > 0; o >>= 1) above += __shfl_xor_sync(0xffffffffu, above, o);
            __syncthreads();  // sm.n is zero before any warp adds
            if ((t & 31) == 0) atomicAdd(&sm.n, above);
            __syncthreads();
            u32 n_m = sm.n;
            __syncthreads();
            k_run = (u64)kk < (u64)n_m;  // else top-k keeps every key min-p keeps: min-p alone decides
        }
    }
    GbSelState s;
    s.prefix = 0ull;
    s.rem = k_run ? (u64)kk : 0ull;
    s.floor_key = k_run ? 0ull : thr_m;
    s.above = 0ull;
    s.result = thr_m;
    s.op = k_run || p_on ? GB_SEL_HIST : GB_SEL_DONE;
    s.phase = k_run ? 0u : 1u;
    s.H = L;
    if (t == 0) sm.st = s;
    if (k_on) {  // the first top-k pass is done: take the row's histogram (and re-zero it)
        for (int d = t; d < GB_SEL_BINS; d += GB_SEL_THREADS) {
            sm.u.hist.c[d] = __ldcg(hist + d);
            sm.u.hist.w[d] = 0ull;
            hist[d] = 0u;
        }
        __syncthreads();
        if (k_run) gb_sel_pick(s, L, p_on, tp, max_key, sm);
    }
    __syncthreads();
    for (int it = 0; it < GB_SEL_MAX_STEPS; ++it) {
        s = sm.st;
        __syncthreads();  // every thread has its copy before anyone writes sm.st again
        if (s.op == GB_SEL_DONE) break;
        if (s.op == GB_SEL_HIST) {
            gb_sel_hist_row(row, vocab, aligned, nb, s, l_max, temp, sm);
            gb_sel_pick(s, L, p_on, tp, max_key, sm);
        } else {
            gb_sel_gather_row(row, vocab, aligned, nb, s, l_max, temp, sm);
            gb_sel_finish(s, L, p_on, tp, sm);
        }
    }
    if (t == 0) sel_thr[cell] = sm.st.result;
}

// ------------------------------------------------------------------ probabilities (+ draft race)

// Threads: one block of GB_SAMPLE_THREADS per (tile, sequence b) on blockIdx.x = b * n_tiles
// + tile, and row r on y (r = step, or every row when step < 0). Reads logits, writes, in
// place, e_i = exp((l_i - m_t) / T) for kept tokens (order key >= sel_thr[b, r]) and 0 for
// the others, with m_t the logit of the tile's largest order key; tile_key[b, r, t] <- that
// key, tile_sum[b, r, t] <- the tile's sum of e. Temperature <= 0 (or NaN): only tile_key
// (spec_probs_normalize writes the one-hot). race != 0 (draft rows): also the tile's race
// winner over e_i / E_i (E from draw GB_DRAW_DRAFT at position pos[b] + r + 1) into
// race_key[b, r, 0, t] (0: none) and its e into race_w[b, r, 0, t].
extern "C" __global__ void spec_probs_tiles(int n_rows, int vocab, int step, int s_rows, int race,
                                            const float* logits,                    // [B, T, V]
                                            const float* __restrict__ temperature,  // [B]
                                            const u64* __restrict__ sel_thr,        // [B, S]
                                            const u64* __restrict__ seed,           // [B] (race only)
                                            const int* __restrict__ pos,            // [B] (race only)
                                            float* probs,                           // [B, T, V]
                                            u64* __restrict__ tile_key,             // [B, S, n_tiles]
                                            float* __restrict__ tile_sum,           // [B, S, n_tiles]
                                            u64* __restrict__ race_key,             // [B, S, 2, n_tiles]
                                            float* __restrict__ race_w) {           // [B, S, 2, n_tiles]
    __shared__ GbTileSmem sm;
    int nt = gb_n_tiles(vocab);
    int b = blockIdx.x / nt, tile = blockIdx.x % nt;
    int r = step >= 0 ? step : (int)blockIdx.y;
    long long base = ((long long)b * n_rows + r) * vocab;
    const float* row = logits + base;
    float* out = probs + base;
    bool aligned = gb_aligned16(row) && gb_aligned16(out);
    float l[GB_SAMPLE_NVEC][4];
    u64 best = 0;
#pragma unroll
    for (int j = 0; j < GB_SAMPLE_NVEC; ++j) {
        int i0 = gb_vec_base(tile, j);
        gb_load4(row, i0, vocab, aligned, l[j], 0.0f);
#pragma unroll
        for (int c = 0; c < 4; ++c)
            if (i0 + c < vocab) best = gb_max_u64(best, gb_order_key(l[j][c], i0 + c));
    }
    best = gb_tile_max_u64(best, sm.warp_u);  // ends with every read of the tile done
    long long cell = ((long long)b * s_rows + r) * nt + tile;
    float temp = temperature[b];
    if (!(temp > 0.0f)) {
        if (threadIdx.x == 0) tile_key[cell] = best;
        return;
    }
    float m_t = gb_key_logit(best);
    u64 thr = sel_thr[(long long)b * s_rows + r];
    u64 my_seed = race ? seed[b] : 0ull;
    int my_pos = race ? pos[b] + r + 1 : 0;
    float sum = 0.0f, pay = 0.0f;
    u64 rkey = 0;
#pragma unroll
    for (int j = 0; j < GB_SAMPLE_NVEC; ++j) {
        int i0 = gb_vec_base(tile, j);
        float e[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            bool kept = i0 + c < vocab && gb_order_key(l[j][c], i0 + c) >= thr;
            e[c] = kept ? gb_scaled_exp(l[j][c], m_t, temp) : 0.0f;
            sum = __fadd_rn(sum, e[c]);
        }
        if (race && i0 < vocab) {
            float ex[4];
            gb_race_expo4(my_seed, my_pos, GB_DRAW_DRAFT, i0 / GB_SAMPLE_VEC, ex);
    #pragma unroll
        for (int c = 0; c < 4; ++c) {
                u64 key = e[c] > 0.0f ? gb_race_key(__fdiv_rn(e[c], ex[c]), i0 + c) : 0ull;
                if (key > rkey) {
                    rkey = key;
                    pay = e[c];
                }
            }
        }
        gb_store4(out, i0, vocab, aligned, e);
    }
    gb_tile_reduce(rkey, pay, sum, sm);
    if (threadIdx.x == 0) {
        tile_key[cell] = best;
        tile_sum[cell] = sum;
        if (race) {
            long long rc = ((long long)b * s_rows + r) * GB_RACES_PER_ROW * nt + tile;
            race_key[rc] = rkey;
            race_w[rc] = pay;
        }
    }
}

// One warp: the row's maximum order key, and (temperature > 0) each tile's scale
// s_t = exp((m_t - max) / T) and total = sum_t tile_sum[t] * s_t, lane l adding tiles
// l, l + 32, ... then the butterfly. Every lane gets max_key and total.
__device__ __forceinline__ void gb_row_combine(const u64* tkey, const float* tsum, int nt, float temp, u64& max_key,
                                               float& total) {
    int lane = threadIdx.x & 31;
    u64 m = 0;
    for (int t = lane; t < nt; t += 32) m = gb_max_u64(m, tkey[t]);
    max_key = gb_warp_max_u64(m);
    total = 0.0f;
    if (!(temp > 0.0f)) return;
    float lm = gb_key_logit(max_key), acc = 0.0f;
    for (int t = lane; t < nt; t += 32) {
        float s_t = gb_scaled_exp(gb_key_logit(tkey[t]), lm, temp);
        acc = __fadd_rn(acc, __fmul_rn(tsum[t], s_t));
    }
    total = gb_warp_sum(acc);
}

// Threads: as spec_probs_tiles, after it. probs_i <- e_i * s_t / total (see gb_row_combine);
// temperature <= 0: one-hot at the row's argmax (lowest index on ties). race != 0: the
// tile-0 block also picks the draft token, the largest (r_t * s_t, index) over the tiles'
// race winners: draft_tok[b, r] <- it (the argmax at temperature <= 0; PLACEHOLDER if no
// tile has a candidate), draft_prob[b, r] <- its probability as written to probs.
extern "C" __global__ void spec_probs_normalize(int n_rows, int vocab, int step, int s_rows, int race,
                                                const float* __restrict__ temperature,  // [B]
                                                const u64* __restrict__ tile_key,       // [B, S, n_tiles]
                                                const float* __restrict__ tile_sum,     // [B, S, n_tiles]
                                                const u64* __restrict__ race_key,       // [B, S, 2, n_tiles]
                                                const float* __restrict__ race_w,       // [B, S, 2, n_tiles]
                                                float* probs,                           // [B, T, V]
                                                int* __restrict__ draft_tok,            // [B, n_rows] (race only)
                                                float* __restrict__ draft_prob) {       // [B, n_rows] (race only)
    __shared__ GbTileSmem sm;
    int nt = gb_n_tiles(vocab);
    int b = blockIdx.x / nt, tile = blockIdx.x % nt;
    int r = step >= 0 ? step : (int)blockIdx.y;
    float temp = temperature[b];
    long long srow = (long long)b * s_rows + r;
    const u64* tkey = tile_key + srow * nt;
    const float* tsum = tile_sum + srow * nt;
    if (threadIdx.x < 32) {
        u64 max_key;
        float total;
        gb_row_combine(tkey, tsum, nt, temp, max_key, total);
        bool greedy = !(temp > 0.0f);
        if (threadIdx.x == 0) {
            sm.u0 = max_key;
            sm.f0 = total;
            sm.f1 = greedy ? 0.0f : gb_scaled_exp(gb_key_logit(tkey[tile]), gb_key_logit(max_key), temp);
        }
        if (race && tile == 0) {
            int lane = threadIdx.x;
            u64 best = 0;
            float pay = 0.0f;
            if (!greedy) {
                const u64* rk = race_key + srow * GB_RACES_PER_ROW * nt;
                const float* rw = race_w + srow * GB_RACES_PER_ROW * nt;
                float lm = gb_key_logit(max_key);
                for (int t = lane; t < nt; t += 32) {
                    if (rk[t] == 0ull) continue;
                    float s = gb_scaled_exp(gb_key_logit(tkey[t]), lm, temp);
                    u64 key = gb_race_key(__fmul_rn(__uint_as_float((u32)(rk[t] >> 32)), s), (int)(~(u32)rk[t]));
                    if (key > best) {
                        best = key;
                        pay = __fmul_rn(rw[t], s);
                    }
                }
                gb_warp_max_pay(best, pay);
            }
            if (lane == 0) {
                long long o = (long long)b * n_rows + r;
                if (greedy) {
                    draft_tok[o] = (int)(~(u32)max_key);
                    draft_prob[o] = 1.0f;
                } else {
                    draft_tok[o] = best ? (int)(~(u32)best) : GB_PLACEHOLDER_TOKEN;
                    draft_prob[o] = best ? __fdiv_rn(pay, total) : 0.0f;
                }
            }
        }
    }
    __syncthreads();
    u64 max_key = sm.u0;
    float total = sm.f0, s = sm.f1;
    bool greedy = !(temp > 0.0f);
    int amax = (int)(~(u32)max_key);
    float* out = probs + ((long long)b * n_rows + r) * vocab;
    bool aligned = gb_aligned16(out);
    for (int j = 0; j < GB_SAMPLE_NVEC; ++j) {
        int i0 = gb_vec_base(tile, j);
        if (i0 >= vocab) break;
        float x[4];
        if (greedy) {
            for (int c = 0; c < 4; ++c) x[c] = i0 + c == amax ? 1.0f : 0.0f;
        } else {
            gb_load4(out, i0, vocab, aligned, x, 0.0f);
            for (int c = 0; c < 4; ++c) x[c] = __fdiv_rn(__fmul_rn(x[c], s), total);
        }
        gb_store4(out, i0, vocab, aligned, x);
    }
}

// ------------------------------------------------------------------ races over given weights

// Race weight of a probability row, or of the residual max(0, p - q).
__device__ __forceinline__ float gb_residual(float p, float q) {
    float d = __fsub_rn(p, q);
    return d > 0.0f ? d : 0.0f;
}

// Fold four weights and their variates into a running race (key, weight of the winner).
__device__ __forceinline__ void gb_race4(const float w[4], const float ex[4], int i0, int vocab, u64& key,
                                         float& pay) {
    for (int c = 0; c < 4; ++c) {
        if (i0 + c >= vocab || !(w[c] > 0.0f)) continue;
        u64 k = gb_race_key(__fdiv_rn(w[c], ex[c]), i0 + c);
        if (k > key) {
            key = k;
            pay = w[c];
        }
    }
}

// Threads: as spec_probs_tiles (blockIdx.x = b * n_tiles + tile, row r on y). The tile's race
// winner over q_i / E_i (q_i > 0; E from draw GB_DRAW_DRAFT at position pos[b] + r + 1) into
// race_key[b, r, 0, t] (0: none) and its q into race_w[b, r, 0, t].
extern "C" __global__ void spec_race_tiles(int n_rows, int vocab, int step, int s_rows,
                                           const float* __restrict__ q,     // [B, T, V]
                                           const u64* __restrict__ seed,    // [B]
                                           const int* __restrict__ pos,     // [B]
                                           u64* __restrict__ race_key,      // [B, S, 2, n_tiles]
                                           float* __restrict__ race_w) {    // [B, S, 2, n_tiles]
    __shared__ GbTileSmem sm;
    int nt = gb_n_tiles(vocab);
    int b = blockIdx.x / nt, tile = blockIdx.x % nt;
    int r = step >= 0 ? step : (int)blockIdx.y;
    const float* row = q + ((long long)b * n_rows + r) * vocab;
    bool aligned = gb_aligned16(row);
    u64 my_seed = seed[b];
    int my_pos = pos[b] + r + 1;
    u64 key = 0;
    float pay = 0.0f, unused = 0.0f;
    for (int j = 0; j < GB_SAMPLE_NVEC; ++j) {
        int i0 = gb_vec_base(tile, j);
        if (i0 >= vocab) break;
        float w[4], ex[4];
        gb_load4(row, i0, vocab, aligned, w, 0.0f);
        gb_race_expo4(my_seed, my_pos, GB_DRAW_DRAFT, i0 / GB_SAMPLE_VEC, ex);
        gb_race4(w, ex, i0, vocab, key, pay);
    }
    gb_tile_reduce(key, pay, unused, sm);
    if (threadIdx.x == 0) {
        long long rc = ((long long)b * s_rows + r) * GB_RACES_PER_ROW * nt + tile;
        race_key[rc] = key;
        race_w[rc] = pay;
    }
}

// Threads: one warp per (sequence b = blockIdx.x, row r on y), after spec_race_tiles.
// draft_tok[b, r] <- the race winner (PLACEHOLDER without a candidate), draft_prob <- its q.
extern "C" __global__ void spec_race_pick(int n_rows, int vocab, int step, int s_rows,
                                          const u64* __restrict__ race_key,  // [B, S, 2, n_tiles]
                                          const float* __restrict__ race_w,  // [B, S, 2, n_tiles]
                                          int* __restrict__ draft_tok,       // [B, T]
                                          float* __restrict__ draft_prob) {  // [B, T]
    int nt = gb_n_tiles(vocab);
    int b = blockIdx.x;
    int r = step >= 0 ? step : (int)blockIdx.y;
    long long rc = ((long long)b * s_rows + r) * GB_RACES_PER_ROW * nt;
    u64 key = 0;
    float pay = 0.0f;
    for (int t = threadIdx.x; t < nt; t += 32) {
        if (race_key[rc + t] > key) {
            key = race_key[rc + t];
            pay = race_w[rc + t];
        }
    }
    gb_warp_max_pay(key, pay);
    if (threadIdx.x == 0) {
        long long o = (long long)b * n_rows + r;
        draft_tok[o] = key ? (int)(~(u32)key) : GB_PLACEHOLDER_TOKEN;
        draft_prob[o] = key ? pay : 0.0f;
    }
}

// ------------------------------------------------------------------ accept

// The accepted prefix n of sequence b: for i < n_valid = clamp(brk[b, 0], 0, k), in order,
// draft x = vtok[b, 1 + i] is accepted iff 0 <= x < V and u_i * q[b, i, x] < p[b, i, x]
// (u_i: draw GB_DRAW_ACCEPT at pos[b] + i + 1); n = the run of accepts before the first
// failure. Called by a whole warp: lane l tests draft base + l, a ballot finds the run.
__device__ int gb_accept_prefix(int b, int k, int vocab, int n_valid, const int* vtok, const float* p, const float* q,
                                u64 seed, int pos) {
    const int* v = vtok + (long long)b * (k + 1);
    int lane = threadIdx.x & 31, n = 0;
    for (int base = 0; base < n_valid; base += 32) {
        int i = base + lane;
        bool ok = false;
        if (i < n_valid) {
            int x = v[i + 1];
            if (x >= 0 && x < vocab) {
                float u = gb_uniform(seed, pos + i + 1, GB_DRAW_ACCEPT);
                float px = p[((long long)b * (k + 1) + i) * vocab + x];
                float qx = q[((long long)b * k + i) * vocab + x];
                ok = __fmul_rn(u, qx) < px;
            }
        }
        unsigned fail = ~__ballot_sync(0xffffffffu, ok);
        if (fail) return n + __ffs((int)fail) - 1;
        n += 32;
    }
    return n;
}

// Threads: one block of GB_SAMPLE_THREADS per (tile, sequence b) on blockIdx.x = b * n_tiles
// + tile. Every block finds the accepted prefix n (gb_accept_prefix; warp 0, shared) and
// races its tile of row n with E from draw GB_DRAW_RESAMPLE at position pos[b] + n + 1:
// race 0 over the residual max(0, p_n - q_n) (only when n < n_valid), race 1 over p_n;
// winners into race_key[b, 0, race, t] (0: none), their weights into race_w.
extern "C" __global__ void spec_accept_tiles(int k, int vocab, int s_rows,
                                             const int* __restrict__ vtok,  // [B, K1]
                                             const float* __restrict__ p,   // [B, K1, V]
                                             const float* __restrict__ q,   // [B, k, V]
                                             const int* __restrict__ brk,   // [B, 2]
                                             const u64* __restrict__ seed,  // [B]
                                             const int* __restrict__ pos,   // [B]
                                             u64* __restrict__ race_key,    // [B, S, 2, n_tiles]
                                             float* __restrict__ race_w) {  // [B, S, 2, n_tiles]
    __shared__ GbTileSmem sm;
    int nt = gb_n_tiles(vocab);
    int b = blockIdx.x / nt, tile = blockIdx.x % nt;
    u64 my_seed = seed[b];
    int my_pos = pos[b];
    int n_valid = min(max(brk[2 * b], 0), k);
    if (threadIdx.x < 32) {
        int n = gb_accept_prefix(b, k, vocab, n_valid, vtok, p, q, my_seed, my_pos);
        if (threadIdx.x == 0) sm.i0 = n;
    }
    __syncthreads();
    int n = sm.i0;
    bool residual = n < n_valid;
    const float* p_row = p + ((long long)b * (k + 1) + n) * vocab;
    const float* q_row = q + ((long long)b * k + (residual ? n : 0)) * vocab;
    bool aligned = gb_aligned16(p_row) && gb_aligned16(q_row);
    u64 key_r = 0, key_p = 0;
    float pay_r = 0.0f, pay_p = 0.0f, unused = 0.0f;
    for (int j = 0; j < GB_SAMPLE_NVEC; ++j) {
        int i0 = gb_vec_base(tile, j);
        if (i0 >= vocab) break;
        float pv[4], ex[4];
        gb_load4(p_row, i0, vocab, aligned, pv, 0.0f);
        gb_race_expo4(my_seed, my_pos + n + 1, GB_DRAW_RESAMPLE, i0 / GB_SAMPLE_VEC, ex);
        gb_race4(pv, ex, i0, vocab, key_p, pay_p);
        if (residual) {
            float qv[4], d[4];
            gb_load4(q_row, i0, vocab, aligned, qv, 0.0f);
            for (int c = 0; c < 4; ++c) d[c] = gb_residual(pv[c], qv[c]);
            gb_race4(d, ex, i0, vocab, key_r, pay_r);
        }
    }
    gb_tile_reduce(key_r, pay_r, unused, sm);
    __syncthreads();  // thread 0 is done with the shared partials before the second reduce
    gb_tile_reduce(key_p, pay_p, unused, sm);
    if (threadIdx.x == 0) {
        long long rc = (long long)b * s_rows * GB_RACES_PER_ROW * nt + tile;
        race_key[rc] = key_r;
        race_w[rc] = pay_r;
        race_key[rc + nt] = key_p;
        race_w[rc + nt] = pay_p;
    }
}

// Threads: one warp per sequence, after spec_accept_tiles. n_acc[b] <- the accepted prefix
// n; last_pred[b] <- the token for position pos[b] + n + 1: the residual race's winner after
// a rejection (n < n_valid) when the residual has one, else the race over p_n
// (PLACEHOLDER if p_n has no positive entry).
extern "C" __global__ void spec_accept_pick(int k, int vocab, int s_rows,
                                            const int* __restrict__ vtok,      // [B, K1]
                                            const float* __restrict__ p,       // [B, K1, V]
                                            const float* __restrict__ q,       // [B, k, V]
                                            const int* __restrict__ brk,       // [B, 2]
                                            const u64* __restrict__ seed,      // [B]
                                            const int* __restrict__ pos,       // [B]
                                            const u64* __restrict__ race_key,  // [B, S, 2, n_tiles]
                                            int* __restrict__ n_acc,           // [B]
                                            int* __restrict__ last_pred) {     // [B]
    int nt = gb_n_tiles(vocab);
    int b = blockIdx.x;
    int n_valid = min(max(brk[2 * b], 0), k);
    long long rc = (long long)b * s_rows * GB_RACES_PER_ROW * nt;
    u64 key_r = 0, key_p = 0;
    for (int t = threadIdx.x; t < nt; t += 32) {
        key_r = gb_max_u64(key_r, race_key[rc + t]);
        key_p = gb_max_u64(key_p, race_key[rc + nt + t]);
    }
    key_r = gb_warp_max_u64(key_r);
    key_p = gb_warp_max_u64(key_p);
    int n = gb_accept_prefix(b, k, vocab, n_valid, vtok, p, q, seed[b], pos[b]);
    if (threadIdx.x == 0) {
        u64 key = n < n_valid && key_r ? key_r : key_p;
        n_acc[b] = n;
        last_pred[b] = key ? (int)(~(u32)key) : GB_PLACEHOLDER_TOKEN;
    }
}

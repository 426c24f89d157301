// graphburst device kernels: conventions, constants and shared device helpers.
// A section of graphburst/kernels.cu (one translation unit); include it through that file.
#pragma once

// Conventions (the numpy twin in reference.py is the executable specification):
//   * Tokens, positions, lengths and counters are int32. Tokens are int32 rather than
//     uint32 so that PLACEHOLDER_TOKEN = -1 can poison unused verify positions, and so that every
//     buffer interoperates with torch/numpy int32 without casts.
//   * B = batch, K1 = k + 1 verify positions per sequence, R = ring stride = M*(k+1) + 1.
//   * Pointer tables are uint64 arrays of device addresses; 0 marks an absent layer.
//   * Every kernel is stream-ordered and allocation-free, so it is safe inside a graph.
//
// Compiled by NVRTC through cupy.RawModule at run time (CuPy always adds -ftz=true: float
// subnormals flush to zero, which the sampling twin models) and by nvcc in CI (-Werror,
// a syntax check only).

typedef unsigned int u32;
typedef unsigned long long u64;

#define GB_PLACEHOLDER_TOKEN (-1)
#define GB_UNBOUNDED_BUDGET 0x7fffffff
#define GB_NO_PREFILL (-1)
#define GB_CAP_THREADS 256
#define GB_DIGEST_INIT 0x2545f491u
#define GB_DIGEST_CORRUPT 0xdeadbeefu
#define GB_ALL_ONES 0xffffffffu

// =====================================================================================
// Shared device helpers
// =====================================================================================

// lowbias32 finaliser: a cheap bijective mixer; the reference reproduces it in uint32.
__device__ __forceinline__ u32 gb_mix32(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// One step of the stub models' rolling prefix digest: c[p] = f(c[p-1], token[p], p).
__device__ __forceinline__ u32 gb_digest_step(u32 prev, int tok, int pos) {
    u32 t = (u32)tok * 0x9e3779b1u + (u32)pos * 0x85ebca77u + 0x165667b1u;
    return gb_mix32(prev ^ gb_mix32(t));
}

// Layers that agree give the digest itself; any disagreement (a stale or missing
// rollback of one layer) garbles it, so the predicted token changes.
__device__ __forceinline__ u32 gb_combine(u32 mn, u32 mx) {
    return mn == mx ? mn : gb_mix32(mn ^ (mx * 0x27d4eb2fu) ^ 0x94d049bbu);
}

__device__ __forceinline__ int gb_target_token(u32 digest, int vocab) {
    return (int)(gb_mix32(digest ^ 0x68e31da4u) % (u32)vocab);
}

// Agreement hash of the draft stub, keyed by (seed, position of the predicted token).
__device__ __forceinline__ u32 gb_agree_hash(u32 seed, int pos) {
    return gb_mix32(seed ^ gb_mix32((u32)pos * 0x27d4eb2du + 0x1b873593u));
}

__device__ __forceinline__ u64 gb_globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Emulated model time: one thread per block spins on the device clock.
__device__ __forceinline__ void gb_spin_ns(long long ns) {
    if (ns <= 0) return;
    u64 t0 = gb_globaltimer();
    while ((long long)(gb_globaltimer() - t0) < ns) {
    }
}

// Last entry of a stub KV row, or a corrupt marker when the length is out of range
// (a poisoned length must never turn into an out-of-bounds read).
__device__ __forceinline__ u32 gb_prev_entry(const int* row, int n, int capacity) {
    if (n < 0 || n > capacity) return GB_DIGEST_CORRUPT;
    return n > 0 ? (u32)row[n - 1] : GB_DIGEST_INIT;
}

// gb_prev_entry(row, *len, capacity), with the entry loaded speculatively at the length
// the caller expects, so the length and the entry arrive in one round trip to L2. A
// length that differs takes the slow path; the result is the same either way.
__device__ __forceinline__ u32 gb_prev_entry_expect(const int* row, const int* len, int expect, int capacity,
                                                    int* n_out) {
    int spec = (expect > 0 && expect <= capacity) ? row[expect - 1] : 0;
    int n = *len;
    *n_out = n;
    if (n == expect && n > 0 && n <= capacity) return (u32)spec;
    return gb_prev_entry(row, n, capacity);
}

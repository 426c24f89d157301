// The stub models' kernels; numpy twins in stubs_ref.py.
// A section of graphburst/kernels.cu (one translation unit); include it through that file.
#pragma once

#include "common.cuh"

// =====================================================================================
// Stub models (deterministic, digest-carrying KV caches; see reference.py)
// =====================================================================================

// Sequence b's KV row and the layer's length array for table entry l; false for a layer
// without KV. A thread's first layer (l0) comes from table entries it loaded up front.
__device__ __forceinline__ bool gb_stub_layer(int l, int l0, u64 kv0, u64 len0, const u64* kv_tbl,
                                              const u64* len_tbl, int b, int capacity, int** kv, int** len) {
    u64 kv_p = l == l0 ? kv0 : kv_tbl[l];
    if (kv_p == 0) return false;
    *kv = reinterpret_cast<int*>(kv_p) + (long long)b * capacity;
    *len = reinterpret_cast<int*>(l == l0 ? len0 : len_tbl[l]);
    return true;
}

// Threads: one block per sequence; threads stride over the cache's layers, each walking
// the prompt. A prompt may come in chunks: with S = start[b] (0 when start is null),
// entries [0, S) already hold the prompt's first S tokens (earlier calls), so the digest
// continues from entry S - 1 and this call writes entries [S, S + P) for positions
// S .. S + P - 1 and sets every length to S + P: a prompt prefilled whole or in chunks
// leaves identical entries. Optionally sets the position counter to S + P and seeds the
// pending token with the target's greedy prediction.
extern "C" __global__ void stub_prefill(const int* __restrict__ prompt,      // [B, P_max]
                                        const int* __restrict__ prompt_len,  // [B]
                                        const int* __restrict__ start,       // [B] or null (all 0)
                                        int p_max,
                                        const u64* __restrict__ kv_tbl,      // [L]
                                        const u64* __restrict__ len_tbl,     // [L]
                                        int n_layers, int capacity, int vocab,
                                        int* __restrict__ pos_ctr,           // [B] or null
                                        int* __restrict__ pend) {            // [B] or null
    __shared__ u32 s_min, s_max;
    int b = blockIdx.x;
    int plen = prompt_len[b];
    if (plen == GB_NO_PREFILL) return;
    int s0 = start ? min(max(start[b], 0), capacity) : 0;
    plen = min(max(plen, 0), min(p_max, capacity - s0));
    if (threadIdx.x == 0) {
        s_min = GB_ALL_ONES;
        s_max = 0u;
    }
    __syncthreads();
    const int* row = prompt + (long long)b * p_max;
    for (int l = threadIdx.x; l < n_layers; l += blockDim.x) {
        if (kv_tbl[l] == 0) continue;
        int* kv = reinterpret_cast<int*>(kv_tbl[l]) + (long long)b * capacity;
        u32 c = gb_prev_entry(kv, s0, capacity);
        for (int i = 0; i < plen; ++i) {
            c = gb_digest_step(c, row[i], s0 + i);
            kv[s0 + i] = (int)c;
        }
        reinterpret_cast<int*>(len_tbl[l])[b] = s0 + plen;
        atomicMin(&s_min, c);
        atomicMax(&s_max, c);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (pos_ctr) pos_ctr[b] = s0 + plen;
        if (pend) pend[b] = gb_target_token(gb_combine(s_min, s_max), vocab);
    }
}

// Threads: one block per sequence; threads stride over the draft's layers, each appending
// one entry (two on the last unbroken step when extend_last, so the draft KV covers every
// draft; a sampling decoder passes 0 and appends its sampled last draft with
// stub_draft_append instead).
// Step j reads x_j (vtok[b,0] for j = 0, else draft_tok[b, j-1]) at position pos_ctr+j
// and proposes draft_tok[b, j] with its confidence, also writing it to vtok[b, 1+j]; a
// confidence below p_min breaks the chain (brk[b] = [j, 1], vtok[b, 1+j] untouched) and
// later steps of the round return at once.
extern "C" __global__ void stub_draft_step(int step, int k,
                                           int* __restrict__ vtok,           // [B, K1]
                                           const int* __restrict__ pos_ctr,  // [B]
                                           const u64* __restrict__ kv_tbl,   // [L]
                                           const u64* __restrict__ len_tbl,  // [L]
                                           int n_layers, int capacity, int vocab,
                                           const u32* __restrict__ seed,     // [B]
                                           const int* __restrict__ agree24,  // [B]
                                           int pmin24, long long cost_ns,
                                           int* __restrict__ draft_tok,      // [B, k]
                                           float* __restrict__ draft_conf,   // [B, k]
                                           int* __restrict__ brk,            // [B, 2]
                                           int extend_last) {
    __shared__ u32 s_min, s_max;
    __shared__ int s_tok, s_extend;
    int b = blockIdx.x;
    // Independent loads are issued together so their latencies overlap. Every thread
    // reads the break marker before thread 0 may rewrite it (after a barrier).
    int broken = brk[2 * b + 1];
    int x = step == 0 ? vtok[(long long)b * (k + 1)] : draft_tok[(long long)b * k + step - 1];
    int pos = pos_ctr[b] + step;
    u32 my_seed = seed[b];
    int my_agree = agree24[b];
    int l0 = threadIdx.x;
    u64 kv0 = l0 < n_layers ? kv_tbl[l0] : 0;
    u64 len0 = l0 < n_layers ? len_tbl[l0] : 0;
    if (broken != 0) return;
    if (threadIdx.x == 0) {
        gb_spin_ns(cost_ns);
        s_min = GB_ALL_ONES;
        s_max = 0u;
    }
    __syncthreads();
    int my_n = 0;  // this thread's first layer, kept for the last step's second append
    u32 my_c = 0u;
    for (int l = threadIdx.x; l < n_layers; l += blockDim.x) {
        int *kv, *len;
        if (!gb_stub_layer(l, l0, kv0, len0, kv_tbl, len_tbl, b, capacity, &kv, &len)) continue;
        int n;
        u32 c = gb_digest_step(gb_prev_entry_expect(kv, len + b, pos, capacity, &n), x, pos);
        if (n >= 0 && n < capacity) kv[n] = (int)c;
        len[b] = n + 1;
        atomicMin(&s_min, c);
        atomicMax(&s_max, c);
        if (l == l0) {
            my_n = n;
            my_c = c;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int truth = gb_target_token(gb_combine(s_min, s_max), vocab);
        u32 h = gb_agree_hash(my_seed, pos + 1);
        u32 h2 = gb_mix32(h ^ 0x5bd1e995u);
        int tok = truth;
        if ((int)(h >> 8) >= my_agree) {
            u32 shift = 1u + gb_mix32(h2 ^ 0xcc9e2d51u) % (u32)(vocab - 1);
            tok = (int)(((u32)truth + shift) % (u32)vocab);
        }
        int conf24 = (int)(h2 >> 8);
        draft_tok[(long long)b * k + step] = tok;
        draft_conf[(long long)b * k + step] = (float)conf24 * (1.0f / 16777216.0f);
        int breaks = conf24 < pmin24;
        if (breaks) {
            brk[2 * b] = step;
            brk[2 * b + 1] = 1;
        } else {
            vtok[(long long)b * (k + 1) + 1 + step] = tok;
        }
        s_tok = tok;
        s_extend = extend_last && !breaks && step == k - 1;
    }
    __syncthreads();
    if (!s_extend) return;
    for (int l = threadIdx.x; l < n_layers; l += blockDim.x) {
        int *kv, *len;
        if (!gb_stub_layer(l, l0, kv0, len0, kv_tbl, len_tbl, b, capacity, &kv, &len)) continue;
        // The first layer's length and last entry are this thread's own writes: reuse them.
        int n = l == l0 ? my_n + 1 : len[b];
        u32 prev = (l == l0 && my_n >= 0 && my_n < capacity) ? my_c : gb_prev_entry(kv, n, capacity);
        u32 c = gb_digest_step(prev, s_tok, pos + 1);
        if (n >= 0 && n < capacity) kv[n] = (int)c;
        len[b] = n + 1;
    }
}

// Threads: one block per sequence; threads stride over the target's layers, each walking
// the k + 1 verify positions. Appends every entry at the layer's own length (reading only
// below it), grows the length by k + 1, and writes the greedy prediction per position.
extern "C" __global__ void stub_verify(int k,
                                       const int* __restrict__ vtok,     // [B, K1]
                                       const int* __restrict__ pos_ctr,  // [B]
                                       const u64* __restrict__ kv_tbl,   // [L]
                                       const u64* __restrict__ len_tbl,  // [L]
                                       int n_layers, int capacity, int vocab,
                                       long long cost_ns,
                                       int* __restrict__ tgt_pred) {     // [B, K1]
    extern __shared__ u32 s_minmax[];  // [2, K1]
    int b = blockIdx.x;
    int k1 = k + 1;
    int l0 = threadIdx.x;
    u64 kv0 = l0 < n_layers ? kv_tbl[l0] : 0;  // issued before the barrier to overlap latency
    u64 len0 = l0 < n_layers ? len_tbl[l0] : 0;
    if (threadIdx.x == 0) gb_spin_ns(cost_ns);
    for (int j = threadIdx.x; j < k1; j += blockDim.x) {
        s_minmax[j] = GB_ALL_ONES;
        s_minmax[k1 + j] = 0u;
    }
    __syncthreads();
    const int* v = vtok + (long long)b * k1;
    int pos = pos_ctr[b];
    for (int l = threadIdx.x; l < n_layers; l += blockDim.x) {
        int *kv, *len;
        if (!gb_stub_layer(l, l0, kv0, len0, kv_tbl, len_tbl, b, capacity, &kv, &len)) continue;
        int n;
        u32 c = gb_prev_entry_expect(kv, len + b, pos, capacity, &n);
        for (int j = 0; j < k1; ++j) {
            c = gb_digest_step(c, v[j], pos + j);
            if (n >= 0 && n + j < capacity) kv[n + j] = (int)c;
            atomicMin(&s_minmax[j], c);
            atomicMax(&s_minmax[k1 + j], c);
        }
        len[b] = n + k1;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < k1; j += blockDim.x)
        tgt_pred[(long long)b * k1 + j] =
            gb_target_token(gb_combine(s_minmax[j], s_minmax[k1 + j]), vocab);
}

// Threads: one block per sequence; threads stride over the draft's layers. Sampling mode's
// draft_append_last: for a chain that did not break (brk[b, 1] == 0), appends the entry of
// the sampled last draft draft_tok[b, k-1] at position pos_ctr[b] + k at each layer's own
// length, so the draft KV covers [anchor, anchor + k] as in greedy mode.
extern "C" __global__ void stub_draft_append(int k,
                                             const int* __restrict__ draft_tok,  // [B, k]
                                             const int* __restrict__ pos_ctr,    // [B]
                                             const int* __restrict__ brk,        // [B, 2]
                                             const u64* __restrict__ kv_tbl,     // [L]
                                             const u64* __restrict__ len_tbl,    // [L]
                                             int n_layers, int capacity) {
    int b = blockIdx.x;
    if (brk[2 * b + 1] != 0) return;
    int tok = draft_tok[(long long)b * k + k - 1];
    int pos = pos_ctr[b] + k;
    for (int l = threadIdx.x; l < n_layers; l += blockDim.x) {
        if (kv_tbl[l] == 0) continue;
        int* kv = reinterpret_cast<int*>(kv_tbl[l]) + (long long)b * capacity;
        int* len = reinterpret_cast<int*>(len_tbl[l]);
        int n = len[b];
        u32 c = gb_digest_step(gb_prev_entry(kv, n, capacity), tok, pos);
        if (n >= 0 && n < capacity) kv[n] = (int)c;
        len[b] = n + 1;
    }
}

// Threads: one block per (sequence b, row t), t = step or every row (gridDim.y = T) when
// step < 0; threads stride over the vocabulary. The stub models' distributions: row t is
// for the token at position P = pos[b] + pos_offset + t whose greedy choice is
// g = pred[b * pred_stride + t]. With h_i = mix(key(salt, P, g) ^ i'), logit_i =
// ((h_i >> 8) * 2^-24) * spread in [0, spread) for i != g and logit_g = spread + peak, so
// g is the unique argmax (temperature 0 samples exactly the greedy token) and the row is
// a pure function of the prefix. Every op is exact or one rounded float op (the numpy
// twin matches bit for bit).
extern "C" __global__ void stub_logits(int n_rows, int vocab, int step,
                                       const int* __restrict__ pred,  // [B, pred_stride]
                                       int pred_stride,
                                       const int* __restrict__ pos,   // [B]
                                       int pos_offset, u32 salt, float spread, float peak,
                                       float* __restrict__ logits) {  // [B, T, V]
    int b = blockIdx.x;
    int t = step >= 0 ? step : (int)blockIdx.y;
    int g = pred[(long long)b * pred_stride + t];
    u32 p = (u32)(pos[b] + pos_offset + t);
    u32 key = gb_mix32(salt ^ gb_mix32(p * 0x9e3779b1u + (u32)g * 0x85ebca77u));
    float* row = logits + ((long long)b * n_rows + t) * vocab;
    float top = __fadd_rn(spread, peak);
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        u32 h = gb_mix32(key ^ ((u32)i * 0x27d4eb2fu + 0x165667b1u));
        row[i] = i == g ? top : __fmul_rn(__fmul_rn((float)(h >> 8), 0x1p-24f), spread);
    }
}

// Prompt-lookup (n-gram) drafting inside the burst; numpy twin in ngram_ref.py.
// A section of graphburst/kernels.cu (one translation unit); include it through that file.
//
// Each sequence keeps its token history on the device: hist[b, p] is the token at
// position p (prompt, then committed tokens). The search kernel itself keeps it current:
// at round start it stores the pending token at pos_ctr and its own proposals after it,
// and the rollback (which sets pos_ctr to the committed end) makes every entry below the
// next round's pos_ctr exactly the sequence. So the history needs no host and no extra
// commit kernel: entries past pos_ctr are stale and never read.
#pragma once

#include "common.cuh"

#define GB_NGRAM_MAX 16       // longest n-gram the search tries (n_max <= this)
#define GB_NGRAM_THREADS 512  // threads per sequence of the search (a power of two, <= 1024)
#define GB_NGRAM_NONE (-1LL)  // search key of "no match"
#define GB_NGRAM_UNROLL 8     // history loads each search thread keeps in flight

// Threads: one per (sequence, prompt token); grid x walks the batch (up to 2**31 - 1 rows).
// A prompt may come in chunks: with S = start[b] (0 when start is null, clamped to the
// capacity), hist[b, S + i] = prompt[b, i] for i < P = prompt_len[b] (clamped to the row
// and to capacity - S) and hist_len[b] = S + P; entries below S (earlier chunks) are left
// as they are. Rows with prompt_len = NO_PREFILL are left alone.
extern "C" __global__ void ngram_prefill(int p_max, int capacity,
                                         const int* __restrict__ prompt,      // [B, P_max]
                                         const int* __restrict__ prompt_len,  // [B]
                                         const int* __restrict__ start,       // [B] or null (all 0)
                                         int* __restrict__ hist,              // [B, capacity]
                                         int* __restrict__ hist_len) {        // [B]
    int b = blockIdx.x;
    int i = blockIdx.y * blockDim.x + threadIdx.x;
    int n = prompt_len[b];
    if (n == GB_NO_PREFILL) return;
    int s0 = start ? min(max(start[b], 0), capacity) : 0;
    n = min(max(n, 0), min(p_max, capacity - s0));
    if (i < n) hist[(long long)b * capacity + s0 + i] = prompt[(long long)b * p_max + i];
    if (i == 0) hist_len[b] = s0 + n;
}

// Key of a candidate: longer match first, then the most recent (largest end) one.
__device__ __forceinline__ long long gb_ngram_key(int m, int e) { return ((long long)m << 32) | (unsigned)e; }

// The larger key (spelled out: no reliance on a 64-bit max overload under NVRTC).
__device__ __forceinline__ long long gb_ngram_best(long long a, long long b) { return a > b ? a : b; }

// Threads: one block of GB_NGRAM_THREADS per sequence.
// With P = pos_ctr[b] and L = P + 1 history tokens (hist[P] = vtok[b, 0], the pending
// token): among window ends e in [0, L - 2], m(e) = the longest common suffix of
// hist[0..e] and hist[0..L-1], capped at n_max[b]. The pick is the largest (m, e) with
// m >= n_min[b]: the longest n in [n_min, n_max] that matches, at its most recent
// earlier occurrence. It proposes nv = min(k, L - 1 - e) tokens hist[e + 1 ..], into
// draft_tok (and vtok[:, 1 + j] when write_vtok), and into hist[P + 1 + j]. No match, an
// idle slot (budget <= 0) or P outside [0, capacity): nv = 0. Always brk[b] = [nv, nv < k],
// draft_tok/draft_conf past nv = PLACEHOLDER/0, hist_len[b] = min(P + 1 + nv, capacity)
// (the protocol's draft length) for a live slot.
extern "C" __global__ void ngram_search(int k, int capacity, int write_vtok,
                                        int* __restrict__ vtok,             // [B, K1]: reads slot 0, writes 1..k
                                        const int* __restrict__ pos_ctr,    // [B]
                                        const int* __restrict__ budget,     // [B]
                                        const int* __restrict__ n_min,      // [B]
                                        const int* __restrict__ n_max,      // [B], <= GB_NGRAM_MAX
                                        int* __restrict__ hist,             // [B, capacity]
                                        int* __restrict__ hist_len,         // [B]
                                        int* __restrict__ draft_tok,        // [B, k]
                                        float* __restrict__ draft_conf,     // [B, k]
                                        int* __restrict__ brk) {            // [B, 2]
    __shared__ int s_suf[GB_NGRAM_MAX];              // s_suf[t] = hist[L - 1 - t]
    __shared__ long long s_best[GB_NGRAM_THREADS / 32];
    int b = blockIdx.x;
    int tid = threadIdx.x;
    int P = pos_ctr[b];
    int live = budget[b] > 0 && P >= 0 && P < capacity;
    int lo = max(n_min[b], 1);
    int hi = min(n_max[b], GB_NGRAM_MAX);
    int* h = hist + (long long)b * capacity;
    int pend = vtok[(long long)b * (k + 1)];
    if (live && tid < hi) s_suf[tid] = tid == 0 ? pend : (P - tid >= 0 ? h[P - tid] : GB_PLACEHOLDER_TOKEN);
    __syncthreads();
    long long best = GB_NGRAM_NONE;
    if (live && lo <= hi) {
        int last = s_suf[0];
        // Most ends fail on the first compare, so the scan is about one coalesced load per
        // history token; the rare hits walk back through L1. Each thread issues its
        // GB_NGRAM_UNROLL loads of a tile before comparing any, so a tile costs one memory
        // latency rather than GB_NGRAM_UNROLL of them (8k tokens: two tiles).
        for (int base = 0; base < P; base += GB_NGRAM_THREADS * GB_NGRAM_UNROLL) {
            int tok[GB_NGRAM_UNROLL];
#pragma unroll
            for (int u = 0; u < GB_NGRAM_UNROLL; ++u) {
                int e = base + u * GB_NGRAM_THREADS + tid;
                tok[u] = e < P ? h[e] : ~last;  // ~last != last: past the end never matches
            }
#pragma unroll
            for (int u = 0; u < GB_NGRAM_UNROLL; ++u) {
                int e = base + u * GB_NGRAM_THREADS + tid;
                if (tok[u] != last) continue;
                int m = 1;
                while (m < hi && e - m >= 0 && h[e - m] == s_suf[m]) ++m;
                if (m >= lo) best = gb_ngram_best(best, gb_ngram_key(m, e));
            }
        }
    }
    for (int off = 16; off > 0; off >>= 1) best = gb_ngram_best(best, __shfl_xor_sync(0xffffffffu, best, off));
    if ((tid & 31) == 0) s_best[tid >> 5] = best;
    __syncthreads();
    if (tid < 32) {
        best = tid < GB_NGRAM_THREADS / 32 ? s_best[tid] : GB_NGRAM_NONE;
        for (int off = 16; off > 0; off >>= 1) best = gb_ngram_best(best, __shfl_xor_sync(0xffffffffu, best, off));
        if (tid == 0) s_best[0] = best;
    }
    __syncthreads();
    best = s_best[0];
    int e = (int)(best & 0xffffffffLL);
    int nv = best == GB_NGRAM_NONE ? 0 : min(k, P - e);
    for (int j = tid; j < k; j += GB_NGRAM_THREADS) {
        int src = e + 1 + j;
        int tok = j < nv ? (src == P ? pend : h[src]) : GB_PLACEHOLDER_TOKEN;
        draft_tok[(long long)b * k + j] = tok;
        draft_conf[(long long)b * k + j] = j < nv ? 1.0f : 0.0f;
        if (write_vtok) vtok[(long long)b * (k + 1) + 1 + j] = tok;
    }
    // Stores only after every thread's last read of the row (the barrier above): the
    // pending token and the proposals extend the history past position P - 1.
    if (live) {
        if (tid == 0) h[P] = pend;
        for (int j = tid; j < nv; j += GB_NGRAM_THREADS)
            if (P + 1 + j < capacity) h[P + 1 + j] = draft_tok[(long long)b * k + j];
    }
    if (tid == 0) {
        brk[2 * b] = nv;
        brk[2 * b + 1] = nv < k;
        if (live) hist_len[b] = min(P + 1 + nv, capacity);
    }
}

// Threads: one per (sequence, vocabulary entry); grid x walks the batch.
// Sampling mode: draft row `step` as logits of the one-hot q of a deterministic proposal,
// draft_logits[b, step, v] = 0 at v = tok, -inf elsewhere, with tok = prop[b, step] for
// step < brk[b, 0] and 0 past the break (a defined row the accept never reads). A token
// outside [0, V) (never proposed from a valid history) also falls back to 0.
extern "C" __global__ void ngram_onehot_logits(int k, int vocab, int step,
                                               const int* __restrict__ prop,   // [B, k]
                                               const int* __restrict__ brk,    // [B, 2]
                                               float* __restrict__ logits) {   // [B, k, V]
    int b = blockIdx.x;
    long long v = (long long)blockIdx.y * blockDim.x + threadIdx.x;
    if (v >= vocab) return;
    int tok = step < brk[2 * b] ? prop[(long long)b * k + step] : 0;
    if (tok < 0 || tok >= vocab) tok = 0;
    logits[((long long)b * k + step) * vocab + v] = v == tok ? 0.0f : __int_as_float(0xff800000);
}

// Threads: one per (sequence, draft slot); grid x walks the batch.
// Sampling mode, after the last draw: hist[b, pos_ctr[b] + 1 + j] = draft_tok[b, j] for
// j < brk[b, 0] (inside capacity), so the history holds the drafts the verify will see.
extern "C" __global__ void ngram_append(int k, int capacity,
                                        const int* __restrict__ draft_tok,  // [B, k]
                                        const int* __restrict__ pos_ctr,    // [B]
                                        const int* __restrict__ brk,        // [B, 2]
                                        int* __restrict__ hist) {           // [B, capacity]
    int b = blockIdx.x;
    int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= k || j >= brk[2 * b]) return;
    int p = pos_ctr[b] + 1 + j;
    if (p >= 0 && p < capacity) hist[(long long)b * capacity + p] = draft_tok[(long long)b * k + j];
}

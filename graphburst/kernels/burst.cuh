// Generic burst bookkeeping kernels (model-agnostic); numpy twins in burst_ref.py.
// A section of graphburst/kernels.cu (one translation unit); include it through that file.
#pragma once

#include "common.cuh"

// =====================================================================================
// Generic kernels (model-agnostic burst bookkeeping)
// =====================================================================================

// Per-sequence bodies, shared by the separate kernels and the fused epilogue so the two
// cannot drift apart.

// Verify positions 1..k start as placeholders so a draft that writes its proposals
// straight into vtok leaves exactly the positions past its break poisoned.
__device__ __forceinline__ void gb_seed_values(int b, int k, int reset_ring, int pend_val, int pos_val, int* vtok,
                                               int* pos_start, int* brk, int* ring, int ring_stride) {
    int* v = vtok + (long long)b * (k + 1);
    v[0] = pend_val;
    for (int i = 1; i <= k; ++i) v[i] = GB_PLACEHOLDER_TOKEN;
    pos_start[b] = pos_val;
    brk[2 * b] = k;
    brk[2 * b + 1] = 0;
    if (reset_ring) ring[(long long)b * ring_stride] = 0;
}

__device__ __forceinline__ void gb_seed_one(int b, int k, int reset_ring, const int* pend, const int* pos_ctr,
                                            int* vtok, int* pos_start, int* brk, int* ring, int ring_stride) {
    gb_seed_values(b, k, reset_ring, pend[b], pos_ctr[b], vtok, pos_start, brk, ring, ring_stride);
}

__device__ __forceinline__ void gb_accept_one(int b, int k, const int* vtok, const int* tgt_pred, const int* brk,
                                              int* n_acc, int* last_pred) {
    const int* v = vtok + (long long)b * (k + 1);
    const int* t = tgt_pred + (long long)b * (k + 1);
    int n_valid = min(max(brk[2 * b], 0), k);
    int n = 0;
    while (n < n_valid && v[n + 1] == t[n]) ++n;
    n_acc[b] = n;
    last_pred[b] = t[n];
}

// Returns the number of tokens committed.
__device__ __forceinline__ int gb_commit_one(int b, int k, int ring_cap, const int* vtok, const int* n_acc,
                                             const int* last_pred, const int* eos, int* budget, int* ring,
                                             int ring_stride, int* pend, int* acc, int* n_commit) {
    const int* v = vtok + (long long)b * (k + 1);
    int* r = ring + (long long)b * ring_stride;
    int n = min(max(n_acc[b], 0), k);
    int cnt = min(max(r[0], 0), ring_cap);
    int left = budget[b];
    int stop_tok = eos[b];
    int c = 0;
    for (int i = 0; i <= n; ++i) {
        if (left <= 0 || cnt + c >= ring_cap) break;
        int tok = v[i];
        r[1 + cnt + c] = tok;
        ++c;
        if (left != GB_UNBOUNDED_BUDGET) --left;
        if (tok == stop_tok) left = 0;
    }
    r[0] = cnt + c;
    budget[b] = left;
    n_commit[b] = c;
    if (c > 0) {
        acc[2 * b] += c - 1;
        acc[2 * b + 1] += 1;
    }
    if (c == n + 1) pend[b] = last_pred[b];
    return c;
}

// Threads: one per sequence.
// Starts a round: verify position 0 <- pending token, 1..k <- PLACEHOLDER, rollback
// anchor <- position counter, break marker <- "no break" ([k, 0]); the first round of a
// burst also empties the ring.
extern "C" __global__ void spec_seed_gather(int batch, int k, int reset_ring,
                                            const int* __restrict__ pend,     // [B]
                                            const int* __restrict__ pos_ctr,  // [B]
                                            int* __restrict__ vtok,           // [B, K1]
                                            int* __restrict__ pos_start,      // [B]
                                            int* __restrict__ brk,            // [B, 2]
                                            int* __restrict__ ring,           // [B, R]
                                            int ring_stride) {
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= batch) return;
    gb_seed_one(b, k, reset_ring, pend, pos_ctr, vtok, pos_start, brk, ring, ring_stride);
}

// Threads: one per verify position (b, j), j in [0, k].
// vtok[b, 0] = pend[b]; vtok[b, 1 + i] = draft_tok[b, i] for i < n_valid, else PLACEHOLDER,
// with n_valid = clamp(brk[b, 0], 0, k).
extern "C" __global__ void spec_assemble_verify(int batch, int k,
                                                const int* __restrict__ pend,       // [B]
                                                const int* __restrict__ draft_tok,  // [B, k]
                                                const int* __restrict__ brk,        // [B, 2]
                                                int* __restrict__ vtok) {           // [B, K1]
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)batch * (k + 1)) return;
    int b = (int)(idx / (k + 1));
    int j = (int)(idx % (k + 1));
    if (j == 0) {
        vtok[idx] = pend[b];
        return;
    }
    int n_valid = min(max(brk[2 * b], 0), k);
    vtok[idx] = (j - 1 < n_valid) ? draft_tok[(long long)b * k + j - 1] : GB_PLACEHOLDER_TOKEN;
}

// Threads: one per sequence, each walking at most k drafts.
// The _dc suffix ("device count") is kept from the engine these kernels were extracted
// from: the accepted count n stays on the device (n_acc, last_pred) for the next kernel
// and is never read back by the host, unlike that engine's host-side accept.
// n = longest prefix with vtok[b, 1 + i] == tgt_pred[b, i], i < clamp(brk[b, 0], 0, k);
// bonus = tgt_pred[b, n].
extern "C" __global__ void spec_accept_greedy_dc(int batch, int k,
                                                 const int* __restrict__ vtok,      // [B, K1]
                                                 const int* __restrict__ tgt_pred,  // [B, K1]
                                                 const int* __restrict__ brk,       // [B, 2]
                                                 int* __restrict__ n_acc,           // [B]
                                                 int* __restrict__ last_pred) {     // [B]
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= batch) return;
    gb_accept_one(b, k, vtok, tgt_pred, brk, n_acc, last_pred);
}

// Threads: one per sequence, each appending at most k + 1 tokens.
// Appends vtok[b, 0..n] to the ring, stopping after an EOS token or when the budget runs
// out; folds the bonus into pend only when the whole run was committed.
extern "C" __global__ void spec_ring_commit(int batch, int k, int ring_cap,
                                            const int* __restrict__ vtok,       // [B, K1]
                                            const int* __restrict__ n_acc,      // [B]
                                            const int* __restrict__ last_pred,  // [B]
                                            const int* __restrict__ eos,        // [B]
                                            int* __restrict__ budget,           // [B]
                                            int* __restrict__ ring,             // [B, R]
                                            int ring_stride,
                                            int* __restrict__ pend,             // [B]
                                            int* __restrict__ acc,              // [B, 2]
                                            int* __restrict__ n_commit) {       // [B]
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= batch) return;
    gb_commit_one(b, k, ring_cap, vtok, n_acc, last_pred, eos, budget, ring, ring_stride, pend, acc, n_commit);
}

// Threads: one per (table entry, sequence); blockIdx.y walks the pointer table.
// Every non-null entry's length[b] <- pos_start[b] + n_commit[b].
extern "C" __global__ void spec_rollback_stream(int batch, int n_entries,
                                                const u64* __restrict__ len_tbl,    // [E]
                                                const int* __restrict__ pos_start,  // [B]
                                                const int* __restrict__ n_commit) { // [B]
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    int e = blockIdx.y;
    if (b >= batch || e >= n_entries) return;
    u64 p = len_tbl[e];
    if (p == 0) return;
    reinterpret_cast<int*>(p)[b] = pos_start[b] + n_commit[b];
}

// Warp-parallel accept + commit of one sequence (k + 1 <= 32): lane j holds verify position j,
// so the whole round costs one level of loads instead of a serial walk. Must equal
// gb_accept_one followed by gb_commit_one exactly; returns the tokens committed.
__device__ __forceinline__ int gb_accept_commit_warp(int b, int k, int ring_cap, const int* vtok,
                                                     const int* tgt_pred, const int* brk, const int* eos,
                                                     int* budget, int* ring, int ring_stride, int* pend, int* acc,
                                                     int* n_acc, int* last_pred, int* n_commit, int* new_pend) {
    const unsigned full = 0xffffffffu;
    int j = threadIdx.x;  // lane: called by warp 0 only
    const int* v = vtok + (long long)b * (k + 1);
    const int* t = tgt_pred + (long long)b * (k + 1);
    int* r = ring + (long long)b * ring_stride;
    int n_valid = min(max(brk[2 * b], 0), k);
    int v_j = j <= k ? v[j] : 0;
    int t_j = j <= k ? t[j] : 0;
    int v_next = j < k ? v[j + 1] : 0;
    int cnt = min(max(r[0], 0), ring_cap);
    int left = budget[b];
    int stop_tok = eos[b];
    int old_pend = pend[b];
    // n = first j that is past the break or disagrees; n_valid <= k < 32 guarantees a bit.
    int n = __ffs(__ballot_sync(full, j >= n_valid || v_next != t_j)) - 1;
    int bonus = __shfl_sync(full, t_j, n);
    int lim = n + 1;
    if (left <= 0) lim = 0;
    else if (left != GB_UNBOUNDED_BUDGET) lim = min(lim, left);
    lim = min(lim, ring_cap - cnt);
    unsigned stops = __ballot_sync(full, j < lim && v_j == stop_tok);
    int c = stops ? __ffs(stops) : lim;
    if (j < c) r[1 + cnt + j] = v_j;
    if (j == 0) {
        n_acc[b] = n;
        last_pred[b] = bonus;
        r[0] = cnt + c;
        budget[b] = stops ? 0 : (left != GB_UNBOUNDED_BUDGET ? left - c : left);
        n_commit[b] = c;
        if (c > 0) {
            acc[2 * b] += c - 1;
            acc[2 * b + 1] += 1;
        }
        if (c == n + 1) pend[b] = bonus;
    }
    *new_pend = c == n + 1 ? bonus : old_pend;
    return c;
}

// Threads: one block per sequence; warp 0 accepts and commits (lane per verify position, or
// thread 0 serially when k + 1 > 32), every thread then walks a stride of the pointer
// table for the rollback, and thread 0 seeds the next round.
// Exactly accept -> commit -> rollback -> seed(reset_ring = 0), in one graph node.
extern "C" __global__ void spec_epilogue(int k, int ring_cap,
                                         const int* __restrict__ tgt_pred,  // [B, K1]
                                         const int* __restrict__ eos,       // [B]
                                         int* __restrict__ vtok,            // [B, K1]
                                         int* __restrict__ brk,             // [B, 2]
                                         int* __restrict__ n_acc,           // [B]
                                         int* __restrict__ last_pred,       // [B]
                                         int* __restrict__ budget,          // [B]
                                         int* __restrict__ ring,            // [B, R]
                                         int ring_stride,
                                         int* __restrict__ pend,            // [B]
                                         int* __restrict__ acc,             // [B, 2]
                                         int* __restrict__ n_commit,        // [B]
                                         int* __restrict__ pos_start,       // [B]
                                         int* pos_ctr,                      // [B], may be in the table
                                         const u64* __restrict__ len_tbl,   // [E]
                                         int n_entries) {
    __shared__ int s_commit, s_pend, s_pos_in_table;
    int b = blockIdx.x;
    // Everything that does not depend on the accept is loaded up front, so the whole
    // epilogue costs about one round trip to L2.
    int anchor = pos_start[b];
    int old_pos = pos_ctr[b];
    int e0 = threadIdx.x;
    u64 p0 = e0 < n_entries ? len_tbl[e0] : 0;
    if (threadIdx.x == 0) s_pos_in_table = 0;
    if (k + 1 <= 32) {
        if (threadIdx.x < 32) {
            int new_pend;
            int c = gb_accept_commit_warp(b, k, ring_cap, vtok, tgt_pred, brk, eos, budget, ring, ring_stride,
                                          pend, acc, n_acc, last_pred, n_commit, &new_pend);
            if (threadIdx.x == 0) {
                s_commit = c;
                s_pend = new_pend;
            }
        }
    } else if (threadIdx.x == 0) {
        gb_accept_one(b, k, vtok, tgt_pred, brk, n_acc, last_pred);
        s_commit = gb_commit_one(b, k, ring_cap, vtok, n_acc, last_pred, eos, budget, ring, ring_stride, pend,
                                 acc, n_commit);
        s_pend = pend[b];
    }
    __syncthreads();
    int target = anchor + s_commit;
    for (int e = threadIdx.x; e < n_entries; e += blockDim.x) {
        u64 p = e == e0 ? p0 : len_tbl[e];
        if (p == 0) continue;
        reinterpret_cast<int*>(p)[b] = target;
        if (p == reinterpret_cast<u64>(pos_ctr)) atomicOr(&s_pos_in_table, 1);
    }
    __syncthreads();
    // The next round's anchor is the position counter after the rollback: the rollback
    // target when the table holds the counter, else its unchanged value.
    if (threadIdx.x == 0)
        gb_seed_values(b, k, 0, s_pend, s_pos_in_table ? target : old_pos, vtok, pos_start, brk, ring, ring_stride);
}

// Threads: one per admitted slot.
// Admission (graphburst/engine/admission/slots.py): ``table`` is [3 + n_cols, n] int32, rows (slot, budget,
// stop token, then one row per model option column); each named slot gets its budget and stop
// token, zeroed accept counters and its option values, written to ``((int*)cols[c])[slot]``.
// One launch replaces three scatters plus the models' option uploads: admission runs on the
// host between bursts, so its launch count is the serving loop's cost per refill.
// Out-of-range slots are skipped.
extern "C" __global__ void spec_admit_slots(int n, int batch, const int* __restrict__ table, int* budget, int* eos,
                                            int* acc, int n_cols, const u64* __restrict__ cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int b = table[i];
    if (b < 0 || b >= batch) return;
    budget[b] = table[n + i];
    eos[b] = table[2 * n + i];
    acc[2 * b] = 0;
    acc[2 * b + 1] = 0;
    for (int c = 0; c < n_cols; ++c) reinterpret_cast<int*>(cols[c])[b] = table[(3 + c) * n + i];
}

// The per-slot draft cap, after a round's draft chain: a slot whose request asked for fewer
// drafts than the chain proposed (cap_b = clamp(k_cap[b], 0, k)), or every slot while more
// than max_batch slots are active (budget > 0; speculation off), gets brk[b] = [cap_b, 1]
// when brk[b, 0] > cap_b, as if its chain broke there. Every accept reads n_valid =
// clamp(brk[b, 0], 0, k), so the round commits at most cap_b + 1 tokens, greedy or sampled.
// Threads: one block of GB_CAP_THREADS striding over the B slots (the active count is the
// whole batch's, so one block sees it all).
extern "C" __global__ void spec_cap_drafts(int batch, int k, int max_batch, const int* __restrict__ budget,  // [B]
                                           const int* __restrict__ k_cap,  // [B]
                                           int* __restrict__ brk) {        // [B, 2]
    __shared__ int s_active;
    if (threadIdx.x == 0) s_active = 0;
    __syncthreads();
    int mine = 0;
    for (int b = threadIdx.x; b < batch; b += blockDim.x) mine += budget[b] > 0;
    if (mine) atomicAdd(&s_active, mine);
    __syncthreads();
    bool off = s_active > max_batch;
    for (int b = threadIdx.x; b < batch; b += blockDim.x) {
        int cap = off ? 0 : min(max(k_cap[b], 0), k);
        if (brk[2 * b] > cap) {
            brk[2 * b] = cap;
            brk[2 * b + 1] = 1;
        }
    }
}

// Benchmark support: the floor graph is a chain of these.
// Threads: one block of one thread that does nothing.
extern "C" __global__ void gb_empty_node() {}

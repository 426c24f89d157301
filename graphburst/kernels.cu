// graphburst device kernels.
//
// Conventions (the numpy twin in reference.py is the executable specification):
//   * Tokens, positions, lengths and counters are int32. Tokens are int32 rather than
//     uint32 so that PLACEHOLDER_TOKEN = -1 can poison unused slots, and so that every
//     buffer interoperates with torch/numpy int32 without casts.
//   * B = batch, K1 = k + 1 verify slots per sequence, R = ring stride = M*(k+1) + 1.
//   * Pointer tables are uint64 arrays of device addresses; 0 marks an absent layer.
//   * Every kernel is stream-ordered and allocation-free, so it is safe inside a graph.
//
// Compiled by NVRTC through cupy.RawModule at run time and by nvcc in CI (-Werror).

typedef unsigned int u32;
typedef unsigned long long u64;

#define GB_PLACEHOLDER_TOKEN (-1)
#define GB_UNBOUNDED_BUDGET 0x7fffffff
#define GB_NO_PREFILL (-1)
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

// =====================================================================================
// Generic kernels (model-agnostic burst bookkeeping)
// =====================================================================================

// Per-sequence bodies, shared by the separate kernels and the fused epilogue so the two
// cannot drift apart.

// Verify slots 1..k start as placeholders so a draft that writes its proposals straight
// into vtok leaves exactly the slots past its break poisoned.
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
// Starts a round: verify slot 0 <- pending token, slots 1..k <- PLACEHOLDER, rollback
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

// Threads: one per verify slot (b, j), j in [0, k].
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

// Warp-parallel accept + commit of one sequence (k + 1 <= 32): lane j holds verify slot j,
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

// Threads: one block per sequence; warp 0 accepts and commits (lane per verify slot, or
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

// Benchmark support: the floor graph is a chain of these.
// Threads: one block of one thread that does nothing.
extern "C" __global__ void gb_empty_node() {}

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
// the prompt. Writes entries [0, P), sets every length to P; optionally sets the
// position counter and seeds the pending token with the target's greedy prediction.
extern "C" __global__ void stub_prefill(const int* __restrict__ prompt,      // [B, P_max]
                                        const int* __restrict__ prompt_len,  // [B]
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
    plen = min(max(plen, 0), min(p_max, capacity));
    if (threadIdx.x == 0) {
        s_min = GB_ALL_ONES;
        s_max = 0u;
    }
    __syncthreads();
    const int* row = prompt + (long long)b * p_max;
    for (int l = threadIdx.x; l < n_layers; l += blockDim.x) {
        if (kv_tbl[l] == 0) continue;
        int* kv = reinterpret_cast<int*>(kv_tbl[l]) + (long long)b * capacity;
        u32 c = GB_DIGEST_INIT;
        for (int i = 0; i < plen; ++i) {
            c = gb_digest_step(c, row[i], i);
            kv[i] = (int)c;
        }
        reinterpret_cast<int*>(len_tbl[l])[b] = plen;
        atomicMin(&s_min, c);
        atomicMax(&s_max, c);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (pos_ctr) pos_ctr[b] = plen;
        if (pend) pend[b] = gb_target_token(gb_combine(s_min, s_max), vocab);
    }
}

// Threads: one block per sequence; threads stride over the draft's layers, each appending
// one entry (two on the last unbroken step, so the draft KV covers every draft).
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
                                           int* __restrict__ brk) {          // [B, 2]
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
        s_extend = !breaks && step == k - 1;
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

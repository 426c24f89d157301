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
// Compiled by NVRTC through cupy.RawModule at run time (CuPy always adds -ftz=true: float
// subnormals flush to zero, which the sampling twin models) and by nvcc in CI (-Werror,
// a syntax check only).

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
#define GB_RACE_SLOTS 2  // race partials per scratch row: [0] draft / residual, [1] bonus p

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
static_assert(GB_SEL_CAP == GB_SEL_BINS, "a thread owns GB_SEL_PER_THREAD bins and list slots");
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
                    u32 slot = first + (u32)__popc(bal & ((1u << lane) - 1u));
                    if (in && slot < (u32)GB_SEL_CAP) {  // always: the pick gathers only what fits
                        sm.u.list.key[slot] = key;
                        sm.u.list.w[slot] = mass ? gb_sel_mass(x[v][c], l_max, temp) : 0ull;
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
    u64* __restrict__ sel_thr, u64* __restrict__ sel_part, u32* __restrict__ sel_tick, u32* __restrict__ sel_hist);

// Threads: GB_SEL_THREADS per (chunk, sequence b) on blockIdx.x = b * n_chunks + chunk
// (chunks of ceil(V / n_chunks) tokens rounded up to whole float4s, n_chunks <= n_tiles),
// row r on y (r = step, or every row when step < 0). sel_thr[b, r] <- the smallest order
// key kept by top-k (0 or >= V = off) then top-p (>= 1 or NaN = off); 0 (keep all) for a
// row without filters or at temperature <= 0, without reading the row.
extern "C" __global__ void spec_probs_select(int n_rows, int vocab, int step, int s_rows, int n_chunks,
                                             const float* __restrict__ logits,       // [B, T, V]
                                             const float* __restrict__ temperature,  // [B]
                                             const int* __restrict__ top_k,          // [B]
                                             const float* __restrict__ top_p,        // [B]
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
    bool k_on = kk > 0 && kk < vocab, p_on = tp < 1.0f;
    if (!(temp > 0.0f) || !(k_on || p_on)) {  // uniform per row: no barrier is skipped by part of it
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
    GbSelState s;
    s.prefix = 0ull;
    s.rem = k_on ? (u64)kk : 0ull;
    s.floor_key = 0ull;
    s.above = 0ull;
    s.result = 0ull;
    s.op = GB_SEL_HIST;
    s.phase = k_on ? 0u : 1u;
    s.H = L;
    if (t == 0) sm.st = s;
    if (k_on) {  // the first top-k pass is done: take the row's histogram (and re-zero it)
        for (int d = t; d < GB_SEL_BINS; d += GB_SEL_THREADS) {
            sm.u.hist.c[d] = __ldcg(hist + d);
            sm.u.hist.w[d] = 0ull;
            hist[d] = 0u;
        }
        __syncthreads();
        gb_sel_pick(s, L, p_on, tp, max_key, sm);
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
            long long rc = ((long long)b * s_rows + r) * GB_RACE_SLOTS * nt + tile;
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
                const u64* rk = race_key + srow * GB_RACE_SLOTS * nt;
                const float* rw = race_w + srow * GB_RACE_SLOTS * nt;
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
        long long rc = ((long long)b * s_rows + r) * GB_RACE_SLOTS * nt + tile;
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
    long long rc = ((long long)b * s_rows + r) * GB_RACE_SLOTS * nt;
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
// slot 0 over the residual max(0, p_n - q_n) (only when n < n_valid), slot 1 over p_n;
// winners into race_key[b, 0, slot, t] (0: none), their weights into race_w.
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
        long long rc = (long long)b * s_rows * GB_RACE_SLOTS * nt + tile;
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
    long long rc = (long long)b * s_rows * GB_RACE_SLOTS * nt;
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

// graphburst device kernels: per-request logits processing (the "fields"), in vLLM's order.
// A section of graphburst/kernels.cu (one translation unit); include it through that file.
// The numpy twin is kernels/fields_ref.py, the executable specification (bit for bit).
#pragma once

// Per slot b, on the raw logits of row r (the token at position pos[b] + r + 1): min_tokens
// (the stop token -> -inf while fewer than min_tokens[b] were generated before it), logit_bias
// (added), repetition_penalty (prompt or generated tokens: l > 0 -> l / rep, else l * rep),
// frequency_penalty (l -= freq * count) and presence_penalty (l -= pres where count > 0),
// with count = counts[b, i] (generated tokens up to vtok[b, 0], the pending one) plus the
// drafts vtok[b, 1..r]. Every float op is one rounded op (no contraction), flushed to zero
// under CuPy's -ftz=true as the twin models.

#define GB_FIELDS_THREADS 256
#define GB_FIELDS_SPAN 1024  // vocabulary elements per block
#define GB_FIELDS_MAX_K1 65  // MAX_K + 1 verify columns

__device__ __forceinline__ bool gb_fields_active(int b, const int* eos, const int* min_tokens, const float* presence,
                                                 const float* frequency, const float* repetition, const int* n_bias) {
    return n_bias[b] > 0 || presence[b] != 0.0f || frequency[b] != 0.0f || repetition[b] != 1.0f ||
           (min_tokens[b] > 0 && eos[b] >= 0);
}

// Threads: GB_FIELDS_THREADS per (span of GB_FIELDS_SPAN tokens, slot b, row r): blockIdx.x =
// b * n_spans + span, y = row (r = step, or y when step < 0). Returns at once for a slot no
// field changes.
extern "C" __global__ void spec_apply_fields(int n_rows, int vocab, int k1, int step,
                                             float* __restrict__ logits,            // [B, T, V] in place
                                             const int* __restrict__ vtok,          // [B, K1]
                                             const int* __restrict__ pos,           // [B]
                                             const int* __restrict__ counts,        // [B, V]
                                             const unsigned char* __restrict__ prompt_seen,  // [B, V]
                                             const int* __restrict__ prompt_len,    // [B]
                                             const int* __restrict__ eos,           // [B]
                                             const int* __restrict__ min_tokens,    // [B]
                                             const float* __restrict__ presence,    // [B]
                                             const float* __restrict__ frequency,   // [B]
                                             const float* __restrict__ repetition,  // [B]
                                             const int* __restrict__ bias_ids,      // [B, NB]
                                             const float* __restrict__ bias_val,    // [B, NB]
                                             const int* __restrict__ n_bias,        // [B]
                                             int nb_cap) {
    __shared__ float s_bias[GB_FIELDS_SPAN];
    __shared__ int s_draft[GB_FIELDS_MAX_K1];
    int n_spans = (vocab + GB_FIELDS_SPAN - 1) / GB_FIELDS_SPAN;
    int b = blockIdx.x / n_spans, span = blockIdx.x % n_spans;
    int r = step >= 0 ? step : (int)blockIdx.y, t = threadIdx.x;
    if (!gb_fields_active(b, eos, min_tokens, presence, frequency, repetition, n_bias)) return;  // uniform
    int base = span * GB_FIELDS_SPAN, end = min(vocab, base + GB_FIELDS_SPAN);
    int nb = min(n_bias[b], nb_cap);
    for (int i = t; i < GB_FIELDS_SPAN; i += GB_FIELDS_THREADS) s_bias[i] = 0.0f;
    int n_draft = min(r, k1 - 1);
    for (int i = t; i < n_draft; i += GB_FIELDS_THREADS) s_draft[i] = vtok[(long long)b * k1 + 1 + i];
    __syncthreads();
    for (int e = t; e < nb; e += GB_FIELDS_THREADS) {  // distinct ids: no two threads write one cell
        int id = bias_ids[(long long)b * nb_cap + e];
        if (id >= base && id < end) s_bias[id - base] = bias_val[(long long)b * nb_cap + e];
    }
    __syncthreads();
    long long made = (long long)pos[b] + r + 1 - prompt_len[b];
    int stop = eos[b], need = min_tokens[b];
    bool mask_stop = stop >= 0 && made < (long long)need;
    float rep = repetition[b], fr = frequency[b], pr = presence[b];
    float* row = logits + ((long long)b * n_rows + r) * vocab;
    const int* cnt = counts + (long long)b * vocab;
    const unsigned char* seen = prompt_seen + (long long)b * vocab;
    for (int i = base + t; i < end; i += GB_FIELDS_THREADS) {
        float x = row[i];
        int c = cnt[i];
        for (int d = 0; d < n_draft; ++d) c += s_draft[d] == i;
        if (mask_stop && i == stop) x = __int_as_float(0xff800000);  // -inf
        if (nb > 0) x = __fadd_rn(x, s_bias[i - base]);
        if (rep != 1.0f && (seen[i] != 0 || c > 0)) x = x > 0.0f ? __fdiv_rn(x, rep) : __fmul_rn(x, rep);
        if (fr != 0.0f) x = __fsub_rn(x, __fmul_rn(fr, (float)c));
        if (pr != 0.0f && c > 0) x = __fsub_rn(x, pr);
        row[i] = x;
    }
}

// Threads: one per slot b (blocks of GB_FIELDS_THREADS), after ring_commit: counts[b] += the
// committed drafts vtok[b, 1 .. n_commit - 1] and, when the whole run was committed and the
// slot is live (budget > 0), the new pending token pend[b].
extern "C" __global__ void spec_fields_commit(int batch, int k1, int vocab,
                                              const int* __restrict__ vtok,      // [B, K1]
                                              const int* __restrict__ n_acc,     // [B]
                                              const int* __restrict__ n_commit,  // [B]
                                              const int* __restrict__ budget,    // [B]
                                              const int* __restrict__ pend,      // [B]
                                              int* __restrict__ counts) {        // [B, V]
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= batch) return;
    int c = n_commit[b];
    int* row = counts + (long long)b * vocab;
    for (int i = 1; i < min(c, k1); ++i) {
        int tok = vtok[(long long)b * k1 + i];
        if (tok >= 0 && tok < vocab) row[tok] += 1;
    }
    int n = min(max(n_acc[b], 0), k1 - 1), tok = pend[b];
    if (c == n + 1 && budget[b] > 0 && tok >= 0 && tok < vocab) row[tok] += 1;
}

// Threads: GB_FIELDS_THREADS per (span, slot b) on x = b * n_spans + span: zero counts[b] and
// prompt_seen[b] of a slot whose staged chunk starts a prompt (lengths[b] != NO_PREFILL, starts[b] == 0).
extern "C" __global__ void spec_fields_reset(int vocab, const int* __restrict__ lengths,  // [B]
                                             const int* __restrict__ starts,             // [B]
                                             int* __restrict__ counts,                   // [B, V]
                                             unsigned char* __restrict__ prompt_seen) {  // [B, V]
    int n_spans = (vocab + GB_FIELDS_SPAN - 1) / GB_FIELDS_SPAN;
    int b = blockIdx.x / n_spans;
    if (lengths[b] == GB_NO_PREFILL || starts[b] != 0) return;
    int base = (blockIdx.x % n_spans) * GB_FIELDS_SPAN, end = min(vocab, base + GB_FIELDS_SPAN);
    for (int i = base + threadIdx.x; i < end; i += GB_FIELDS_THREADS) {
        counts[(long long)b * vocab + i] = 0;
        prompt_seen[(long long)b * vocab + i] = 0;
    }
}

// Threads: GB_FIELDS_THREADS per (span of chunk tokens, slot b) on x = b * n_parts + part:
// prompt_seen[b, tok] = 1 for the staged chunk's tokens (i < lengths[b]; ids outside [0, V) skipped).
extern "C" __global__ void spec_fields_prompt(int p_max, int vocab, const int* __restrict__ lengths,  // [B]
                                              const int* __restrict__ chunks,             // [B, P_max]
                                              unsigned char* __restrict__ prompt_seen) {  // [B, V]
    int n_parts = (p_max + GB_FIELDS_THREADS - 1) / GB_FIELDS_THREADS;
    int b = blockIdx.x / n_parts, n = lengths[b];
    if (n == GB_NO_PREFILL) return;
    int i = (blockIdx.x % n_parts) * GB_FIELDS_THREADS + threadIdx.x;
    if (i >= min(n, p_max)) return;
    int tok = chunks[(long long)b * p_max + i];
    if (tok >= 0 && tok < vocab) prompt_seen[(long long)b * vocab + tok] = 1;
}

// Threads: one per slot b: counts[b, pend[b]] += 1 for a prefilled slot (its first token).
extern "C" __global__ void spec_fields_first(int batch, int vocab, const int* __restrict__ lengths,  // [B]
                                             const int* __restrict__ pend,               // [B]
                                             int* __restrict__ counts) {                 // [B, V]
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= batch) return;
    int tok = pend[b];
    if (lengths[b] != GB_NO_PREFILL && tok >= 0 && tok < vocab) counts[(long long)b * vocab + tok] += 1;
}

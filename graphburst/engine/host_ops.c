/* The host's per-burst bookkeeping of a drained burst, in C (graphburst/engine/host_ops.py loads it).
 *
 * Between two bursts of ~0.1 ms (zero-cost stubs, M=8) the serving loop's host reads the
 * drained burst into its mirrors and hands 64 slots their tokens. In numpy that is ~25 calls
 * over B-element arrays, each about a microsecond of fixed overhead on an H200 host:
 * longer than the burst. These two functions do the same work in one call each. Their numpy
 * twins are the reference (tests/test_host_ops.py holds them equal) and the path taken without
 * a C compiler: gb_drain is BurstTokens + SpecDecoder.finish_burst (burst_tokens.py, burst.py),
 * gb_append is SlotTokens.append + Delivery.deliver's masks (serving/slot_tokens.py,
 * serving/delivery.py).
 *
 * Every array is C-contiguous and owned by the Python object that set up the struct; int32 is
 * the device's element type, int64 the host mirrors'.
 */

#include <stdint.h>
#include <string.h>

/* A decoder's host mirror (burst.py). */
typedef struct {
    int64_t batch;      /* B */
    int64_t row;        /* R1 = 1 + R: a ring row, the count then R tokens */
    const int64_t *slot_gen;  /* [B] current slot generations */
    int64_t *inflight;  /* [B] bursts in flight per slot's sequence */
    int64_t *host_pos;  /* [B] */
    int64_t *host_left; /* [B] */
} gb_mirror;

/* One drained burst. pinned: the graph's output block [B*R1 ring | 2B acc | B pos | B budget];
 * out: a fresh block [B*R1 ring | B counts | 2B acc] the caller hands on. counts[b] is the ring's
 * count clamped to [0, R]. launch_gen: [B] generations at the burst's launch, or NULL when none
 * moved since; a slot whose generation moved has its row dropped (count 0), the others one burst
 * fewer in flight and the device's position and budget. Returns the slots the burst committed for. */
int64_t gb_drain(const gb_mirror *m, const int32_t *pinned, int32_t *out, const int64_t *launch_gen) {
    const int64_t b_n = m->batch, r1 = m->row, ring_n = b_n * r1;
    const int32_t *acc = pinned + ring_n, *pos = acc + 2 * b_n, *budget = pos + b_n;
    int32_t *counts = out + ring_n;
    int64_t current = 0;
    memcpy(out, pinned, (size_t)ring_n * sizeof(int32_t));
    memcpy(counts + b_n, acc, (size_t)(2 * b_n) * sizeof(int32_t));
    for (int64_t b = 0; b < b_n; b++) {
        int32_t c = out[b * r1];
        c = c < 0 ? 0 : (c > r1 - 1 ? (int32_t)(r1 - 1) : c);
        if (launch_gen != NULL && launch_gen[b] != m->slot_gen[b]) {  /* the slot's previous sequence */
            counts[b] = 0;
            out[b * r1] = 0;
            continue;
        }
        counts[b] = c;
        m->inflight[b] -= 1;
        m->host_pos[b] = pos[b];
        m->host_left[b] = budget[b];
        current++;
    }
    return current;
}

/* A serving loop's token rows (serving/slot_tokens.py) and the masks its delivery reads. */
typedef struct {
    int64_t batch, row;       /* B, R1 */
    int64_t max_tokens;       /* T: a row holds T + R tokens, T + 1 deliveries */
    int32_t *tokens;          /* [B, T + R] */
    double *when;             /* [B, T + 1] */
    int32_t *count;           /* [B, T + 1] */
    int64_t *counters;        /* [4, B]: tokens, deliveries, accepted drafts, rounds */
    const uint8_t *running;   /* [B] bool: the slot's request takes tokens */
    const int64_t *left;      /* [B] the decoder's host_left */
    uint8_t *receiving;       /* [B] bool out: running and count > 0 */
    uint8_t *finished;        /* [B] bool out: running and no budget left */
    int64_t n_finished;       /* out */
    int64_t total;            /* out: tokens the burst committed over every slot */
} gb_store;

/* Append a block gb_drain wrote to every running slot with tokens: its whole ring row at the
 * slot's end (past the count it is overwritten by the next append), a delivery (now, count);
 * every slot's accept counters. Returns the slots receiving, or -1, having written nothing, when
 * a receiving slot's row is full, which the numpy twin refuses with an IndexError. */
int64_t gb_append(gb_store *s, const int32_t *block, double now) {
    const int64_t b_n = s->batch, r1 = s->row, t = s->max_tokens, width = r1 - 1;
    const int32_t *counts = block + b_n * r1, *acc = counts + b_n;
    int64_t *n = s->counters, *nd = n + b_n, *accepted = nd + b_n, *rounds = accepted + b_n;
    int64_t receiving = 0, finished = 0, total = 0;
    for (int64_t b = 0; b < b_n; b++) {
        if (s->running[b] && counts[b] > 0 && (n[b] > t || nd[b] > t)) return -1;
    }
    for (int64_t b = 0; b < b_n; b++) {
        s->receiving[b] = s->running[b] && counts[b] > 0;
        total += counts[b];
    }
    for (int64_t b = 0; b < b_n; b++) {
        accepted[b] = acc[2 * b];
        rounds[b] = acc[2 * b + 1];
        if (s->receiving[b]) {
            int32_t c = counts[b];
            memcpy(s->tokens + b * (t + width) + n[b], block + b * r1 + 1, (size_t)width * sizeof(int32_t));
            s->when[b * (t + 1) + nd[b]] = now;
            s->count[b * (t + 1) + nd[b]] = c;
            n[b] += c;
            nd[b] += 1;
            receiving++;
        }
        s->finished[b] = s->running[b] && s->left[b] == 0;
        finished += s->finished[b];
    }
    s->n_finished = finished;
    s->total = total;
    return receiving;
}

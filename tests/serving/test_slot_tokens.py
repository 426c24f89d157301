"""SlotTokens: per-slot rows filled one burst at a time, and the copy-out of finishing slots
(``take`` for one, ``take_rows`` for several at once), against per-slot lists built by hand."""

from __future__ import annotations

import numpy as np
import pytest

from graphburst.serving.slot_tokens import SlotTokens

B, T, R = 7, 20, 4  # slots, most tokens per request, most tokens per burst


def _filled():
    """A store after three bursts, and the per-slot (tokens, deliveries, acc) expected of it."""
    store = SlotTokens(B, T, R)
    rng = np.random.default_rng(3)
    want = {b: ([], [], (0, 0)) for b in range(B)}
    plans = [  # (time, counts): slot 5 never receives (zero tokens); every slot in the second
        (1.5, [2, 0, 4, 1, 3, 0, 1]),
        (2.5, [1, 3, 2, 4, 1, 0, 2]),
        (3.5, [4, 0, 0, 2, 0, 0, 3]),
    ]
    for when, counts in plans:
        ring = np.zeros((B, 1 + R), np.int32)  # [B, 1 + R] int32, column 0 the count
        ring[:, 0] = counts
        ring[:, 1:] = rng.integers(0, 1000, (B, R))
        counts = np.asarray(counts, np.int64)
        acc = rng.integers(0, 50, (B, 2))  # [B, 2] int64
        rows = np.flatnonzero(counts)
        store.append(ring, counts, rows, acc, when)
        for b in range(B):
            tokens, deliveries, _ = want[b]
            if counts[b]:
                tokens += ring[b, 1 : 1 + counts[b]].tolist()
                deliveries.append((when, int(counts[b])))
            want[b] = (tokens, deliveries, (int(acc[b, 0]), int(acc[b, 1])))
    return store, want


@pytest.mark.parametrize("slots", [[3], [0, 2, 6], [1, 5], list(range(B))])
def test_take_rows_copies_each_slots_tokens_deliveries_and_counters(slots):
    store, want = _filled()
    tokens, when, count, acc = store.take_rows(np.asarray(slots, np.int64))
    assert len(tokens) == len(when) == len(count) == len(acc) == len(slots)
    for i, b in enumerate(slots):
        w_tokens, w_deliveries, w_acc = want[b]
        assert tokens[i].dtype == np.int32 and tokens[i].tolist() == w_tokens
        assert when[i].dtype == np.float64 and count[i].dtype == np.int32
        assert list(zip(when[i].tolist(), count[i].tolist())) == w_deliveries
        assert tuple(acc[i]) == w_acc
        one = store.take(b)  # the one-slot form agrees
        assert [a.tolist() for a in one] == [tokens[i].tolist(), when[i].tolist(), count[i].tolist()]


def test_taken_rows_outlive_the_slots_reuse():
    store, want = _filled()
    slots = np.array([0, 2, 3], np.int64)
    tokens, when, count, acc = store.take_rows(slots)
    store.reset(slots)  # the slots are refilled by new requests: the copies must not change
    ring = np.full((B, 1 + R), 999, np.int32)
    ring[:, 0] = R
    store.append(ring, np.full(B, R, np.int64), np.arange(B), np.full((B, 2), 7), 9.5)
    for i, b in enumerate(slots.tolist()):
        assert tokens[i].tolist() == want[b][0]
        assert list(zip(when[i].tolist(), count[i].tolist())) == want[b][1]
        assert tuple(acc[i]) == want[b][2]
    assert store.read(0) == [999] * R and store.deliveries(0) == [(9.5, R)]  # the reset row holds only the new burst


def test_a_slot_with_no_token_takes_empty_rows():
    store, _ = _filled()
    tokens, when, count, acc = store.take_rows(np.array([5], np.int64))
    assert tokens[0].shape == (0,) and when[0].shape == (0,) and count[0].shape == (0,)
    assert store.take(5)[0].shape == (0,)

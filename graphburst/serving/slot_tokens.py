"""Per-slot token storage of the serving loop: one vectorised append per burst.

Handing a burst's tokens to 64 requests one Python object at a time costs hundreds of
microseconds, longer than the burst itself, and the GPU waits. Here every batch slot
owns a preallocated row; a drained burst is appended to all slots that receive tokens
with one fancy-index copy, and a request's Python list is only built when somebody
reads it (a streaming consumer, or the request finishing). Delivery times and counts
and the accept counters are kept the same way.
"""

from __future__ import annotations

import numpy as np

from ..engine import host_ops


class SlotTokens:
    """Tokens, deliveries and accept counters of the request in each batch slot.

    Parameters
    ----------
    batch : int
        Batch slots.
    max_tokens : int
        Most tokens one request can receive (the KV capacity bounds it).
    burst_tokens : int
        Most tokens one burst delivers to a slot (the ring capacity, M * (k + 1)).
    """

    def __init__(self, batch: int, max_tokens: int, burst_tokens: int):
        self.burst_tokens = int(burst_tokens)
        # A burst's whole ring row is written at the slot's end (garbage past its count
        # is overwritten by the next append), so a row has room for one extra burst.
        self.tokens = np.zeros((batch, max_tokens + burst_tokens), np.int32)  # [B, T + R] int32
        # The per-slot counters in one block, so a finishing request's are read in one gather:
        # valid tokens, deliveries, accepted drafts and rounds (as of the last burst).
        self._counters = np.zeros((4, batch), np.int64)  # [4, B] int64
        self.n, self.nd = self._counters[0], self._counters[1]  # [B] each, contiguous
        self.acc = self._counters[2:].T  # [B, 2] view: accepted drafts, rounds
        # Deliveries: each one carries >= 1 token, so a request has at most max_tokens.
        self.when = np.zeros((batch, max_tokens + 1), np.float64)  # [B, T + 1] perf_counter seconds
        self.count = np.zeros((batch, max_tokens + 1), np.int32)  # [B, T + 1] tokens per delivery
        # Row b's next burst lands at tokens[b, n[b] : n[b] + R]. A view of every such window
        # ([B, T + 1, R], overlapping, over ``tokens``, which is never reallocated) makes the
        # append one fancy assignment of whole ring rows at (b, n[b]): no per-token index
        # array, and a third of the cost of a flat scatter. The index is bounds-checked, so a
        # row can never spill into the next.
        step = self.tokens.strides[1]
        self._windows = np.lib.stride_tricks.as_strided(
            self.tokens, (batch, max_tokens + 1, burst_tokens), (self.tokens.strides[0], step, step), writeable=True)
        self._every = np.arange(batch)  # [B] every slot, for the steady state
        self._one = np.ones(batch, np.int64)  # [B] 1: an array operand costs less than a Python scalar
        # Flat views and row offsets, so a burst's deliveries are recorded with 1-D scatters.
        self._when_flat, self._count_flat = self.when.ravel(), self.count.ravel()
        self._del_base = np.arange(batch) * self.when.shape[1]  # [B]
        self._at = np.zeros(batch, np.int64)  # [B] scratch: flat offsets
        # Each row as a 1-D view, for the copy-out of finishing slots: slicing a 1-D view costs
        # a fifth less than a 2-D index.
        self._rows = tuple(zip(self.tokens, self.when, self.count))  # B x (tokens [T + R], when, count)

    def in_c(self, lib, *, running: np.ndarray, left: np.ndarray, receiving: np.ndarray,
             finished: np.ndarray) -> host_ops.Store:
        """:meth:`append` and a delivery's masks in one C call (``host_ops.c``'s ``gb_append``) over
        these rows: ``running``, ``receiving``, ``finished`` ``[B]`` bool (the loop's), ``left``
        ``[B]`` int64 (the decoder's ``host_left``). ``lib``: :func:`host_ops.library`'s."""
        max_tokens = self.when.shape[1] - 1
        return host_ops.Store(lib, row=self.burst_tokens + 1, max_tokens=max_tokens, tokens=self.tokens,
                              when=self.when, count=self.count, counters=self._counters, running=running,
                              left=left, receiving=receiving, finished=finished)

    def reset(self, slots) -> None:
        """Empty the rows of newly admitted slots."""
        self._counters[:, slots] = 0

    def append(self, ring: np.ndarray, counts: np.ndarray, rows: np.ndarray, acc, now: float) -> None:
        """Append one drained burst to ``rows``.

        Parameters
        ----------
        ring : [B, 1 + R] int32
            Host copy of the ring (column 0 is the count).
        counts : [B] int
            Tokens per slot in this burst.
        rows : [r] int
            Slots that receive their tokens (live and with counts > 0), ascending.
        acc : [B, 2] int
            Accept counters after this burst.
        now : float
        """
        np.copyto(self.acc, acc)
        if rows.size == 0:
            return
        width = ring.shape[1] - 1
        assert width <= self.burst_tokens, (width, self.burst_tokens)
        if rows.size == self.n.size:  # every slot receives (the steady state): no gathers by row
            self._windows[self._every, self.n, :width] = ring[:, 1:]
            slot_d = np.add(self._del_base, self.nd, out=self._at)
            self._when_flat[slot_d] = now
            self._count_flat[slot_d] = counts
            self.n += counts
            np.add(self.nd, self._one, out=self.nd)
            return
        at, d, c = self.n[rows], self.nd[rows], counts[rows]
        # Row b's whole ring row lands at tokens[b, n[b]:n[b] + R].
        self._windows[rows, at, :width] = ring[rows, 1:]
        slot_d = self._del_base[rows] + d  # [r] flat index of each row's next delivery
        self._when_flat[slot_d] = now
        self._count_flat[slot_d] = c
        self.n[rows] = at + c
        self.nd[rows] = d + 1

    # ------------------------------------------------------------------ reads (lazy)

    def read(self, slot: int, start: int = 0, stop: int | None = None) -> list:
        """Tokens ``[start, stop)`` of a slot as a Python list."""
        n = int(self.n[slot])
        stop = n if stop is None else min(stop, n)
        return self.tokens[slot, start:stop].tolist()

    def deliveries(self, slot: int) -> list:
        """``[(time, n_tokens), ...]`` of a slot, one per burst that delivered."""
        d = int(self.nd[slot])
        return list(zip(self.when[slot, :d].tolist(), self.count[slot, :d].tolist()))

    def take(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of a slot's ``(tokens [n] int32, delivery times [d] float64, counts [d] int32)``,
        for a request leaving it (no Python list is built)."""
        n, d = int(self.n[slot]), int(self.nd[slot])
        return self.tokens[slot, :n].copy(), self.when[slot, :d].copy(), self.count[slot, :d].copy()

    def take_rows(self, slots: np.ndarray) -> tuple[list, list, list, list]:
        """:meth:`take` of several slots at once, for requests finishing together.

        Parameters
        ----------
        slots : [r] int64
            Distinct slots.

        Returns
        -------
        tokens, when, count : lists of r arrays
            Copies of slot ``slots[i]``'s ``[n] int32`` tokens, ``[d] float64`` delivery times
            and ``[d] int32`` counts.
        acc : list of r ``(accepted, rounds)`` tuples of int
        """
        # One copy per slot and kind: a fancy gather of every slot at once costs ~1 µs a kind
        # however few slots finish (~4 a burst), a slice's copy 0.25 µs. The counters are read
        # in one gather (``take``: a third of the cost of ``[:, slots]``), not four scalars a slot.
        n, nd, accepted, rounds = self._counters.take(slots, 1).tolist()
        rows = self._rows
        taken_tokens, taken_when, taken_count = [], [], []
        for b, k, d in zip(slots.tolist(), n, nd):
            tokens, when, count = rows[b]
            taken_tokens.append(tokens[:k].copy())
            taken_when.append(when[:d].copy())
            taken_count.append(count[:d].copy())
        return taken_tokens, taken_when, taken_count, list(zip(accepted, rounds))

    def first_time(self, slot: int) -> float | None:
        return float(self.when[slot, 0]) if self.nd[slot] else None

    def last_time(self, slot: int) -> float | None:
        d = int(self.nd[slot])
        return float(self.when[slot, d - 1]) if d else None

"""First tokens handed out when the prefill has made them, not when the first burst is drained.

A final prefill leaves each admitted slot's first token in ``pend`` on the device; the
first burst commits it to the ring in its first round. Waiting for that burst to be
drained makes every request's time to first token one whole burst longer than its
prefill (tens of milliseconds with a real model). So each final prefill group also
enqueues a copy of ``pend`` into a pinned host buffer, with an event behind it, and the
serving loop hands those tokens out as soon as the copy has landed; when the slot's first
burst is drained, the ring row's leading token (the same one) is dropped.

Which copies the loop waits for is decided by stream order alone, never by polling an
event: a copy enqueued before burst ``i`` was launched is complete by the time burst ``i``
is, so the loop hands it out (waiting for the copy, not the burst) just before it would
wait on burst ``i``. Every rank of a lockstep loop would so take the same steps, but
lockstep loops keep first tokens with the first burst for now (``LoopPolicy.early_first_tokens``:
their wait for a copy is not bounded as their drains are).

:class:`FirstTokenCopies` keeps the copies; :class:`FirstTokens`, a part of
:class:`~graphburst.serving.loop.ServeLoop` given the slot table, the decoder, the pipeline and
the loop's record, makes them, hands them out and drops the ring's copy.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from ..constants import RING_COUNT_COLUMN
from .events import LoopRecord, Tokens
from .pipeline import BurstPipeline
from .slot_table import NO_COPY, SlotTable


@dataclasses.dataclass(slots=True)
class FirstTokenCopy:
    """One final prefill group's copy of ``pend``."""

    copy_id: int  # > NO_COPY, increasing
    before: int  # launch index of the first burst enqueued after the copy
    host: np.ndarray  # [B] int32 pinned: pend after the prefill
    event: object  # recorded after the copy (None on numpy: the copy is done)
    slots: np.ndarray  # [n] int64: the group's slots


class FirstTokenCopies:
    """The first-token copies not yet handed out, oldest first.

    Parameters
    ----------
    backend : Backend
        The decoder's.
    batch : int
        Batch slots (``pend`` is ``[batch]`` int32).
    """

    def __init__(self, backend, batch: int):
        self.backend, self.batch = backend, int(batch)
        self._pending: collections.deque = collections.deque()
        self._spare: list = []  # (host buffer, event) of copies handed out, reused
        self._next_id = NO_COPY + 1

    def __bool__(self) -> bool:
        return bool(self._pending)

    def __len__(self) -> int:
        return len(self._pending)

    def enqueue(self, pend, slots: np.ndarray, before: int, stream) -> int:
        """Copy ``pend`` ([B] int32, device) to the host behind the work on ``stream``; returns the copy id.

        ``before``: the launch index the next burst will have (it is ordered after the copy).
        """
        if self._spare:
            host, event = self._spare.pop()
        else:  # at most one copy per boundary is pending per burst in flight: a few buffers in all
            host = self.backend.host_buffer((self.batch,))
            event = None
            if self.backend.is_gpu:
                with self.backend.device():
                    event = self.backend.xp.cuda.Event(disable_timing=True)
        self.backend.copy_to_host(host, pend, stream)
        if event is not None:
            event.record(stream)
        copy = FirstTokenCopy(self._next_id, before, host, event, slots)
        self._next_id += 1
        self._pending.append(copy)
        return copy.copy_id

    def due(self, upto: int) -> bool:
        """Whether the oldest copy was enqueued before burst ``upto`` (so is complete no later than it)."""
        return bool(self._pending) and self._pending[0].before <= upto

    def take(self, upto: int) -> list:
        """The copies enqueued before burst ``upto``, oldest first, each waited for (its event, not a burst).

        Their host buffers stay valid until the next :meth:`enqueue`.
        """
        taken = []
        while self._pending and self._pending[0].before <= upto:
            copy = self._pending.popleft()
            if copy.event is not None:
                copy.event.synchronize()
            taken.append(copy)
            self._spare.append((copy.host, copy.event))
        return taken


class FirstTokens:
    """First-token hand-out of a serving loop.

    Parameters
    ----------
    table : SlotTable
        Its ``first_copy``, ``lead`` and ``n_lead`` are this part's to write; it reads ``running``.
    record : LoopRecord
        The log (``Tokens`` events) and ``tokens_out``.
    dec : SpecDecoder
        Its backend, ``pend`` buffer and stream (the copies).
    pipeline : BurstPipeline
        Its launch count: which burst a copy precedes.
    """

    def __init__(self, table: SlotTable, record: LoopRecord, dec, pipeline: BurstPipeline):
        self.table, self.record, self.dec, self.pipeline = table, record, dec, pipeline
        self.copies = FirstTokenCopies(dec.backend, dec.batch)
        # Asked at every step: the copies' own method, bound once, so the question costs one call
        self.due = self.copies.due

    def __len__(self) -> int:
        """Copies not yet handed out."""
        return len(self.copies)

    def copy(self, live: np.ndarray) -> None:
        """Copy the first tokens of ``live`` ([n] int64, slots just prefilled) out behind the prefill."""
        dec = self.dec
        self.table.first_copy[live] = self.copies.enqueue(dec.bufs.pend, live, self.pipeline.launched, dec.stream)

    def hand_out(self, upto: int) -> int:
        """Hand out the first tokens of the copies enqueued before burst ``upto`` (waiting for
        the copies, not the burst); returns the tokens handed out.

        A slot receives its copy's token only if it still runs the request the copy was made
        for (``first_copy``): one cancelled meanwhile gets nothing, and a request admitted
        into its slot since waits for its own copy.
        """
        delivered = 0
        table = self.table
        for copy in self.copies.take(upto):
            slots = copy.slots
            mine = table.first_copy[slots] == copy.copy_id  # [n] bool
            table.first_copy[slots[mine]] = NO_COPY
            rows = slots[mine & table.running[slots]]
            if rows.size:
                delivered += self._deliver_first(rows, copy.host)
        return delivered

    def _deliver_first(self, rows: np.ndarray, pend: np.ndarray) -> int:
        """Hand ``rows`` their first token from ``pend`` ([B] int32, host), as a one-token delivery."""
        now = time.perf_counter()
        table = self.table
        ring = np.zeros((table.batch, 2), np.int32)  # [B, 2] int32: count, token (the ring's layout)
        ring[rows, RING_COUNT_COLUMN] = 1
        ring[rows, 1] = pend[rows]
        counts = ring[:, RING_COUNT_COLUMN].copy()  # [B] int32
        store = table.store
        store.append(ring, counts, rows, store.acc, now)
        log = self.record.log
        if log is not None:
            # No round has run for them: zero counters, as admission set on the device (the store's
            # rows may still hold the slot's last request's, until this request's first burst drains).
            log.append(Tokens(now, table.slot_state[rows], rows, counts, ring, np.zeros((rows.size, 2), np.int64)))
        table.lead[rows] = True
        table.n_lead += rows.size
        self.record.tokens_out += rows.size
        return rows.size

    def drop_first(self, tokens) -> None:
        """Drop the leading token of the ring rows of slots whose first token was handed out
        already (:meth:`_deliver_first`): their first burst commits that token first."""
        table = self.table
        rows = np.logical_and(table.lead, tokens.counts).nonzero()[0]  # counts >= 0
        if not rows.size:
            return
        tokens.drop_first(rows)
        table.lead[rows] = False
        table.n_lead -= rows.size

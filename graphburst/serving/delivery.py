"""Handing a drained burst's tokens to the serving loop's requests, and finishing requests.

Vectorised over the batch: one copy appends every running slot's tokens to its row
(:class:`~graphburst.serving.slot_tokens.SlotTokens`), and Python visits only the requests that
finish. A graph's burst drained in C (``host_ops.c``, the decoder's ``host_mirror``) is handed
out in C too (``gb_append``); otherwise in numpy, the reference the C path is held to.

:class:`Delivery` is a part of :class:`~graphburst.serving.loop.ServeLoop`, given the slot table,
the loop's record, the decoder's ``host_left``, the intake (a finished request's id is freed)
and the first-token part (whose early tokens a first burst must not repeat). It also finishes a
request for any other reason (:meth:`Delivery.retire`: a cancel, a failure), so every request
leaves the loop through it.
"""

from __future__ import annotations

import time

import numpy as np

from ..engine import host_ops
from .events import LoopRecord, Retired, Tokens
from .first_tokens import FirstTokens
from .intake import RequestIntake
from .request import RequestState
from .slot_table import SlotTable


class Delivery:
    """Delivery of drained bursts (:meth:`deliver`) and the retirement of requests.

    Parameters
    ----------
    table : SlotTable
    record : LoopRecord
        The log (``Tokens`` and ``Retired`` events) and the counters ``bursts``, ``tokens_out``, ``errors``.
    dec : SpecDecoder
        Its ``host_left`` ([B] int64: a slot's remaining budget, 0 once it stopped) and, where it
        drains in C (``host_mirror``), the C twin of the token rows.
    intake : RequestIntake
        Told when requests finish (their ids may be used again).
    first_tokens : FirstTokens
        Drops the first tokens it handed out early from their first burst.
    """

    def __init__(self, table: SlotTable, record: LoopRecord, dec, intake: RequestIntake, first_tokens: FirstTokens):
        self.table, self.record, self.intake, self.first_tokens = table, record, intake, first_tokens
        batch = table.batch
        # The decoder's array, written in place (never reallocated: the C path holds its address)
        self._left = dec.host_left  # [B] int64
        # deliver's masks go into scratch arrays, and every slot receiving (the steady state)
        # reuses one read-only row list: each numpy temporary or Python-scalar operand costs
        # about a microsecond between bursts, while the GPU may wait.
        self._receiving = np.zeros(batch, bool)  # [B] bool scratch
        self._finished = np.zeros(batch, bool)  # [B] bool scratch
        self._no_left = np.zeros(batch, np.int64)  # [B] int64 constant 0
        self._every_slot = np.arange(batch)  # [B] int64: rows when every slot receives
        self._every_slot.setflags(write=False)  # Tokens events hand it to consumers
        # A graph's drained bursts are handed out in C (host_ops.c) where the decoder drains in C
        self.c_store = None if dec.host_mirror is None else table.store.in_c(
            host_ops.library(), running=table.running, left=self._left, receiving=self._receiving,
            finished=self._finished)

    def deliver(self, tokens, acc) -> int:
        """Hand a drained burst's tokens to their requests; finish those that stopped.

        Vectorised over the batch: one copy appends every running slot's tokens to its row
        (:class:`SlotTokens`; in C, with the masks, for a block the decoder drained in C);
        Python only visits the requests that finish. A request that is already done
        (cancelled, failed) receives nothing more. Returns the tokens delivered.
        """
        now = time.perf_counter()
        record, table = self.record, self.table
        record.bursts += 1
        if table.n_lead:
            self.first_tokens.drop_first(tokens)
        store, rows = self.c_store, None
        if tokens.addr is not None and store is not None:  # gb_append: into _receiving and _finished
            receiving = store.append(tokens.addr, now)
            finishing, delivered = store.n_finished, store.total
        else:
            # Counts are >= 0 (BurstTokens clamps them), so logical_and tests count > 0.
            mask = np.logical_and(table.running, tokens.counts, out=self._receiving)
            receiving = np.count_nonzero(mask)
            rows = self._every_slot if receiving == mask.size else mask.nonzero()[0]
            table.store.append(tokens.data, tokens.counts, rows, acc, now)
            finished = np.equal(self._left, self._no_left, out=self._finished)
            finished &= table.running
            finishing, delivered = np.count_nonzero(finished), tokens.total
        log = record.log
        if log is not None and receiving:
            if rows is None:
                rows = self._every_slot if receiving == self._receiving.size else self._receiving.nonzero()[0]
            log.append(Tokens(now, table.slot_state[rows], rows, tokens.counts, tokens.data, table.store.acc[rows]))
        if finishing:
            self.retire_finished(self._finished.nonzero()[0], now)  # not np.flatnonzero: a µs more
        record.tokens_out += delivered
        return delivered

    def retire_finished(self, rows: np.ndarray, now: float) -> None:
        """:meth:`retire` of the running requests of ``rows`` that stopped in a burst, at once,
        and free their slots now (not at the boundary).

        One pass over them (:meth:`RequestState._finish_rows`), with their slots' counters read in
        one gather each: none goes through :meth:`retire`'s per-request checks, since a running
        slot's request is never done.
        """
        table = self.table
        states = table.slot_state[rows].tolist()
        table.running[rows] = False  # no later burst's tokens reach them
        RequestState._finish_rows(states, table.store, rows, now)
        self.intake.forget_all(states)
        log = self.record.log
        if log is not None:
            log.extend(map(Retired, states))
        table.free(rows.tolist(), rows)

    def retire(self, state: RequestState, now: float | None = None, error: str | None = None) -> None:
        """Mark a request finished (once; a cancel, a failure) and forget its id.

        A request holding a slot keeps it until the next boundary frees it (``n_stale``); no
        later burst's tokens reach it. ``error``: why the loop gave up on it (counted in ``errors``).
        """
        if state.done:
            return
        if error is not None:
            state.error = error
            self.record.errors += 1
        if state._store is not None:
            table = self.table
            table.running[state.slot] = False  # no later burst's tokens reach it
            table.n_stale += 1  # its slot is freed at the next boundary
            state._detach()
        state.finished = now or time.perf_counter()
        self.intake.forget(state)
        log = self.record.log
        if log is not None:
            log.append(Retired(state))

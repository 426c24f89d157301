"""Handing a drained burst's tokens to the serving loop's requests, and finishing those that stopped.

Vectorised over the batch: one copy appends every running slot's tokens to its row
(:class:`~graphburst.serving.slot_tokens.SlotTokens`), and Python visits only the requests that
finish. A graph's burst drained in C (``host_ops.c``, the decoder's ``host_mirror``) is handed
out in C too (``gb_append``); otherwise in numpy, the reference the C path is held to.

:class:`LoopDelivery` is a mixin of :class:`~graphburst.serving.loop.ServeLoop`, which owns the
slots, the token store (and its C twin, ``_c_store``), the decoder and the log.
"""

from __future__ import annotations

import time

import numpy as np

from .events import Retired, Tokens
from .request import RequestState


class LoopDelivery:
    """Delivery of drained bursts (``_deliver``) and the retirement of requests that stopped in one."""

    def _retire_finished(self, rows: np.ndarray, now: float) -> None:
        """:meth:`_retire` of the running requests of ``rows`` that stopped in a burst, at once,
        and free their slots now (not at the boundary).

        One pass over them (:meth:`RequestState._finish_rows`), with their slots' counters read in
        one gather each: none goes through :meth:`_retire`'s per-request checks, since a running
        slot's request is never done.
        """
        states = self._slot_state[rows].tolist()
        self._running[rows] = False  # no later burst's tokens reach them
        RequestState._finish_rows(states, self.store, rows, now)
        self.intake.forget_all(states)
        if self.log is not None:
            self.log.extend(map(Retired, states))
        self._free(rows.tolist(), rows)

    def _deliver(self, tokens, acc) -> int:
        """Hand a drained burst's tokens to their requests; finish those that stopped.

        Vectorised over the batch: one copy appends every running slot's tokens to its row
        (:class:`SlotTokens`; in C, with the masks, for a block the decoder drained in C);
        Python only visits the requests that finish. A request that is already done
        (cancelled, failed) receives nothing more.
        """
        now = time.perf_counter()
        self.bursts += 1
        if self._n_lead:
            self._drop_first(tokens)
        store, rows = self._c_store, None
        if tokens.addr is not None and store is not None:  # gb_append: into _receiving and _finished
            receiving = store.append(tokens.addr, now)
            finishing, delivered = store.n_finished, store.total
        else:
            # Counts are >= 0 (BurstTokens clamps them), so logical_and tests count > 0.
            mask = np.logical_and(self._running, tokens.counts, out=self._receiving)
            receiving = np.count_nonzero(mask)
            rows = self._every_slot if receiving == mask.size else mask.nonzero()[0]
            self.store.append(tokens.data, tokens.counts, rows, acc, now)
            finished = np.equal(self.dec.host_left, self._no_left, out=self._finished)
            finished &= self._running
            finishing, delivered = np.count_nonzero(finished), tokens.total
        if self.log is not None and receiving:
            if rows is None:
                rows = self._every_slot if receiving == self._receiving.size else self._receiving.nonzero()[0]
            self.log.append(Tokens(now, self._slot_state[rows], rows, tokens.counts, tokens.data, self.store.acc[rows]))
        if finishing:
            self._retire_finished(self._finished.nonzero()[0], now)  # not np.flatnonzero: a µs more
        self.tokens_out += delivered
        return delivered

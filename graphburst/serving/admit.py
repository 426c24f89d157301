"""The serving loop's burst boundary: freeing slots, admitting waiting requests, prefilling.

The boundary may run while bursts are still in flight: every write it makes is enqueued
behind them on the decoder's stream with no host sync (:mod:`graphburst.engine.admission.slots`), so
the GPU keeps decoding the other slots, and the first burst launched afterwards serves the
new ones. With ``prefill_chunk`` a long prompt is prefilled a chunk per boundary, so the
decoding streams wait at most one chunk's prefill per burst.

:class:`LoopAdmission` is a mixin of :class:`~graphburst.serving.loop.ServeLoop`, which owns
the slots, the intake, the decoder and the token store it uses.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..engine.admission.checks import chunked_prefill
from ..constants import NO_EOS
from ..validate import check_int
from .events import Admitted
from .first_tokens import NO_COPY

#: ``ServeLoop(admission=...)``: when a pipelined step runs the burst boundary (see LoopAdmission._admit_early)
ADMISSION_MODES = ("auto", "early", "late")
#: auto: admit before refilling once the bursts still queued outlast this many times a typical
#: admission's host time (the median of the last ADMISSION_WINDOW). Zero-cost stubs (0.1 ms bursts,
#: 0.1-0.4 ms admissions) stay late; real models (35-140 ms bursts, 1-10 ms admissions) go early. The
#: median, not the last admission: sizes alternate in waves, and a one-slot admission must not send
#: the next fourteen-slot one early.
EARLY_ADMISSION_MARGIN = 4.0
ADMISSION_WINDOW = 16
#: auto: while the last burst's GPU time is under this many typical admissions (the host, not the
#: GPU, is then the bottleneck: zero-cost stubs, ~0.1 ms bursts against ~0.2-0.6 ms admissions), a
#: boundary due within a few bursts of an admission waits, so one admission takes the slots those
#: bursts freed (:meth:`LoopAdmission._coalesce_limit`). An admission's host time is mostly fixed
#: (H200 lease, stubs at M=8: ~200 us plus ~6 us a slot), and finishing requests free slots over
#: consecutive bursts. Real models (35-140 ms bursts, 1-10 ms admissions) never defer.
COALESCE_BELOW = 1.0
#: ... and only once this many admissions are measured: a server's first admissions can include
#: kernel compiles and graph captures, which must not pass for a typical admission.
COALESCE_AFTER = 3
#: ``_admitted_at`` before any admission: ``pipeline.launched`` minus it passes any coalescing limit
NO_RECENT_ADMISSION = -(2**31)


class LoopAdmission:
    """Slot changes of a serving loop, all at burst boundaries."""

    def _free(self, slots: list, index: np.ndarray | None = None) -> None:
        """Empty ``slots``; ``index``: the same as an int64 array, where the caller has one (the
        array writes below then convert no list)."""
        index = slots if index is None else index
        for b in slots:
            self.slots[b] = None
            self._prefilling.pop(b, None)
        self._slot_state[index] = None
        self._n_occupied -= len(slots)
        self._first_copy[index] = NO_COPY  # a copy still pending for them is for nobody now
        if self._n_lead:
            self._n_lead -= np.count_nonzero(self._lead[index])
            self._lead[index] = False

    def _boundary(self) -> None:
        """The burst boundary: free slots of finished, cancelled or failed requests, give free
        slots to waiting requests, and prefill up to ``prefill_chunk`` of their prompt tokens
        (every slot change of the loop happens here).

        Bursts may still be in flight: every write is enqueued behind them on the decoder's
        stream, with no host sync (``graphburst.engine.admission.slots``), and the first burst launched
        after it serves the new slots. Admission reads the values validated at submission;
        a request whose prefill fails finishes with an error and its slot is freed.
        """
        if self._n_stale:  # else every finished request's slot was freed at delivery: no scan
            freed = [b for b, s in enumerate(self.slots) if s is not None and s.done]
            self._free(freed)
            self._n_stale = 0
            self.dec.release(freed)
        t0 = time.perf_counter()
        if self.intake.queue and self._n_occupied < self.dec.batch:
            self._take_waiting()
        if self._prefilling:
            # The admission span: GPU idle between bursts that is the models' prefill (timing.py)
            clock, stream = self.pipeline.clock, self.dec.stream
            span = clock.admission_begin(stream)
            try:
                self._prefill_some()
            finally:
                clock.admission_end(span, stream)
            self._note_admission((time.perf_counter() - t0) * 1e3)  # taking requests and prefilling them
            self._admitted_at, self._deferrals = self.pipeline.launched, 0

    def _note_admission(self, ms: float) -> None:
        """One admission's host milliseconds; the typical one is the median of the last
        :data:`ADMISSION_WINDOW`, computed here once rather than at every step that reads it."""
        self._admission_ms.append(ms)
        self._typical_admission_ms = statistics.median(self._admission_ms)

    def _forget_admissions(self) -> None:
        """Drop the admission times measured so far (those of a warm-up that compiled kernels, say)."""
        self._admission_ms.clear()
        self._typical_admission_ms = None

    def _defer_boundary(self) -> bool:
        """Whether ``auto`` admission lets a due boundary wait a burst, to coalesce it with the next.

        Only while the host is the bottleneck (:meth:`_coalesce_limit` > 0), never while a
        prompt is part-way through a chunked prefill, and only within that limit of bursts
        launched since the last admission, that many times at most: a freed slot waits at
        most that many more bursts.
        """
        if self.admission != "auto" or self._prefilling:
            return False
        limit = self._coalesce_limit()
        if self._deferrals >= limit or self.pipeline.launched - self._admitted_at > limit:
            return False
        self._deferrals += 1
        self.deferred_boundaries += 1
        return True

    def _coalesce_limit(self) -> int:
        """Bursts a due boundary may wait after an admission (``auto``; 0: none).

        None unless the host is the bottleneck: the last burst's GPU time under
        :data:`COALESCE_BELOW` typical admissions, of at least :data:`COALESCE_AFTER` measured,
        and auto not admitting early (at depth 6 and more the two rules overlap: the queued
        bursts then hide the admission, and waiting would only cost a burst). Then about as many
        bursts as one typical admission's host time covers (an admission's cost is mostly fixed,
        so taking that many bursts' freed slots at once keeps the host's admission work per burst
        within a burst's GPU time), at least 1 and at most ``depth - 1``: a coalesced admission's
        host time must stay within the bursts still queued behind it. Zero-cost stubs on an H200
        lease (``scripts/admit_profile.py``, docs/serving.md): at M=8, depth 4, a limit of 3 idled
        12-15% against 23-32% for 1 and ran the workload 4-15% sooner; 4 idled 18-24%.
        """
        if not self._host_bound() or self._admit_early():
            return 0
        busy, typical = self.pipeline.clock.last_busy_ms, self._typical_admission_ms
        # busy > 0 here unless an event pair read 0.0 ms (then any number of bursts is covered)
        covered = round(typical / busy) if busy > 0 else self.pipeline.depth
        return min(self.pipeline.depth - 1, max(1, covered))

    def _host_bound(self) -> bool:
        """Whether the host, not the GPU, bounds the loop: the last burst's GPU time is under
        :data:`COALESCE_BELOW` typical admissions, of at least :data:`COALESCE_AFTER` measured
        (zero-cost stubs; never real models, whose bursts outlast admissions many times over).
        Every microsecond the host then spends is GPU idle."""
        busy, typical = self.pipeline.clock.last_busy_ms, self._typical_admission_ms
        return busy is not None and len(self._admission_ms) >= COALESCE_AFTER and busy < COALESCE_BELOW * typical

    def _copy_first_tokens(self) -> bool:
        """Whether a final prefill also copies its first tokens out, to hand them out before their
        first burst is drained (:mod:`~graphburst.serving.first_tokens`).

        Not while the host bounds the loop (:meth:`_host_bound`): the copy, its event and its
        hand-out cost the host ~60 µs an admission (H200, zero-cost stubs), all of it GPU idle, to
        hand a token out a few sub-millisecond bursts sooner; the first burst carries it instead.
        """
        return self.early_first_tokens and not self._host_bound()

    def _admit_early(self) -> bool:
        """Whether a pipelined step admits before refilling the pipeline (``admission``).

        Early, the host delivers the drained burst and admits while the ``depth - 1`` bursts
        still queued run, and the next launch carries the new slots: their first tokens come
        one burst sooner. Late, the step launches first, so the GPU has a full queue while the
        host admits, and new slots wait behind one more burst. ``auto`` admits early once the
        last drained burst's GPU time, times the ``depth - 1`` bursts still queued, exceeds
        ``EARLY_ADMISSION_MARGIN`` times the median host time of the last ``ADMISSION_WINDOW``
        admissions (real models: a burst is tens of milliseconds, an admission a few), and late
        until both are measured or without GPU timing.
        """
        if self.admission != "auto":
            return self.admission == "early"
        busy, typical = self.pipeline.clock.last_busy_ms, self._typical_admission_ms
        return busy is not None and typical is not None and \
            busy * (self.pipeline.depth - 1) > EARLY_ADMISSION_MARGIN * typical

    def _take_waiting(self) -> None:
        """Give each free slot the oldest waiting request (host bookkeeping only)."""
        slots, slot_state = self.slots, self._slot_state
        free = [b for b, s in enumerate(slots) if s is None]
        states = self.intake.take_waiting(len(free))
        if not states:
            return
        admitted = free[: len(states)]
        store = self.store
        for b, state in zip(admitted, states):
            state.slot, state._store = b, store
            slots[b] = slot_state[b] = state  # an element at a time: a fancy write of objects costs more
        self._prefilling.update(dict.fromkeys(admitted, 0))
        self._n_occupied += len(admitted)
        store.reset(admitted)
        if self.log is not None:
            self.log += map(Admitted, states)

    def _prefill_some(self) -> None:
        """Prefill up to ``prefill_chunk`` prompt tokens, oldest admission first: whole prompts
        that fit, then one chunk of the next. A slot whose last chunk is written goes live."""
        left = self.prefill_chunk or None
        partial, final = [], []  # (slot, state, start, end) of this boundary's chunks
        slots = self.slots
        for b, start in self._prefilling.items():
            state = slots[b]
            if state.finished is not None:
                continue  # cancelled while prefilling: freed at the next boundary
            size = len(state.row)
            n = size - start
            if left is not None:
                if left <= 0:
                    break
                n = min(n, left)
                left -= n
            (final if start + n == size else partial).append((b, state, start, start + n))
        for group, is_final in ((partial, False), (final, True)):
            if group:
                self._prefill_group(group, is_final)

    def _prefill_group(self, group: list, final: bool) -> None:
        # The values were validated at submission (RequestIntake): admission only copies them,
        # through the decoder's unchecked entry point, since the GPU may be waiting on it. The
        # arguments are lists in slot order (prefill_slots), each built in one comprehension; the
        # loop's own writes and events keep the admission order of ``group`` (a prompt carried over
        # from an earlier boundary before one admitted since, whatever their slots).
        in_order = [entry[0] for entry in group]
        # ascending slots; they differ, so the states are never compared
        slots, states, starts, ends = (list(column) for column in zip(*sorted(group)))
        rows = [state.row[start:end] for state, start, end in zip(states, starts, ends)]
        try:
            if final:
                # every admitted slot gets an options entry: a reused one forgets its last request
                self.dec.prefill_slots(slots, rows, starts, limits=[state.limit for state in states],
                                       stops=[NO_EOS if state.eos is None else state.eos for state in states],
                                       sampling=[state.sampling for state in states] if self.sampling else None,
                                       options=[state.slot_options for state in states])
            else:
                self.dec.prefill_slots(slots, rows, starts, final=False)
        except Exception as exc:  # noqa: BLE001 - only the requests being prefilled are touched
            msg = describe(exc)
            for b in in_order:
                self._retire(self.slots[b], error=msg)
            self._n_stale -= len(in_order)
            self._free(in_order)
            self.dec.release(in_order)
            if not self._costs_only_its_requests(exc):
                raise
            return
        if final:
            prefilling = self._prefilling
            for b in in_order:
                del prefilling[b]
            live = np.asarray(in_order, np.int64)  # [n] int64, admission order (the first tokens' event rows)
            self._running[live] = True
            if self._copy_first_tokens():  # their first tokens, copied behind the prefill (first_tokens.py)
                self._first_copy[live] = self._first.enqueue(self.dec.bufs.pend, live, self.pipeline.launched,
                                                             self.dec.stream)
        else:
            self._prefilling.update(zip(slots, ends))

    def _costs_only_its_requests(self, exc: Exception) -> bool:
        """Whether a failed prefill ends only the requests being admitted (here: always).

        A lockstep loop answers no for anything but a bad request: a collective that fails
        during prefill leaves the ranks apart, so the loop must stop.
        """
        return True

    def _needs_boundary(self) -> bool:
        """A request waits for a free slot, a slot still holds a finished request, or a prompt
        is still being prefilled."""
        return bool(self.intake.queue and self._n_occupied < self.dec.batch) or self._n_stale > 0 \
            or bool(self._prefilling)

    def _boundary_due(self) -> bool:
        """A pipelined step runs the boundary now: it is needed and not deferred (:meth:`_defer_boundary`)."""
        return self._needs_boundary() and not self._defer_boundary()


def check_admission(mode) -> str:
    """``admission``: one of :data:`ADMISSION_MODES`."""
    if mode not in ADMISSION_MODES:
        raise ValueError(f"admission must be one of {', '.join(ADMISSION_MODES)}, got {mode!r}")
    return mode


def check_prefill_chunk(chunk, target, draft) -> int | None:
    """``prefill_chunk``: None, or a positive int for models that can continue a cached prompt."""
    if chunk is None:
        return None
    chunk = check_int("prefill_chunk", chunk, minimum=1)
    for role, model in (("target", target), ("draft", draft)):
        if not chunked_prefill(model):
            raise ValueError(f"prefill_chunk={chunk} needs models that prefill in chunks; the {role} "
                             f"({type(model).__name__}) cannot (no chunked_prefill): leave prefill_chunk unset")
    return chunk


def describe(exc: BaseException) -> str:
    """One line for a request's ``error``: the exception type and message."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

"""The serving loop's burst boundary: when it runs, and what it does (freeing slots, admitting
waiting requests, prefilling).

Two parts of :class:`~graphburst.serving.loop.ServeLoop`, each given what it uses:

- :class:`AdmissionSchedule` decides: whether a pipelined step admits before or after refilling
  the pipeline (``admission``), whether a due boundary waits a burst to coalesce with the next,
  whether a final prefill copies its first tokens out early. It measures admissions' host time
  for those choices and changes no slot.
- :class:`Boundary` applies: it frees the slots of finished requests, gives free slots to
  waiting requests and prefills their prompts.

The boundary may run while bursts are still in flight: every write it makes is enqueued
behind them on the decoder's stream with no host sync (:mod:`graphburst.engine.admission.slots`), so
the GPU keeps decoding the other slots, and the first burst launched afterwards serves the
new ones. With ``prefill_chunk`` a long prompt is prefilled a chunk per boundary, so the
decoding streams wait at most one chunk's prefill per burst.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable

import numpy as np

from ..engine.admission.checks import chunked_prefill
from ..constants import NO_EOS
from ..validate import check_int
from .events import Admitted, LoopRecord
from .first_tokens import FirstTokens
from .intake import RequestIntake
from .pipeline import BurstPipeline
from .slot_table import SlotTable

#: ``ServeLoop(admission=...)``: when a pipelined step runs the burst boundary (:meth:`AdmissionSchedule.admit_early`)
ADMISSION_MODES = ("auto", "early", "late")
#: auto: admit before refilling once the bursts still queued outlast this many times a typical
#: admission's host time (the median of the last ADMISSION_WINDOW). Zero-cost stubs (0.1 ms bursts,
#: 0.1-0.4 ms admissions) stay late; real models (35-140 ms bursts, 1-10 ms admissions) go early. The
#: median, not the last admission: sizes alternate in waves, and a one-slot admission must not send
#: the next fourteen-slot one early.
EARLY_ADMISSION_MARGIN = 4.0
ADMISSION_WINDOW = 16
#: auto: while a whole burst's GPU time (``BurstPipeline.burst_ms``) is under this many typical
#: admissions (the host, not the GPU, is then the bottleneck: zero-cost stubs, ~0.1 ms bursts against
#: ~0.2-0.6 ms admissions), a boundary due within a few bursts of an admission waits, so one
#: admission takes the slots those bursts freed (:meth:`AdmissionSchedule.coalesce_limit`). An
#: admission's host time is mostly fixed (an H200, stubs at M=8: ~200 us plus ~6 us a slot), and
#: finishing requests free slots over consecutive bursts. Real models (35-140 ms bursts, 1-10 ms
#: admissions) never defer.
COALESCE_BELOW = 1.0
#: ... and only once this many admissions are measured: a server's first admissions can include
#: kernel compiles and graph captures, which must not pass for a typical admission.
COALESCE_AFTER = 3
#: ``AdmissionSchedule.admitted_at`` before any admission: ``pipeline.launched`` minus it passes any coalescing limit
NO_RECENT_ADMISSION = -(2**31)


class AdmissionSchedule:
    """When a serving loop's burst boundary runs: the loop asks, the :class:`Boundary` acts.

    Parameters
    ----------
    mode : {"auto", "early", "late"}
        ``ServeLoop(admission=...)``, validated (:func:`check_admission`).
    table : SlotTable
    intake : RequestIntake
    pipeline : BurstPipeline
        A whole burst's GPU time (``burst_ms``), its depth and launch count.
    early_first_tokens : bool
        The loop's policy lets first tokens out after the prefill (``LoopPolicy.early_first_tokens``).

    Attributes
    ----------
    mode : str
    deferred_boundaries : int
        Boundaries ``auto`` let wait a burst (:meth:`defer_boundary`).
    admitted_at : int
        ``pipeline.launched`` at the last admission (:data:`NO_RECENT_ADMISSION` before the first).
    deferrals : int
        Boundaries deferred since that admission.
    admission_ms : collections.deque
        Host ms of the last :data:`ADMISSION_WINDOW` admissions; ``typical_admission_ms`` their
        median (None before the first).
    """

    def __init__(self, mode: str, *, table: SlotTable, intake: RequestIntake, pipeline: BurstPipeline,
                 early_first_tokens: bool):
        self.mode = check_admission(mode)
        self._table, self._intake, self._pipeline = table, intake, pipeline
        self.early_first_tokens = bool(early_first_tokens)
        self.admission_ms = collections.deque(maxlen=ADMISSION_WINDOW)
        self.typical_admission_ms: float | None = None
        self.admitted_at = NO_RECENT_ADMISSION
        self.deferrals = 0
        self.deferred_boundaries = 0

    # ------------------------------------------------------------------ what was measured

    def admitted(self, ms: float) -> None:
        """A boundary admitted or prefilled, in ``ms`` host milliseconds: the coalescing window
        starts again from here."""
        self.note_admission(ms)
        self.admitted_at, self.deferrals = self._pipeline.launched, 0

    def note_admission(self, ms: float) -> None:
        """One admission's host milliseconds; the typical one is the median of the last
        :data:`ADMISSION_WINDOW`, computed here once rather than at every step that reads it."""
        self.admission_ms.append(ms)
        self.typical_admission_ms = statistics.median(self.admission_ms)

    def forget_admissions(self) -> None:
        """Drop the admission times measured so far (those of a warm-up that compiled kernels, say)."""
        self.admission_ms.clear()
        self.typical_admission_ms = None

    # ------------------------------------------------------------------ decisions

    def needs_boundary(self) -> bool:
        """A request waits for a free slot, a slot still holds a finished request, or a prompt
        is still being prefilled."""
        table = self._table
        return bool(self._intake.queue and table.n_occupied < table.batch) or table.n_stale > 0 \
            or bool(table.prefilling)

    def boundary_due(self) -> bool:
        """A pipelined step runs the boundary now: it is needed and not deferred (:meth:`defer_boundary`)."""
        return self.needs_boundary() and not self.defer_boundary()

    def defer_boundary(self) -> bool:
        """Whether ``auto`` admission lets a due boundary wait a burst, to coalesce it with the next.

        Only while the host is the bottleneck (:meth:`coalesce_limit` > 0), never while a
        prompt is part-way through a chunked prefill, and only within that limit of bursts
        launched since the last admission, that many times at most: a freed slot waits at
        most that many more bursts. Counts a deferral it grants.
        """
        if self.mode != "auto" or self._table.prefilling:
            return False
        limit = self.coalesce_limit()
        if self.deferrals >= limit or self._pipeline.launched - self.admitted_at > limit:
            return False
        self.deferrals += 1
        self.deferred_boundaries += 1
        return True

    def coalesce_limit(self) -> int:
        """Bursts a due boundary may wait after an admission (``auto``; 0: none).

        None unless the host is the bottleneck: a whole burst's GPU time under
        :data:`COALESCE_BELOW` typical admissions, of at least :data:`COALESCE_AFTER` measured,
        and auto not admitting early (at depth 6 and more the two rules overlap: the queued
        bursts then hide the admission, and waiting would only cost a burst). Then about as many
        bursts as one typical admission's host time covers (an admission's cost is mostly fixed,
        so taking that many bursts' freed slots at once keeps the host's admission work per burst
        within a burst's GPU time), at least 1 and at most ``depth - 1``: a coalesced admission's
        host time must stay within the bursts still queued behind it. Zero-cost stubs on an H200
        (``graphburst bench serve --profile``, docs/serving.md): at M=8, depth 4, a limit of 3 idled
        12-15% against 23-32% for 1 and ran the workload 4-15% sooner; 4 idled 18-24%.
        """
        if not self.host_bound() or self.admit_early():
            return 0
        pipeline = self._pipeline
        busy, typical = pipeline.burst_ms, self.typical_admission_ms
        # busy > 0 here unless an event pair read 0.0 ms (then any number of bursts is covered)
        covered = round(typical / busy) if busy > 0 else pipeline.depth
        return min(pipeline.depth - 1, max(1, covered))

    def host_bound(self) -> bool:
        """Whether the host, not the GPU, bounds the loop: a whole burst's GPU time (the last drained
        burst that ran a round, per round times M: ``BurstPipeline.burst_ms``) is under
        :data:`COALESCE_BELOW` typical admissions, of at least :data:`COALESCE_AFTER` measured
        (zero-cost stubs; never real models, whose bursts outlast admissions many times over).
        Every microsecond the host then spends is GPU idle."""
        busy, typical = self._pipeline.burst_ms, self.typical_admission_ms
        return busy is not None and len(self.admission_ms) >= COALESCE_AFTER and busy < COALESCE_BELOW * typical

    def copy_first_tokens(self) -> bool:
        """Whether a final prefill also copies its first tokens out, to hand them out before their
        first burst is drained (:mod:`~graphburst.serving.first_tokens`).

        Not while the host bounds the loop (:meth:`host_bound`): the copy, its event and its
        hand-out cost the host ~60 µs an admission (H200, zero-cost stubs), all of it GPU idle, to
        hand a token out a few sub-millisecond bursts sooner; the first burst carries it instead.
        """
        return self.early_first_tokens and not self.host_bound()

    def admit_early(self) -> bool:
        """Whether a pipelined step admits before refilling the pipeline (``mode``).

        Early, the host delivers the drained burst and admits while the ``depth - 1`` bursts
        still queued run, and the next launch carries the new slots: their first tokens come
        one burst sooner. Late, the step launches first, so the GPU has a full queue while the
        host admits, and new slots wait behind one more burst. ``auto`` admits early once the
        GPU time of a whole burst, times the ``depth - 1`` bursts still queued, exceeds
        ``EARLY_ADMISSION_MARGIN`` times the median host time of the last ``ADMISSION_WINDOW``
        admissions (real models: a burst is tens of milliseconds, an admission a few), and late
        until both are measured or without GPU timing.
        """
        if self.mode != "auto":
            return self.mode == "early"
        pipeline = self._pipeline
        busy, typical = pipeline.burst_ms, self.typical_admission_ms
        return busy is not None and typical is not None and \
            busy * (pipeline.depth - 1) > EARLY_ADMISSION_MARGIN * typical


class Boundary:
    """The burst boundary of a serving loop: every slot change happens here.

    Parameters
    ----------
    table : SlotTable
    dec : SpecDecoder
        Its admission (``prefill_slots``, ``release``), stream and ``pend`` buffer.
    intake : RequestIntake
        The waiting requests.
    pipeline : BurstPipeline
        Its burst clock (the admission span) and launch count.
    schedule : AdmissionSchedule
        Told each admission's host time; asked whether a final prefill copies first tokens out.
    first_tokens : FirstTokens
        Where those copies go.
    record : LoopRecord
        The log (``Admitted`` events).
    retire : callable
        ``retire(state, error=...)``: finish a request (``Delivery.retire``), for a failed prefill.
    costs_only_its_requests : callable
        ``LoopPolicy.costs_only_its_requests``: whether a failed prefill ends only its requests.
    prefill_chunk : int or None
        Prompt tokens prefilled per boundary at most (validated: :func:`check_prefill_chunk`).
    sampling : bool
        The loop decodes with rejection sampling (requests' sampling settings are admitted).
    """

    def __init__(self, *, table: SlotTable, dec, intake: RequestIntake, pipeline: BurstPipeline,
                 schedule: AdmissionSchedule, first_tokens: FirstTokens, record: LoopRecord,
                 retire: Callable, costs_only_its_requests: Callable, prefill_chunk: int | None, sampling: bool):
        self.table, self.dec, self.intake, self.pipeline = table, dec, intake, pipeline
        self.schedule, self.first_tokens, self.record = schedule, first_tokens, record
        self._retire, self._costs_only_its_requests = retire, costs_only_its_requests
        self.prefill_chunk, self.sampling = prefill_chunk, bool(sampling)

    def run(self) -> None:
        """The burst boundary: free slots of finished, cancelled or failed requests, give free
        slots to waiting requests, and prefill up to ``prefill_chunk`` of their prompt tokens.

        Bursts may still be in flight: every write is enqueued behind them on the decoder's
        stream, with no host sync (``graphburst.engine.admission.slots``), and the first burst launched
        after it serves the new slots. Admission reads the values validated at submission;
        a request whose prefill fails finishes with an error and its slot is freed.
        """
        table = self.table
        if table.n_stale:  # else every finished request's slot was freed at delivery: no scan
            self.free_finished()
        t0 = time.perf_counter()
        if self.intake.queue and table.n_occupied < table.batch:
            self.take_waiting()
        if table.prefilling:
            # The admission span: GPU idle between bursts that is the models' prefill (timing.py)
            clock, stream = self.pipeline.clock, self.dec.stream
            span = clock.admission_begin(stream)
            try:
                self.prefill_some()
            finally:
                clock.admission_end(span, stream)
            self.schedule.admitted((time.perf_counter() - t0) * 1e3)  # taking requests and prefilling them

    def free_finished(self) -> None:
        """Free the slots still holding a finished request (one cancelled or failed, say) and
        release them in the decoder."""
        table = self.table
        freed = table.stale_slots()
        table.free(freed)
        table.n_stale = 0
        self.dec.release(freed)

    def take_waiting(self) -> None:
        """Give each free slot the oldest waiting request (host bookkeeping only)."""
        free = self.table.free_slots()
        states = self.intake.take_waiting(len(free))
        if not states:
            return
        now = time.perf_counter()
        for state in states:
            state.admitted = now
        self.table.occupy(free[: len(states)], states)
        log = self.record.log
        if log is not None:
            log += map(Admitted, states)

    def prefill_some(self) -> None:
        """Prefill up to ``prefill_chunk`` prompt tokens, oldest admission first: whole prompts
        that fit, then one chunk of the next. A slot whose last chunk is written goes live."""
        left = self.prefill_chunk or None
        partial, final = [], []  # (slot, state, start, end) of this boundary's chunks
        slots = self.table.slots
        for b, start in self.table.prefilling.items():
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
                self.prefill_group(group, is_final)

    def prefill_group(self, group: list, final: bool) -> None:
        """Prefill one group of chunks, ``(slot, state, start, end)`` each, in admission order;
        ``final``: each is its prompt's last, and its slot goes live."""
        # The values were validated at submission (RequestIntake): admission only copies them,
        # through the decoder's unchecked entry point, since the GPU may be waiting on it. The
        # arguments are lists in slot order (prefill_slots), each built in one comprehension; the
        # loop's own writes and events keep the admission order of ``group`` (a prompt carried over
        # from an earlier boundary before one admitted since, whatever their slots).
        table, dec = self.table, self.dec
        in_order = [entry[0] for entry in group]
        # ascending slots; they differ, so the states are never compared
        slots, states, starts, ends = (list(column) for column in zip(*sorted(group)))
        rows = [state.row[start:end] for state, start, end in zip(states, starts, ends)]
        try:
            if final:
                # every admitted slot gets an options entry: a reused one forgets its last request
                dec.prefill_slots(slots, rows, starts, limits=[state.limit for state in states],
                                  stops=[NO_EOS if state.eos is None else state.eos for state in states],
                                  sampling=[state.sampling for state in states] if self.sampling else None,
                                  options=[state.slot_options for state in states])
            else:
                dec.prefill_slots(slots, rows, starts, final=False)
        except Exception as exc:  # noqa: BLE001 - only the requests being prefilled are touched
            msg = describe(exc)
            for b in in_order:
                self._retire(table.slots[b], error=msg)
            table.n_stale -= len(in_order)
            table.free(in_order)
            dec.release(in_order)
            if not self._costs_only_its_requests(exc):
                raise
            return
        if final:
            prefilling = table.prefilling
            for b in in_order:
                del prefilling[b]
            live = np.asarray(in_order, np.int64)  # [n] int64, admission order (the first tokens' event rows)
            table.running[live] = True
            if self.schedule.copy_first_tokens():  # their first tokens, copied behind the prefill (first_tokens.py)
                self.first_tokens.copy(live)
        else:
            table.prefilling.update(zip(slots, ends))


def check_admission(mode, *, local_timing: bool = True) -> str:
    """``admission``: one of :data:`ADMISSION_MODES`. Without ``local_timing`` (a loop whose steps
    must not follow its own timings: ``LoopPolicy.local_timing``) ``auto`` is ``late``, and
    ``early`` is refused."""
    if mode not in ADMISSION_MODES:
        raise ValueError(f"admission must be one of {', '.join(ADMISSION_MODES)}, got {mode!r}")
    if local_timing:
        return mode
    if mode == "early":
        raise ValueError("admission='early' needs a loop whose admission may follow its own timings; this loop's "
                         "policy admits after the refill at every step (local_timing is False): use auto or late")
    return "late"


def check_prefill_chunk(chunk, target, draft) -> int | None:
    """``prefill_chunk``: None, or a positive int for models that can continue a cached prompt."""
    if chunk is None:
        return None
    chunk = check_int("prefill_chunk", chunk, minimum=1)
    for role, model in (("target", target), ("draft", draft)):
        if model is None:  # plain decoding: no draft to prefill
            continue
        if not chunked_prefill(model):
            raise ValueError(f"prefill_chunk={chunk} needs models that prefill in chunks; the {role} "
                             f"({type(model).__name__}) cannot (no chunked_prefill): leave prefill_chunk unset")
    return chunk


def describe(exc: BaseException) -> str:
    """One line for a request's ``error``: the exception type and message."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

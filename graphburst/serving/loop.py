"""A replay loop for a serving process: continuous batching over one captured burst graph.

One :class:`BurstGraph` is captured at start-up per (batch slots, k, M) and replayed for
the life of the process. At each burst boundary the loop frees finished slots and admits
waiting requests into them (prefill and slot reset are stream-ordered writes into the
fixed buffers plus the model's prefill kernels: no recapture, no host sync), even while
bursts are still in flight (:mod:`graphburst.serving.admit`); then it replays, drains and
streams each request's new tokens. Stops (EOS, max_new_tokens) happen on the device,
mid-round if need be, so no token past a stop ever reaches the ring; a finished or idle
slot has budget 0 and emits nothing.

A failure inside :meth:`ServeLoop.step` costs only the requests it touches: they finish
with ``error`` set (``finish_reason == "error"``), the tokens already handed out stay,
and the loop goes on serving the others.

The loop owns its parts and hands each one what it uses, explicitly; no part reads another's
attributes through a shared ``self``:

- ``loop.intake`` (:mod:`~graphburst.serving.intake`): validation at submission, ids, the waiting queue;
- ``loop.pipeline`` (:mod:`~graphburst.serving.pipeline`): the bursts in flight;
- ``loop.table`` (:mod:`~graphburst.serving.slot_table`): which request each batch slot holds, and
  the slots' token rows: the one state the parts below share;
- ``loop.record`` (:class:`~graphburst.serving.events.LoopRecord`): the event log and the counters;
- ``loop.schedule`` and ``loop.boundary`` (:mod:`~graphburst.serving.admit`): when the burst boundary
  runs, and the boundary itself (freeing, admission, chunked prefill);
- ``loop.first_tokens`` (:mod:`~graphburst.serving.first_tokens`): first tokens handed out after the prefill;
- ``loop.delivery`` (:mod:`~graphburst.serving.delivery`): a drained burst's tokens handed out, and
  every request's retirement.

How the decoder and the graph are built, and which choices the loop may make from its own
timings, is its :class:`~graphburst.serving.policy.LoopPolicy` (tensor-parallel serving passes
its own: :mod:`graphburst.parallel.lockstep`). Requests are :mod:`graphburst.serving.request`,
timing figures :mod:`graphburst.serving.timing`, and what a step did is told as typed events
(:mod:`graphburst.serving.events`). This module holds the loop itself: the step, cancellation,
streaming and the loop's figures.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator, Iterator

from ..capture import DEVICE_EXIT_CHOICES
from ..engine.mode import BurstMode
from ..constants import MAX_DEPTH
from ..sampling.params import SamplingParams
from ..validate import check_int
from .admit import AdmissionSchedule, Boundary, check_admission, check_prefill_chunk, describe
from .delivery import Delivery
from .events import LoopRecord
from .first_tokens import FirstTokens
from .intake import RequestIntake
from .pipeline import BurstPipeline
from .policy import LoopPolicy, check_policy
from .request import Request, RequestState
from .slot_table import SlotTable
from .timing import inter_token_latencies_us, percentiles

SERVE_MODES = (BurstMode.GRAPH, BurstMode.PER_ROUND_SYNC)  # ``pipelined`` makes the graph engine gapless
ENGINE_MODES = tuple(m.value for m in SERVE_MODES)  # --engine choices

__all__ = ["ENGINE_MODES", "SERVE_MODES", "Request", "RequestState", "ServeLoop", "inter_token_latencies_us",
           "percentiles"]


#: ``device_exit`` values: a burst graph's (False, True, "auto"), or LADDER, its fallback asked for by name
LADDER = "ladder"
LOOP_DEVICE_EXIT_CHOICES = (*DEVICE_EXIT_CHOICES, LADDER)
#: A ladder loop with a batch slot free launches bursts of about this many device ms (by the last
#: burst's time per round): a request arriving then waits for the bursts in flight, so their length is
#: its wait; a few ms keeps that near a peer's per-round wait while the host's cost per burst (tens of
#: µs to launch, drain and hand out) stays around 1% of the GPU's time.
LADDER_FREE_SLOT_MS = 4.0


def check_device_exit(device_exit, *, engine: BurstMode, local_timing: bool) -> None:
    """``device_exit``: False, True, "auto" or "ladder"; not False only for the graph engine, under a
    policy whose steps follow this process's own timings."""
    if not (any(device_exit is c for c in DEVICE_EXIT_CHOICES) or _is_ladder(device_exit)):
        raise ValueError(f"device_exit must be one of {LOOP_DEVICE_EXIT_CHOICES}, got {device_exit!r}")
    if device_exit is False:
        return
    if engine != BurstMode.GRAPH:
        raise ValueError(f"device_exit={device_exit!r} ends the graph engine's bursts on the device; the "
                         f"{engine.value} engine runs eager bursts")
    if not local_timing:
        raise ValueError(f"device_exit={device_exit!r} ends bursts when requests arrive here, and this loop's policy "
                         f"must take the same steps as other processes (local_timing is False)")


def _is_ladder(device_exit) -> bool:
    return isinstance(device_exit, str) and device_exit == LADDER


class LadderRounds:
    """The rounds of a ladder loop's next burst, from its queue: ``rounds(pipeline) -> int``.

    One while a request waits for a free slot (the next boundary admits it a round later); about
    :data:`LADDER_FREE_SLOT_MS` of device time while a slot is free and nobody waits (a request
    arriving waits for the bursts in flight); else M, or as few as the longest remaining budget
    needs after the bursts in flight (a round commits a token at least). It holds the loop's slot
    table, intake and decoder, and is handed the pipeline that asks, so no part holds the loop.
    """

    def __init__(self, table: SlotTable, intake: RequestIntake, dec):
        self.table, self.intake, self.dec = table, intake, dec

    def __call__(self, pipeline: BurstPipeline) -> int:
        table, rounds = self.table, self.dec.m_rounds
        if table.n_occupied < table.batch:
            if self.intake.queue:
                return 1
            round_ms = pipeline.round_ms
            if round_ms is not None and round_ms > 0:
                rounds = min(rounds, math.ceil(LADDER_FREE_SLOT_MS / round_ms))
        left = int(self.dec.host_left.max()) - pipeline.rounds_in_flight
        return max(1, min(rounds, left))


class ServeLoop:
    """Continuous batching of requests over one captured burst graph.

    Parameters
    ----------
    target, draft : the models (a stub draft gets per-request acceptance and seed)
    k, m_rounds : int
    engine : BurstMode or str
        ``GRAPH``, or ``PER_ROUND_SYNC`` to run the same
        loop through eager bursts that sync every round, for comparison.
    pipelined : bool
        Graph engine only: keep a second burst in flight (gapless drain) while the host
        hands out the previous burst's tokens.
    depth : int
        Pipelined: bursts kept in flight (2 to ``capture.MAX_DEPTH``). More lets the host
        spend longer at a burst boundary (admitting requests) before the GPU runs dry, at
        the price of a new request waiting for more queued bursts before its first.
    sampling : bool
        Decode with speculative rejection sampling, so requests may ask for temperature
        > 0 (the models must support it; see ``SpecDecoder``). Without it such a request
        is refused at submission.
    fields : bool
        The logits processing fields on the device (``SpecDecoder(..., fields=True)``: needs
        ``sampling``), so requests may set ``logit_bias``, the penalties, ``min_p``,
        ``min_tokens`` and ``ignore_eos``; without it such a request is refused at submission.
    prefill_chunk : int, optional
        At most this many prompt tokens are prefilled per burst boundary; a longer prompt
        is prefilled in chunks over several boundaries while the other slots keep decoding
        (both models must declare ``chunked_prefill``). None: whole prompts at once.
    admission : {"auto", "early", "late"}
        Pipelined: whether a step admits waiting requests before refilling the pipeline
        (their first burst comes one burst sooner) or after it (the GPU keeps a full queue
        while the host admits); ``auto`` picks early once bursts outlast admissions
        (:meth:`~graphburst.serving.admit.AdmissionSchedule.admit_early`), and while bursts are
        shorter than admissions lets a boundary due right after one wait a burst
        (:meth:`~graphburst.serving.admit.AdmissionSchedule.defer_boundary`). A policy without
        ``local_timing`` makes ``auto`` late.
    policy : LoopPolicy, optional
        How the decoder and graph are built and what the loop may decide on its own
        (:mod:`~graphburst.serving.policy`); default a :class:`~graphburst.serving.policy.LocalPolicy`.
    device_exit : {False, True, "auto", "ladder"}
        Graph engine: bursts whose rounds run in a conditional WHILE node that ends at the round
        where every slot is done, or where the loop asked it to stop (``BurstGraph(...,
        device_exit=..., hold_stops=True)``). A request arriving while bursts run (:meth:`submit`,
        or :meth:`request_round_exit` from another thread) sets the stop flag when a slot is free:
        the burst running ends at its next round, those queued behind it run none, the next step
        admits the request and answers the flag, and the bursts launched after that run whole. So a
        new request waits about one round for its prefill, not every burst in flight. ``"auto"``
        falls back to a ladder where WHILE graphs cannot be built (:attr:`device_exit` and
        :attr:`ladder` say which runs); True raises ValueError there. ``"ladder"``: the ladder
        whatever the device has: fixed-length graphs of 1, 2, 4, ..., M rounds, each burst as
        long as the queue wants (one round while a request waits for a free slot; about
        :data:`LADDER_FREE_SLOT_MS` while a slot is free; else M, or fewer where every slot
        finishes sooner: :class:`LadderRounds`). Needs a policy with ``local_timing`` (each process stops its bursts
        on its own arrivals).

    Attributes
    ----------
    intake : RequestIntake
        Validation at submission, request ids, the queue of requests waiting for a slot.
    pipeline : BurstPipeline
        The bursts in flight (launch, refill, drain).
    table, record, schedule, boundary, first_tokens, delivery
        The loop's other parts (the module's docstring says what each does).
    heartbeat_s : float or None
        The policy's: a driver steps an idle loop at least this often (None: a plain loop,
        stepped only when there is work).
    log : list or None
        None (the default) or a list of :mod:`~graphburst.serving.events` the loop appends
        to, in order, for a consumer that forwards tokens elsewhere (JSONL writer, HTTP
        engine thread): a :class:`~.events.Tokens` per drained burst and per batch of
        first tokens handed out, an
        :class:`~.events.Admitted` when a request takes a slot, a :class:`~.events.Retired`
        when one finishes for any reason. The consumer empties it.
    """

    def __init__(self, target, draft, *, k: int, m_rounds: int, engine: str = "graph", pipelined: bool = True,
                 depth: int = 2, sampling: bool = False, prefill_chunk: int | None = None, admission: str = "auto",
                 policy: LoopPolicy | None = None, fields: bool = False, device_exit: bool | str = False,
                 spec_max_batch: int | None = None):
        self.policy = policy = check_policy(policy)
        engine = BurstMode.parse(engine, SERVE_MODES, name="engine")
        depth = check_int("depth", depth, minimum=2, maximum=MAX_DEPTH)
        admission = check_admission(admission, local_timing=policy.local_timing)
        check_device_exit(device_exit, engine=engine, local_timing=policy.local_timing)
        self.heartbeat_s = policy.heartbeat_s
        self.sampling = bool(sampling)
        self.prefill_chunk = check_prefill_chunk(prefill_chunk, target, draft)
        self.fields = bool(fields)
        # Requests may ask for fewer drafts (the option "k"), and spec_max_batch switches speculation
        # off above a batch size: one small launch a round (engine/draft_caps.py)
        self.dec = dec = policy.make_decoder(target, draft, k=k, m_rounds=m_rounds, sampling=self.sampling,
                                             draft_caps=True, spec_max_batch=spec_max_batch,
                                             **({"fields": True} if self.fields else {}))
        self.engine = engine
        make_graph = functools.partial(policy.make_graph, dec)
        if _is_ladder(device_exit):  # a policy without local timing was refused above
            make_graph = functools.partial(make_graph, ladder=True)
        elif device_exit is not False:
            make_graph = functools.partial(make_graph, device_exit=device_exit, hold_stops=True,
                                           **({"ladder": True} if device_exit == "auto" else {}))
        self.pipeline = BurstPipeline(dec, engine, pipelined, make_graph=make_graph, depth=depth)
        #: bursts end on the device (a WHILE-node graph that holds stops): what ``device_exit`` gave
        self.device_exit = bool(self.pipeline.graph is not None and self.pipeline.graph.device_exit)
        #: bursts of the lengths of a ladder, picked per burst (``pipeline.rounds_for``: a LadderRounds)
        self.ladder = self.pipeline.ladder
        # Every admission graph a request can take, captured now, not by its first request: the process's
        # first capture took 14 ms on an H200, later ones ~0.1 ms, and a prefill that cannot be captured
        # shows here (engine/admission/graphs.py; nothing for decoders that admit eagerly)
        dec.warm_admission_graphs(chunk=self.prefill_chunk)
        self.pipelined = self.pipeline.pipelined
        self.graph = self.pipeline.graph
        self.vocab = target.vocab
        self.intake = RequestIntake(vocab=self.vocab, capacity=dec.capacity, sampling=self.sampling,
                                    slot_options=dec.slot_options, replays_ids=policy.replays_ids, fields=self.fields)
        # The parts, each handed what it uses
        self.table = SlotTable(dec.batch, dec.capacity, dec.bufs.ring_capacity)
        if self.ladder:
            self.pipeline.rounds_for = LadderRounds(self.table, self.intake, dec)
        self.record = LoopRecord()
        self.first_tokens = FirstTokens(self.table, self.record, dec, self.pipeline)
        self.delivery = Delivery(self.table, self.record, dec, self.intake, self.first_tokens)
        self.schedule = AdmissionSchedule(admission, table=self.table, intake=self.intake, pipeline=self.pipeline,
                                          early_first_tokens=policy.early_first_tokens)
        self.boundary = Boundary(table=self.table, dec=dec, intake=self.intake, pipeline=self.pipeline,
                                 schedule=self.schedule, first_tokens=self.first_tokens, record=self.record,
                                 retire=self.delivery.retire, costs_only_its_requests=policy.costs_only_its_requests,
                                 prefill_chunk=self.prefill_chunk, sampling=self.sampling)
        self.started = time.perf_counter()
        self._lock = None
        # With device exit: the stop-request count read when every request that asked for those stops
        # had reached the intake (mark_intake); None: read at each admission (requests submitted on the
        # thread that steps the loop are in the intake before any step sees their stops)
        self._stops_in_intake: int | None = None

    # ------------------------------------------------------------------ requests

    def submit(self, req: Request, *, line: int | None = None, round_exit: bool = True) -> RequestState:
        """Queue a request, validated now (:meth:`RequestIntake.submit`); admitted at a burst boundary
        (with :attr:`device_exit`, at the next round: :meth:`request_round_exit`, unless ``round_exit``
        is False: the HTTP engine asked for it when the request arrived, see :meth:`mark_intake`)."""
        state = self.intake.submit(req, line=line)
        if round_exit:
            self.request_round_exit()
        return state

    def request_round_exit(self) -> None:
        """With :attr:`device_exit` and a batch slot free: ask the bursts in flight to end at their next
        round, so the next step admits a request that just arrived. Safe from any thread (one store to
        mapped host memory; the slot count is read, never changed); does nothing otherwise."""
        if self.device_exit and self.table.n_occupied < self.table.batch:
            self.dec.request_stop()

    def mark_intake(self) -> None:
        """A thread that moves requests into this loop from elsewhere (the HTTP engine thread) calls
        this just before it submits the ones that arrived so far, under the lock their senders held
        when they asked for a round exit after queuing them: the stops asked for until now are those
        requests', so the next admission may answer them. A stop asked for later stays pending until
        an admission that follows its request's submission answers it, so no request's stop is
        answered by an admission that could not take it (its wait would be a whole burst)."""
        if self.device_exit:
            self._stops_in_intake = self.dec.stop_requests

    def validate(self, req: Request) -> Request:
        """:meth:`RequestIntake.validate`: ValueError/TypeError naming a bad field; ``req`` is not changed."""
        return self.intake.validate(req)

    def check_sampling(self, req: Request) -> SamplingParams:
        """:meth:`RequestIntake.check_sampling`."""
        return self.intake.check_sampling(req)

    def cancel(self, state: RequestState) -> None:
        """Cancel a request: from now on it receives no token, and it is done.

        Its slot is freed at the next burst boundary; tokens of bursts already in
        flight for it are dropped. Cancelling a finished request changes nothing.
        """
        if state.done:
            return
        state.cancelled = True
        self.delivery.retire(state)

    def withdraw(self, state: RequestState) -> None:
        """Undo the submission of a request not yet admitted: out of the queue, finished (not
        cancelled: the caller refused it after all), its id free again."""
        self.intake.withdraw(state)
        self.delivery.retire(state)

    @property
    def log(self) -> list | None:
        return self.record.log

    @log.setter
    def log(self, events: list | None) -> None:
        self.record.log = events

    @property
    def bursts(self) -> int:
        """Bursts drained and handed out."""
        return self.record.bursts

    @property
    def tokens_out(self) -> int:
        """Tokens handed out."""
        return self.record.tokens_out

    @property
    def errors(self) -> int:
        """Requests the loop finished with an error."""
        return self.record.errors

    @property
    def active(self) -> int:
        return self.table.n_occupied

    @property
    def idle(self) -> bool:
        """Nothing queued, running or in flight."""
        return not self.intake.queue and self.table.n_occupied == 0 and not self.pipeline

    # ------------------------------------------------------------------ the loop

    def step(self) -> int:
        """One iteration: admit, run a burst, drain, stream tokens, free finished slots.

        Pipelined, ``depth`` bursts stay in flight: the oldest is drained, the next enqueued,
        then the drained tokens handed out and finished slots refilled behind the bursts in
        flight (late admission), or handed out and refilled before the next is enqueued
        (early: it carries the new slots). A step that finds first tokens due before the
        oldest burst hands out only those (first_tokens.py). Returns the tokens delivered.

        An exception inside the iteration finishes the requests it touches with an
        error (those of the slots it names, else every running one) and is not raised;
        tokens already delivered stay, and bursts in flight still deliver to the rest.
        Only a failure of the recovery itself (the device is unusable), or one the policy
        says must not be recovered from (``costs_only_its_requests``), propagates.
        """
        try:
            return self._step()
        except Exception as exc:  # noqa: BLE001 - a serving loop outlives one request's failure
            if not self.policy.costs_only_its_requests(exc):
                raise
            return self._recover(exc)

    def _recover(self, exc: Exception) -> int:
        msg = describe(exc)
        table, retire = self.table, self.delivery.retire
        slots = table.slots
        named = [b for b in getattr(exc, "slots", ()) if 0 <= b < len(slots) and slots[b] is not None]
        touched = named or table.held_slots()
        now = time.perf_counter()
        for b in touched:
            retire(slots[b], now, error=msg)
        delivered = 0
        pipeline = self.pipeline
        if self.graph is not None:
            while pipeline:  # launched bursts still hold the other requests' tokens
                delivered += self.first_tokens.hand_out(pipeline.oldest)  # first tokens before their bursts
                delivered += self.delivery.deliver(*pipeline.drain())
        if self.dec.outstanding:  # a burst failed part-way through being enqueued
            self.dec.abandon_enqueued()
        self.boundary.run()
        return delivered

    def _step(self) -> int:
        # Each decision below is the schedule's or the first tokens' (what this step does next),
        # each application a part's (the boundary, the pipeline, delivery). A decision is taken
        # where its inputs exist: the admission order needs the drained burst's GPU time, whether
        # a boundary is due the slots its delivery freed.
        pipeline, table = self.pipeline, self.table
        if not pipeline and table.n_occupied == 0:
            # Nothing runs and no request holds a slot: the GPU's next gap is the loop
            # waiting for work, not host overhead between bursts, so it is not counted.
            pipeline.clock.forget_gap()
        if self.device_exit:
            return self._step_device_exit()
        if self.graph is None:
            self.boundary.run()
            # Every copy precedes the next burst: hand its tokens out first, then run the burst in the
            # same step (returning in between would let a stream of admissions hold every burst back).
            delivered = self.first_tokens.hand_out(pipeline.launched)
            return delivered + (self.delivery.deliver(*pipeline.run_eager(table.steady()))
                                if table.running.any() else 0)
        if not pipeline:  # nothing in flight (always so unpipelined): admit before launching
            self.boundary.run()
        steady = table.steady()
        pipeline.fill(steady)
        if not pipeline:
            return 0  # no live slot (prompts still being prefilled, or none at all)
        if self.first_tokens.due(pipeline.oldest):
            # Admitted requests' first tokens are ready no later than the oldest burst in flight:
            # wait for them instead, and return, so a consumer forwards them before the burst.
            return self.first_tokens.hand_out(pipeline.oldest)
        drained = pipeline.drain()
        if self.pipelined and self.schedule.admit_early():  # the bursts still queued outlast admission
            delivered = self.delivery.deliver(*drained)
            if self.schedule.boundary_due():
                self.boundary.run()
            pipeline.fill(table.steady())
            return delivered
        # Refill before handing the drained tokens out: while the host delivers burst n,
        # bursts n+1 and n+2 are both queued, so the GPU has work even if delivery is slow.
        try:
            if self.pipelined:
                pipeline.fill(steady)
        finally:  # a launch that fails (a capacity error, say) must not lose the drained tokens
            delivered = self.delivery.deliver(*drained)
        if self.pipelined and self.schedule.boundary_due():
            # Admission without draining: the boundary's writes queue behind the bursts in
            # flight, and the next launch carries the new slots.
            self.boundary.run()
        return delivered

    def _step_device_exit(self) -> int:
        # Bursts end on the device, and stop requests hold every burst launched before their
        # answer at zero rounds. A step admits where a stop is pending (a request came, or the last
        # delivery freed a slot someone waits for), answers it behind the admission, then refills,
        # so the bursts launched from here run whole. A prompt part-way through a chunked prefill
        # takes its next chunk behind the bursts in flight, as the late order does, without a stop.
        pipeline, table, dec = self.pipeline, self.table, self.dec
        if not pipeline and table.n_occupied == 0:
            pipeline.clock.forget_gap()  # as in _step: the loop waited for work
        if dec.stop_pending or not pipeline or table.prefilling:
            # the stops whose requests this admission can take (see mark_intake): read before it runs
            upto = dec.stop_requests if self._stops_in_intake is None else self._stops_in_intake
            self.boundary.run()
            if dec.stop_pending:
                dec.answer_stop(upto)
        steady = table.steady()
        pipeline.fill(steady)
        if not pipeline:
            return 0
        if self.first_tokens.due(pipeline.oldest):
            return self.first_tokens.hand_out(pipeline.oldest)
        drained = pipeline.drain()
        try:
            if not dec.stop_pending:  # else the bursts launched now would run zero rounds
                pipeline.fill(steady)
        finally:  # a launch that fails must not lose the drained tokens
            delivered = self.delivery.deliver(*drained)
        if not dec.stop_pending and self.intake.queue and table.n_occupied < table.batch:
            dec.request_stop()  # the delivery freed a slot a request waits for: admit it at the next round
        return delivered

    def run_until_idle(self) -> None:
        """Serve until every submitted request has finished and nothing is in flight."""
        while not self.idle:
            self.step()

    # ------------------------------------------------------------------ streaming

    def stream(self, state: RequestState) -> Iterator[int]:
        """Yield a request's tokens as they arrive, driving the loop when none are buffered."""
        while True:
            yield from state._take_new()
            if state.done:
                return
            self.step()

    async def astream(self, state: RequestState) -> AsyncIterator[int]:
        """Asyncio form of :meth:`stream`: bursts run in a worker thread, one at a time."""
        lock = self._async_lock()
        while True:
            for t in state._take_new():
                yield t
            if state.done:
                return
            async with lock:
                if state.n_tokens == state._read and not state.done:
                    await asyncio.to_thread(self.step)

    def _async_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        """Loop-level counters: bursts, tokens/s, GPU-idle fraction between bursts.

        ``admission_graphs``: admission graphs captured (at construction, and again after a
        ``refresh_tables``). ``deferred_boundaries``: boundaries ``auto`` admission let wait a burst to coalesce
        them with the next (:meth:`AdmissionSchedule.defer_boundary`). ``gpu_idle_fraction``
        counts every gap while a request held a slot;
        ``gpu_idle_fraction_steady`` only the gaps before bursts launched with every
        batch slot running (ramp-up and ramp-down left out); ``gpu_admission_fraction``
        is the part of ``gpu_idle_fraction`` spent in admission spans (prefill:
        :mod:`~graphburst.serving.timing`). None without GPU timing.
        """
        elapsed = time.perf_counter() - self.started
        clock, record = self.pipeline.clock, self.record
        return {
            "bursts": record.bursts,
            "tokens": record.tokens_out,
            "tokens_per_s": record.tokens_out / elapsed if elapsed > 0 else 0.0,
            "active_slots": self.active,
            "queued": len(self.intake),
            "errors": record.errors,
            "gpu_idle_fraction": clock.overall.idle_fraction,
            "gpu_idle_fraction_steady": clock.steady.idle_fraction,
            "gpu_admission_fraction": clock.overall.admission_fraction,
            "steady_bursts": clock.steady.bursts,
            "captures": self.graph.captures if self.graph is not None else 0,
            "admission_graphs": 0 if self.dec.admission_graphs is None else self.dec.admission_graphs.captures,
            "deferred_boundaries": self.schedule.deferred_boundaries,
            "device_exit": self.device_exit,
            "burst_rounds": self.pipeline.rounds,
            "rounds_per_burst": self.pipeline.rounds / record.bursts if record.bursts else None,
            "burst_exits": dict(self.pipeline.exits),
            "ladder": self.ladder,
            "ladder_bursts": {str(r): n for r, n in self.pipeline.rungs.items()},
        }

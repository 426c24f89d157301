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

The parts the loop owns: its intake (``loop.intake``: validation at submission, ids, the
waiting queue; :mod:`graphburst.serving.intake`), its pipeline (``loop.pipeline``: the
bursts in flight; :mod:`graphburst.serving.pipeline`) and its per-slot token rows
(:mod:`graphburst.serving.slot_tokens`); requests are :mod:`graphburst.serving.request`,
timing figures :mod:`graphburst.serving.timing`, and what a step did is told as typed events
(:mod:`graphburst.serving.events`). This module holds the loop itself: the step,
cancellation, a request's retirement, streaming and the loop's counters; the boundary
(freeing, admission, chunked prefill) is :mod:`graphburst.serving.admit`, and handing a drained
burst's tokens out :mod:`graphburst.serving.delivery`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np

from ..engine.mode import BurstMode
from ..engine.decoder import SpecDecoder
from ..engine import host_ops
from ..capture import BurstGraph
from ..constants import MAX_DEPTH
from ..sampling.params import SamplingParams
from ..validate import check_int
from .admit import ADMISSION_WINDOW, NO_RECENT_ADMISSION, LoopAdmission, check_admission, check_prefill_chunk, describe
from .delivery import LoopDelivery
from .events import Retired
from .first_tokens import NO_COPY, FirstTokenCopies, LoopFirstTokens
from .intake import RequestIntake
from .pipeline import BurstPipeline, graph_of
from .request import Request, RequestState
from .slot_tokens import SlotTokens
from .timing import inter_token_latencies_us, percentiles

SERVE_MODES = (BurstMode.GRAPH, BurstMode.PER_ROUND_SYNC)  # ``pipelined`` makes the graph engine gapless
ENGINE_MODES = tuple(m.value for m in SERVE_MODES)  # --engine choices

__all__ = ["ENGINE_MODES", "SERVE_MODES", "Request", "RequestState", "ServeLoop", "inter_token_latencies_us",
           "percentiles"]


class ServeLoop(LoopAdmission, LoopFirstTokens, LoopDelivery):
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
    prefill_chunk : int, optional
        At most this many prompt tokens are prefilled per burst boundary; a longer prompt
        is prefilled in chunks over several boundaries while the other slots keep decoding
        (both models must declare ``chunked_prefill``). None: whole prompts at once.
    admission : {"auto", "early", "late"}
        Pipelined: whether a step admits waiting requests before refilling the pipeline
        (their first burst comes one burst sooner) or after it (the GPU keeps a full queue
        while the host admits); ``auto`` picks early once bursts outlast admissions
        (:meth:`~graphburst.serving.admit.LoopAdmission._admit_early`), and while bursts are
        shorter than admissions lets a boundary due right after one wait a burst (``_defer_boundary``).

    Attributes
    ----------
    intake : RequestIntake
        Validation at submission, request ids, the queue of requests waiting for a slot.
    pipeline : BurstPipeline
        The bursts in flight (launch, refill, drain).
    log : list or None
        None (the default) or a list of :mod:`~graphburst.serving.events` the loop appends
        to, in order, for a consumer that forwards tokens elsewhere (JSONL writer, HTTP
        engine thread): a :class:`~.events.Tokens` per drained burst and per batch of
        first tokens handed out, an
        :class:`~.events.Admitted` when a request takes a slot, a :class:`~.events.Retired`
        when one finishes for any reason. The consumer empties it.
    """

    #: True where request ids come from a loop that made them up already (a lockstep follower):
    #: the intake then takes ids of the made-up form.
    replays_ids = False
    #: Hand first tokens out after the prefill (first_tokens.py); False: with the first burst.
    early_first_tokens = True

    def __init__(self, target, draft, *, k: int, m_rounds: int, engine: str = "graph", pipelined: bool = True,
                 depth: int = 2, sampling: bool = False, prefill_chunk: int | None = None, admission: str = "auto"):
        engine = BurstMode.parse(engine, SERVE_MODES, name="engine")
        depth = check_int("depth", depth, minimum=2, maximum=MAX_DEPTH)
        self.admission = check_admission(admission)
        self._admission_ms = collections.deque(maxlen=ADMISSION_WINDOW)  # host ms of the last admissions
        self._typical_admission_ms = None  # their median (None before the first)
        self._admitted_at = NO_RECENT_ADMISSION  # pipeline.launched at the last admission (coalescing: admit.py)
        self._deferrals = 0  # boundaries deferred since that admission
        self.deferred_boundaries = 0  # boundaries auto admission let wait a burst (LoopAdmission._defer_boundary)
        self.sampling = bool(sampling)
        self.prefill_chunk = check_prefill_chunk(prefill_chunk, target, draft)
        self.dec = self._make_decoder(target, draft, k=k, m_rounds=m_rounds, sampling=self.sampling)
        self.engine = engine
        self.pipeline = BurstPipeline(self.dec, engine, pipelined, make_graph=self._make_graph, depth=depth)
        # Every admission graph a request can take, captured now, not by its first request: the process's
        # first capture took 14 ms on an H200, later ones ~0.1 ms, and a prefill that cannot be captured
        # shows here (engine/admission/graphs.py; nothing for decoders that admit eagerly)
        self.dec.warm_admission_graphs(chunk=self.prefill_chunk)
        self.pipelined = self.pipeline.pipelined
        self.graph = self.pipeline.graph
        self.vocab = target.vocab
        batch = self.dec.batch
        self.slots: list[RequestState | None] = [None] * batch
        self._slot_state = np.full(batch, None, object)  # [B] object: slots, indexable by an array of slots
        # Tokens land in per-slot rows (one vectorised copy per burst); a request's
        # Python list is built when read or when it finishes.
        self.store = SlotTokens(batch, self.dec.capacity, self.dec.bufs.ring_capacity)
        self._running = np.zeros(batch, bool)  # [B] slot holds a request that is not done
        # _deliver's masks go into scratch arrays, and every slot receiving (the steady state)
        # reuses one read-only row list: each numpy temporary or Python-scalar operand costs
        # about a microsecond between bursts, while the GPU may wait.
        self._receiving = np.zeros(batch, bool)  # [B] bool scratch
        self._finished = np.zeros(batch, bool)  # [B] bool scratch
        self._no_left = np.zeros(batch, np.int64)  # [B] int64 constant 0
        self._every_slot = np.arange(batch)  # [B] int64: rows when every slot receives
        self._every_slot.setflags(write=False)  # Tokens events hand it to consumers
        # A graph's drained bursts are handed out in C (host_ops.c) where the decoder drains in C
        self._c_store = None if self.dec.host_mirror is None else self.store.in_c(
            host_ops.library(), running=self._running, left=self.dec.host_left, receiving=self._receiving,
            finished=self._finished)
        self._n_occupied = 0  # slots holding a request (done or not)
        self._n_stale = 0  # slots holding a request that is done: freed at the next boundary
        # Slots whose prompt is still being prefilled (admission order): slot -> prompt tokens
        # already in the caches. Such a slot holds its request but is idle in bursts.
        self._prefilling: dict[int, int] = {}
        # First tokens are handed out once the prefill has made them (first_tokens.py), and
        # dropped from the head of the slot's first drained ring row.
        self._first = FirstTokenCopies(self.dec.backend, batch)
        self._first_copy = np.full(batch, NO_COPY, np.int64)  # [B] int64: the copy holding the slot's first token
        self._lead = np.zeros(batch, bool)  # [B] bool: first token handed out; its first burst not yet drained
        self._n_lead = 0  # slots with _lead set
        self.intake = RequestIntake(vocab=self.vocab, capacity=self.dec.capacity, sampling=self.sampling,
                                    slot_options=self.dec.slot_options, replays_ids=self.replays_ids)
        self.log: list | None = None
        self.errors = 0  # requests finished with an error by the loop
        self.bursts = 0
        self.tokens_out = 0
        self.started = time.perf_counter()
        self._lock = None

    # Hooks for graphburst.parallel.lockstep (tensor-parallel serving): its loop builds a
    # ParallelDecoder and a CheckedGraph here; everything else in the loop is unchanged.

    def _make_decoder(self, target, draft, **kw) -> SpecDecoder:
        return SpecDecoder(target, draft, **kw)

    def _make_graph(self, *, depth: int) -> BurstGraph:
        return graph_of(self.dec, depth=depth)

    # ------------------------------------------------------------------ requests

    def submit(self, req: Request, *, line: int | None = None) -> RequestState:
        """Queue a request, validated now (:meth:`RequestIntake.submit`); admitted at a burst boundary."""
        return self.intake.submit(req, line=line)

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
        self._retire(state)

    def _retire(self, state: RequestState, now: float | None = None, error: str | None = None) -> None:
        """Mark a request finished (once) and forget its id."""
        if state.done:
            return
        if error is not None:
            state.error = error
            self.errors += 1
        if state._store is not None:
            self._running[state.slot] = False  # no later burst's tokens reach it
            self._n_stale += 1  # its slot is freed at the next boundary
            state._detach()
        state.finished = now or time.perf_counter()
        self.intake.forget(state)
        if self.log is not None:
            self.log.append(Retired(state))

    @property
    def active(self) -> int:
        return self._n_occupied

    @property
    def idle(self) -> bool:
        """Nothing queued, running or in flight."""
        return not self.intake.queue and self._n_occupied == 0 and not self.pipeline

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
        Only a failure of the recovery itself (the device is unusable) propagates.
        """
        try:
            return self._step()
        except Exception as exc:  # noqa: BLE001 - a serving loop outlives one request's failure
            return self._recover(exc)

    def _recover(self, exc: Exception) -> int:
        msg = describe(exc)
        named = [b for b in getattr(exc, "slots", ()) if 0 <= b < len(self.slots) and self.slots[b] is not None]
        touched = named or [b for b, s in enumerate(self.slots) if s is not None]
        now = time.perf_counter()
        for b in touched:
            self._retire(self.slots[b], now, error=msg)
        delivered = 0
        pipeline = self.pipeline
        if self.graph is not None:
            while pipeline:  # launched bursts still hold the other requests' tokens
                delivered += self._hand_out_first(pipeline.oldest)  # first tokens before their bursts
                delivered += self._deliver(*pipeline.drain())
        if self.dec.outstanding:  # a burst failed part-way through being enqueued
            self.dec.abandon_enqueued()
        self._boundary()
        return delivered

    def _steady(self) -> bool:
        """Every batch slot runs a request (the window of the steady-state idle figure)."""
        return self._n_occupied == self.dec.batch and self._n_stale == 0

    def _step(self) -> int:
        pipeline = self.pipeline
        if not pipeline and self._n_occupied == 0:
            # Nothing runs and no request holds a slot: the GPU's next gap is the loop
            # waiting for work, not host overhead between bursts, so it is not counted.
            pipeline.clock.forget_gap()
        if self.graph is None:
            self._boundary()
            # Every copy precedes the next burst: hand its tokens out first, then run the burst in the
            # same step (returning in between would let a stream of admissions hold every burst back).
            delivered = self._hand_out_first(pipeline.launched)
            return delivered + (self._deliver(*pipeline.run_eager(self._steady())) if self._running.any() else 0)
        delivered = 0
        if not pipeline:  # nothing in flight (always so unpipelined): admit before launching
            self._boundary()
        steady = self._steady()
        pipeline.fill(steady)
        if not pipeline:
            return delivered  # no live slot (prompts still being prefilled, or none at all)
        if self._first.due(pipeline.oldest):
            # Admitted requests' first tokens are ready no later than the oldest burst in flight:
            # wait for them instead, and return, so a consumer forwards them before the burst.
            return self._hand_out_first(pipeline.oldest)
        drained = pipeline.drain()
        if self.pipelined and self._admit_early():  # the bursts still queued outlast admission
            delivered += self._deliver(*drained)
            if self._boundary_due():
                self._boundary()
            pipeline.fill(self._steady())
            return delivered
        # Refill before handing the drained tokens out: while the host delivers burst n,
        # bursts n+1 and n+2 are both queued, so the GPU has work even if delivery is slow.
        try:
            if self.pipelined:
                pipeline.fill(steady)
        finally:  # a launch that fails (a capacity error, say) must not lose the drained tokens
            delivered += self._deliver(*drained)
        if self.pipelined and self._boundary_due():
            # Admission without draining: the boundary's writes queue behind the bursts in
            # flight, and the next launch carries the new slots.
            self._boundary()
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
        them with the next (:meth:`LoopAdmission._defer_boundary`). ``gpu_idle_fraction``
        counts every gap while a request held a slot;
        ``gpu_idle_fraction_steady`` only the gaps before bursts launched with every
        batch slot running (ramp-up and ramp-down left out); ``gpu_admission_fraction``
        is the part of ``gpu_idle_fraction`` spent in admission spans (prefill:
        :mod:`~graphburst.serving.timing`). None without GPU timing.
        """
        elapsed = time.perf_counter() - self.started
        clock = self.pipeline.clock
        return {
            "bursts": self.bursts,
            "tokens": self.tokens_out,
            "tokens_per_s": self.tokens_out / elapsed if elapsed > 0 else 0.0,
            "active_slots": self.active,
            "queued": len(self.intake),
            "errors": self.errors,
            "gpu_idle_fraction": clock.overall.idle_fraction,
            "gpu_idle_fraction_steady": clock.steady.idle_fraction,
            "gpu_admission_fraction": clock.overall.admission_fraction,
            "steady_bursts": clock.steady.bursts,
            "captures": self.graph.captures if self.graph is not None else 0,
            "admission_graphs": 0 if self.dec.admission_graphs is None else self.dec.admission_graphs.captures,
            "deferred_boundaries": self.deferred_boundaries,
        }

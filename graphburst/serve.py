"""A replay loop for a serving process: continuous batching over one captured burst graph.

One :class:`BurstGraph` is captured at start-up per (batch slots, k, M) and replayed for
the life of the process. Between bursts the loop admits waiting requests into free
slots (prefill and slot reset are host-to-device writes into the fixed buffers plus the
model's prefill kernels: no recapture, no allocation), then replays, drains and streams
each request's new tokens. Stops (EOS, max_new_tokens) happen on the device, mid-round if need be, so no
token past a stop ever reaches the ring; a finished or idle slot has budget 0 and emits
nothing.

A failure inside :meth:`ServeLoop.step` costs only the requests it touches: they finish
with ``error`` set (``finish_reason == "error"``), the tokens already handed out stay,
and the loop goes on serving the others.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import secrets
import statistics
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np

from .burst import SpecDecoder
from .capture import BurstGraph
from .constants import UNBOUNDED_BUDGET
from .slot_tokens import SlotTokens
from .sampling_params import SamplingParams, check_sampling
from .validate import check_int, check_prompt

ENGINE_MODES = ("graph", "eager_sync")


@dataclasses.dataclass
class Request:
    """One generation request.

    Parameters
    ----------
    prompt : sequence of int or 1-D integer array
        Non-empty, tokens in ``[0, vocab)`` (numpy integers accepted).
    max_new_tokens : int
        >= 1.
    eos : int, optional
        Stop after emitting this token.
    options : dict, optional
        Per-request model options (protocol ``option_keys``), for example the stub
        draft's ``{"accept_prob": 0.9, "seed": 7}``. A key no model claims is refused.
    id : str, optional
        Made up when absent; never equal to the id of another request in flight.
    temperature, top_k, top_p, seed : optional
        Sampling settings (``sampling_params.check_sampling``); None: greedy (temperature
        0), filters off. Temperature > 0 needs ``ServeLoop(..., sampling=True)``; a
        sampled request without a seed gets a random one (``RequestState.sampling``).
    """

    prompt: list
    max_new_tokens: int
    eos: int | None = None
    id: str | None = None
    options: dict | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None


@dataclasses.dataclass(eq=False)
class RequestState:
    """A request in flight: its tokens so far and its timings (perf_counter seconds).

    While the request holds a batch slot its tokens, deliveries and accept counters live
    in the loop's :class:`~graphburst.slot_tokens.SlotTokens` rows (filled with one
    vectorised copy per burst) and the properties below read them; when it finishes
    they are copied out once into plain Python values.
    """

    request: Request
    slot: int | None = None
    submitted: float = 0.0
    finished: float | None = None
    cancelled: bool = False
    error: str | None = None  # why the loop gave up on this request; None unless finish_reason == "error"
    line: int | None = None  # the input line it came from (JSONL serving), if any
    slot_options: object = None  # the models' validated view of request.options (SpecDecoder.slot_options)
    sampling: SamplingParams | None = None  # validated sampling settings, seed filled in (ServeLoop.check_sampling)
    _store: SlotTokens | None = None  # the loop's rows while this request runs in ``slot``
    _tokens: list = dataclasses.field(default_factory=list)  # once finished (or before admission)
    _deliveries: list = dataclasses.field(default_factory=list)
    _acc: tuple = (0, 0)
    _read: int = 0  # tokens already yielded by ServeLoop.stream/astream

    # ------------------------------------------------------------------ reads

    @property
    def tokens(self) -> list:
        """Every token delivered so far (a new list while running; the final list once done)."""
        return self._tokens if self._store is None else self._store.read(self.slot)

    @property
    def n_tokens(self) -> int:
        """``len(tokens)`` without building the list."""
        return len(self._tokens) if self._store is None else int(self._store.n[self.slot])

    def tokens_since(self, start: int) -> list:
        """``tokens[start:]``, reading only the new part."""
        return self._tokens[start:] if self._store is None else self._store.read(self.slot, start)

    @property
    def deliveries(self) -> list:
        """``[(time, n_tokens), ...]``, one per burst that delivered tokens to this request."""
        return self._deliveries if self._store is None else self._store.deliveries(self.slot)

    @property
    def last_delivery(self) -> float | None:
        """Time of the latest delivery, None before the first."""
        if self._store is not None:
            return self._store.last_time(self.slot)
        return self._deliveries[-1][0] if self._deliveries else None

    @property
    def first_token(self) -> float | None:
        if self._store is not None:
            return self._store.first_time(self.slot)
        return self._deliveries[0][0] if self._deliveries else None

    @property
    def accepted(self) -> int:
        """Drafts accepted, from the device counters."""
        return int(self._store.acc[self.slot, 0]) if self._store is not None else self._acc[0]

    @property
    def rounds(self) -> int:
        return int(self._store.acc[self.slot, 1]) if self._store is not None else self._acc[1]

    def _detach(self) -> None:
        """Copy this request's values out of the loop's rows (it is leaving its slot)."""
        store, b = self._store, self.slot
        if store is None:
            return
        self._tokens = store.read(b)
        self._deliveries = store.deliveries(b)
        self._acc = (int(store.acc[b, 0]), int(store.acc[b, 1]))
        self._store = None

    def _take_new(self) -> list:
        """Tokens not yet yielded to a stream consumer."""
        new = self.tokens_since(self._read)
        self._read += len(new)
        return new

    @property
    def done(self) -> bool:
        return self.finished is not None

    @property
    def finish_reason(self) -> str | None:
        """``"eos"``, ``"length"``, ``"cancelled"`` or ``"error"``; None while running."""
        if not self.done:
            return None
        if self.error is not None:
            return "error"
        if self.cancelled:
            return "cancelled"
        eos = self.request.eos
        if eos is not None and self._tokens and self._tokens[-1] == eos:
            return "eos"
        return "length"

    def stats(self) -> dict:
        """Time to first token, tokens/s and mean accepted drafts per round."""
        first = self.first_token
        ttft = None if first is None else (first - self.submitted) * 1e3
        # Tokens arrive a burst at a time, so rate is taken over the request's whole life.
        span = (self.finished or time.perf_counter()) - self.submitted
        rounds = self.rounds
        return {
            "ttft_ms": ttft,
            "tokens_per_s": self.n_tokens / span if span > 0 else None,
            "accepted_per_round": self.accepted / rounds if rounds else None,
        }


class ServeLoop:
    """Continuous batching of requests over one captured burst graph.

    Parameters
    ----------
    target, draft : the models (a stub draft gets per-request acceptance and seed)
    k, m_rounds : int
    engine : {"graph", "eager_sync"}
        ``eager_sync`` runs the same loop through eager bursts that sync every round,
        for comparison.
    pipelined : bool
        Graph engine only: keep a second burst in flight (gapless drain) while the host
        hands out the previous burst's tokens.
    sampling : bool
        Decode with speculative rejection sampling, so requests may ask for temperature
        > 0 (the models must support it; see ``SpecDecoder``). Without it such a request
        is refused at submission.
    """

    def __init__(self, target, draft, *, k: int, m_rounds: int, engine: str = "graph", pipelined: bool = True,
                 sampling: bool = False):
        if engine not in ENGINE_MODES:
            raise ValueError(f"engine must be one of {ENGINE_MODES}, got {engine!r}")
        self.sampling = bool(sampling)
        self.dec = self._make_decoder(target, draft, k=k, m_rounds=m_rounds, sampling=self.sampling)
        self.engine = engine
        self.pipelined = bool(pipelined) and engine == "graph"
        self.graph = self._make_graph(gapless=self.pipelined) if engine == "graph" else None
        self._in_flight: collections.deque = collections.deque()  # timing events per burst in flight
        self._launched = 0
        self.vocab = target.vocab
        self.slots: list[RequestState | None] = [None] * self.dec.batch
        # Tokens land in per-slot rows (one vectorised copy per burst); a request's
        # Python list is built when read or when it finishes.
        self.store = SlotTokens(self.dec.batch, self.dec.capacity, self.dec.bufs.ring_capacity)
        self._running = np.zeros(self.dec.batch, bool)  # [B] slot holds a request that is not done
        self._occupied = np.zeros(self.dec.batch, bool)  # [B] slots[b] is not None (done or not)
        self.queue: collections.deque[RequestState] = collections.deque()
        self._ids = itertools.count()
        self._live_ids: dict = {}  # id -> RequestState, for every request queued or running
        self.errors = 0  # requests finished with an error by the loop
        self.bursts = 0
        self.tokens_out = 0
        self.gpu_busy_ms = 0.0
        self.gpu_idle_ms = 0.0
        self._last_end = None
        self.started = time.perf_counter()
        self._lock = None
        self._event_pairs = None

    # Hooks for graphburst.parallel.lockstep (tensor-parallel serving): its loop builds a
    # ParallelDecoder and a CheckedGraph here; everything else in the loop is unchanged.

    def _make_decoder(self, target, draft, **kw) -> SpecDecoder:
        return SpecDecoder(target, draft, **kw)

    def _make_graph(self, *, gapless: bool) -> BurstGraph:
        return BurstGraph(self.dec, gapless=gapless)

    # ------------------------------------------------------------------ requests

    def validate(self, req: Request) -> Request:
        """Raise ValueError/TypeError naming the bad field; fill in a missing id.

        The prompt check is the one ``SpecDecoder.prefill`` uses, so the loop accepts
        the same prompts (numpy integers and arrays included). An id already in flight
        is refused; a made-up id never equals one.
        """
        if not isinstance(req, Request):
            raise TypeError(f"request must be a graphburst.serve.Request, got {type(req).__name__}")
        prompt = check_prompt("prompt", req.prompt, self.vocab)
        limit = check_int("max_new_tokens", req.max_new_tokens, maximum=UNBOUNDED_BUDGET - 1)
        if req.eos is not None:
            check_int("eos", req.eos, minimum=0, maximum=self.vocab - 1)
        need = len(prompt) + limit
        if need > self.dec.capacity:
            raise ValueError(f"prompt of {len(prompt)} tokens plus max_new_tokens={limit} needs "
                             f"{need} KV entries, but the cache holds {self.dec.capacity}")
        if req.id is None:
            req.id = self._new_id()
        elif not isinstance(req.id, str):
            raise TypeError(f"id must be a str, got {type(req.id).__name__}")
        elif req.id in self._live_ids:
            other = self._live_ids[req.id]
            where = "" if other.line is None else f" (line {other.line})"
            raise ValueError(f"id {req.id!r} is already in flight{where}")
        return req

    def check_sampling(self, req: Request) -> SamplingParams:
        """A request's sampling settings, validated at submission (ValueError/TypeError naming
        the field and value). A request with temperature > 0 and no seed gets a random one."""
        fields = {f: getattr(req, f) for f in ("temperature", "top_k", "top_p", "seed") if getattr(req, f) is not None}
        params = check_sampling(**fields)
        if params.temperature > 0 and not self.sampling:
            raise ValueError(f"temperature {params.temperature} needs sampling, but this loop decodes greedily "
                             f"(build it with ServeLoop(..., sampling=True), or run graphburst serve --sampling)")
        if params.temperature > 0 and req.seed is None:
            params = dataclasses.replace(params, seed=secrets.randbits(64))
        return params

    def _sampling_args(self, admitted) -> dict:
        """``SpecDecoder.prefill`` keyword arguments: per-slot sampling settings of the admitted slots."""
        args = {f: [None] * self.dec.batch for f in ("temperature", "top_k", "top_p", "seed")}
        for b in admitted:
            params = self.slots[b].sampling or SamplingParams()
            for f in args:
                args[f][b] = getattr(params, f)
        return args

    def _new_id(self) -> str:
        while True:
            rid = f"req-{next(self._ids)}"
            if rid not in self._live_ids:
                return rid

    def submit(self, req: Request, *, line: int | None = None) -> RequestState:
        """Queue a request (validated now); it is admitted at the next burst boundary.

        Parameters
        ----------
        req : Request
        line : int, optional
            Input line number, kept on the state for the caller's records.
        """
        req = self.validate(req)
        state = RequestState(req, submitted=time.perf_counter(), line=line,
                             slot_options=self.dec.slot_options(req.options), sampling=self.check_sampling(req))
        self._live_ids[req.id] = state
        self.queue.append(state)
        return state

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
            state._detach()
        state.finished = now or time.perf_counter()
        if self._live_ids.get(state.request.id) is state:
            del self._live_ids[state.request.id]

    @property
    def active(self) -> int:
        return int(np.count_nonzero(self._occupied))

    @property
    def idle(self) -> bool:
        """Nothing queued, running or in flight."""
        return not self.queue and self.active == 0 and not self._in_flight

    # ------------------------------------------------------------------ the loop

    def _boundary(self) -> None:
        """Free slots of cancelled or failed requests, then admit waiting requests into free slots.

        Only runs with nothing in flight. A request whose prefill arguments fail the
        decoder's check finishes with an error and does not take a slot.
        """
        freed = [b for b, s in enumerate(self.slots) if s is not None and s.done]
        for b in freed:
            self.slots[b] = None
        self._occupied[freed] = False
        self.dec.release(freed)
        free = [b for b, s in enumerate(self.slots) if s is None]
        if not free or not self.queue:
            return
        prompts, limits, stops = [None] * self.dec.batch, [None] * self.dec.batch, [None] * self.dec.batch
        options, admitted = {}, []
        for b in free:
            while self.queue:
                state = self.queue.popleft()
                if state.done:  # cancelled while waiting: never admitted
                    continue
                req = state.request
                try:
                    # Re-checked here: a caller may have changed the request since submit().
                    prompts[b] = self.dec.check_request(req.prompt, req.max_new_tokens, req.eos)[0]
                except Exception as exc:  # noqa: BLE001 - a bad request costs only itself
                    self._retire(state, error=_describe(exc))
                    continue
                limits[b], stops[b] = req.max_new_tokens, req.eos
                state.slot = b
                self.slots[b] = state
                self._occupied[b] = True
                admitted.append(b)
                options[b] = state.slot_options  # every admitted slot: a reused one forgets its last request
                break
        if not admitted:
            return
        self.store.reset(admitted)
        for b in admitted:
            self.slots[b]._store = self.store
        self._running[admitted] = True
        try:
            self.dec.set_slot_options(options)
            self.dec.prefill(prompts, max_new_tokens=limits, eos=stops, **self._sampling_args(admitted))
        except Exception as exc:  # noqa: BLE001 - only the requests being admitted are touched
            msg = _describe(exc)
            for b in admitted:
                self._retire(self.slots[b], error=msg)
                self.slots[b] = None
            self._occupied[admitted] = False
            self.dec.release(admitted)

    # Timing: every burst gets a (start, end) event pair; three pairs in rotation cover
    # two bursts in flight plus the last drained burst's end, used for the idle gap.

    def _timing_events(self):
        be = self.dec.backend
        if not be.is_gpu:
            return None
        if self._event_pairs is None:
            self._event_pairs = [(be.xp.cuda.Event(), be.xp.cuda.Event()) for _ in range(3)]
        self._launched += 1
        return self._event_pairs[self._launched % 3]

    def _account(self, events) -> None:
        if events is None:
            return
        elapsed = self.dec.backend.xp.cuda.get_elapsed_time
        events[1].synchronize()
        self.gpu_busy_ms += elapsed(*events)
        if self._last_end is not None:
            self.gpu_idle_ms += elapsed(self._last_end, events[0])
        self._last_end = events[1]

    def _launch(self) -> None:
        """Enqueue one burst (graph engine)."""
        events = self._timing_events()
        self.graph.replay(timing_events=events)
        self._in_flight.append(events)

    def _drain_raw(self):
        """Drain the oldest burst in flight: ``(tokens, accept counters)``, not yet handed out."""
        tokens = self.graph.drain()
        self._account(self._in_flight.popleft())
        return tokens, self.graph.last_acc

    def _drain_one(self) -> int:
        """Drain the oldest burst in flight and hand its tokens to their requests."""
        return self._deliver(*self._drain_raw())

    def _run_eager(self) -> int:
        events = self._timing_events()
        if events:
            events[0].record(self.dec.stream)
        tokens = self.dec.run_burst(mode="per_round_sync")
        if events:
            events[1].record(self.dec.stream)
        self._account(events)
        return self._deliver(tokens, self.dec.accept_counters())

    def _needs_boundary(self) -> bool:
        """A request waits for a free slot, or a slot still holds a finished request."""
        occupied = self._occupied
        return bool(self.queue and not occupied.all()) or bool((occupied & ~self._running).any())

    def step(self) -> int:
        """One iteration: admit, run a burst, drain, stream tokens, free finished slots.

        With the pipelined graph engine two bursts stay in flight: the oldest is drained,
        the next one is enqueued, and only then are the drained tokens handed out, so
        the GPU keeps working while the host does; slots are only changed with nothing
        in flight. Returns the number of tokens delivered.

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
        msg = _describe(exc)
        named = [b for b in getattr(exc, "slots", ()) if 0 <= b < len(self.slots) and self.slots[b] is not None]
        touched = named or [b for b, s in enumerate(self.slots) if s is not None]
        now = time.perf_counter()
        for b in touched:
            self._retire(self.slots[b], now, error=msg)
        delivered = 0
        if self.graph is not None:
            while self._in_flight:  # launched bursts still hold the other requests' tokens
                delivered += self._drain_one()
        if self.dec.outstanding:  # a burst failed part-way through being enqueued
            self.dec.abandon_enqueued()
        self._boundary()
        return delivered

    def _step(self) -> int:
        if not self._in_flight and not self._occupied.any():
            # Nothing runs and no request holds a slot: the GPU's next gap is the loop
            # waiting for work, not host overhead between bursts, so it is not counted.
            self._last_end = None
        if self.graph is None:
            self._boundary()
            return self._run_eager() if self.active else 0
        delivered = 0
        if self._needs_boundary() or not self.pipelined or self.active == 0:
            while self._in_flight:
                delivered += self._drain_one()
            self._boundary()
        if self.active == 0:
            return delivered
        depth = self.graph.n_slots if self.pipelined else 1
        self._fill(depth)
        if not self._in_flight:
            return delivered
        drained = self._drain_raw()
        # Refill before handing the drained tokens out: while the host delivers burst n,
        # bursts n+1 and n+2 are both queued, so the GPU has work even if delivery is slow.
        try:
            if self.pipelined:
                self._fill(depth)
        finally:  # a launch that fails (a capacity error, say) must not lose the drained tokens
            delivered += self._deliver(*drained)
        return delivered

    def _fill(self, depth: int) -> None:
        while len(self._in_flight) < depth and self._worth_launching():
            self._launch()

    def _worth_launching(self) -> bool:
        # A burst commits at least one token per round for every live slot, so once the
        # bursts in flight are bound to use up every remaining budget, another is waste.
        left = self.dec.host_left - self.dec.m_rounds * len(self._in_flight)
        return bool((left > 0).any())

    def _deliver(self, tokens, acc) -> int:
        """Hand a drained burst's tokens to their requests; finish those that stopped.

        Vectorised over the batch: one fancy-index copy appends every running slot's
        tokens to its row (:class:`SlotTokens`); Python only visits the requests that
        finish. A request that is already done (cancelled, failed) receives nothing more.
        """
        now = time.perf_counter()
        self.bursts += 1
        counts = tokens.counts
        running = self._running
        self.store.append(tokens.data, counts, np.flatnonzero(running & (counts > 0)), acc, now)
        finished = running & (self.dec.host_left == 0)
        if finished.any():
            for b in np.flatnonzero(finished).tolist():
                self._retire(self.slots[b], now)
                self.slots[b] = None
            self._occupied[finished] = False
        delivered = tokens.total
        self.tokens_out += delivered
        return delivered

    def run_until_idle(self) -> None:
        """Serve until every submitted request has finished and nothing is in flight."""
        while not self.idle or self._in_flight:
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
        """Loop-level counters: bursts, tokens/s, GPU-idle fraction between bursts."""
        elapsed = time.perf_counter() - self.started
        total = self.gpu_busy_ms + self.gpu_idle_ms
        return {
            "bursts": self.bursts,
            "tokens": self.tokens_out,
            "tokens_per_s": self.tokens_out / elapsed if elapsed > 0 else 0.0,
            "active_slots": self.active,
            "queued": len(self.queue),
            "errors": self.errors,
            "gpu_idle_fraction": self.gpu_idle_ms / total if total > 0 else None,
            "captures": self.graph.captures if self.graph is not None else 0,
        }


def inter_token_latencies_us(states) -> tuple[list, list]:
    """Per request: raw gaps between deliveries, and gaps amortised over the tokens delivered."""
    raw, amortised = [], []
    for s in states:
        t_prev = s.first_token
        for t, n in s.deliveries[1:]:
            raw.append((t - t_prev) * 1e6)
            amortised += [(t - t_prev) * 1e6 / n] * n
            t_prev = t
    return raw, amortised


def percentiles(xs, qs=(50, 99)) -> dict:
    if not xs:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(xs, q)) for q in qs} | {"median": statistics.median(xs)}


def _describe(exc: BaseException) -> str:
    """One line for a request's ``error``: the exception type and message."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

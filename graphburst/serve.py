"""A replay loop for a serving process: continuous batching over one captured burst graph.

One :class:`BurstGraph` is captured at start-up per (batch slots, k, M) and replayed for
the life of the process. Between bursts the loop admits waiting requests into free
slots (prefill and slot reset are host-to-device writes into the fixed buffers plus the
model's prefill kernels: no recapture, no allocation), then replays, drains and streams
each request's new tokens. Stops (EOS, max_new_tokens) happen on the device, mid-round if need be, so no
token past a stop ever reaches the ring; a finished or idle slot has budget 0 and emits
nothing.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import statistics
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np

from .burst import SpecDecoder
from .capture import BurstGraph
from .models import StubDraft
from .validate import check_int, check_prob

ENGINE_MODES = ("graph", "eager_sync")


@dataclasses.dataclass
class Request:
    """One generation request.

    Parameters
    ----------
    prompt : list of int
        Non-empty, tokens in ``[0, vocab)``.
    max_new_tokens : int
        >= 1.
    eos : int, optional
        Stop after emitting this token.
    accept_prob, seed : optional
        Per-request settings of the stub draft.
    id : str, optional
        Made up when absent.
    """

    prompt: list
    max_new_tokens: int
    eos: int | None = None
    accept_prob: float | None = None
    seed: int | None = None
    id: str | None = None


@dataclasses.dataclass
class RequestState:
    """A request in flight: its tokens so far and its timings (perf_counter seconds)."""

    request: Request
    tokens: list = dataclasses.field(default_factory=list)
    slot: int | None = None
    submitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    accepted: int = 0  # drafts accepted, from the device counters
    rounds: int = 0
    cancelled: bool = False
    deliveries: list = dataclasses.field(default_factory=list)  # (time, n_tokens) per burst that delivered
    _new: collections.deque = dataclasses.field(default_factory=collections.deque)

    @property
    def done(self) -> bool:
        return self.finished is not None

    def stats(self) -> dict:
        """Time to first token, tokens/s and mean accepted drafts per round."""
        ttft = None if self.first_token is None else (self.first_token - self.submitted) * 1e3
        # Tokens arrive a burst at a time, so rate is taken over the request's whole life.
        span = (self.finished or time.perf_counter()) - self.submitted
        return {
            "ttft_ms": ttft,
            "tokens_per_s": len(self.tokens) / span if span > 0 else None,
            "accepted_per_round": self.accepted / self.rounds if self.rounds else None,
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
    """

    def __init__(self, target, draft, *, k: int, m_rounds: int, engine: str = "graph", pipelined: bool = True):
        if engine not in ENGINE_MODES:
            raise ValueError(f"engine must be one of {ENGINE_MODES}, got {engine!r}")
        self.dec = SpecDecoder(target, draft, k=k, m_rounds=m_rounds)
        self.engine = engine
        self.pipelined = bool(pipelined) and engine == "graph"
        self.graph = BurstGraph(self.dec, gapless=self.pipelined) if engine == "graph" else None
        self._in_flight: collections.deque = collections.deque()  # timing events per burst in flight
        self._launched = 0
        self.vocab = target.vocab
        self.slots: list[RequestState | None] = [None] * self.dec.batch
        self.queue: collections.deque[RequestState] = collections.deque()
        self._ids = itertools.count()
        self.bursts = 0
        self.tokens_out = 0
        self.gpu_busy_ms = 0.0
        self.gpu_idle_ms = 0.0
        self._last_end = None
        self.started = time.perf_counter()
        self._lock = None
        self._event_pairs = None

    # ------------------------------------------------------------------ requests

    def validate(self, req: Request) -> Request:
        """Raise ValueError/TypeError naming the bad field; fill in a missing id."""
        if not isinstance(req.prompt, (list, tuple)) or not req.prompt:
            raise ValueError(f"prompt must be a non-empty list of tokens, got {req.prompt!r}")
        for i, t in enumerate(req.prompt):
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"prompt[{i}] must be an int token, got {t!r}")
            if not 0 <= t < self.vocab:
                raise ValueError(f"prompt[{i}] = {t} is outside the vocabulary [0, {self.vocab})")
        check_int("max_new_tokens", req.max_new_tokens)
        if req.eos is not None:
            check_int("eos", req.eos, minimum=0, maximum=self.vocab - 1)
        if req.accept_prob is not None:
            check_prob("accept_prob", req.accept_prob)
        if req.seed is not None:
            check_int("seed", req.seed, minimum=0, maximum=2**32 - 1)
        need = len(req.prompt) + req.max_new_tokens
        if need > self.dec.capacity:
            raise ValueError(f"prompt of {len(req.prompt)} tokens plus max_new_tokens={req.max_new_tokens} needs "
                             f"{need} KV entries, but the cache holds {self.dec.capacity}")
        if req.id is None:
            req.id = f"req-{next(self._ids)}"
        return req

    def submit(self, req: Request) -> RequestState:
        """Queue a request (validated now); it is admitted at the next burst boundary."""
        state = RequestState(self.validate(req), submitted=time.perf_counter())
        self.queue.append(state)
        return state

    def cancel(self, state: RequestState) -> None:
        """Cancel a request; its slot is freed at the next burst boundary."""
        state.cancelled = True

    @property
    def active(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def idle(self) -> bool:
        return not self.queue and self.active == 0

    # ------------------------------------------------------------------ the loop

    def _boundary(self) -> None:
        """Free cancelled slots, then admit waiting requests into free slots."""
        freed = [b for b, s in enumerate(self.slots) if s is not None and s.cancelled]
        for b in freed:
            self._finish(b)
        self.dec.release(freed)
        free = [b for b, s in enumerate(self.slots) if s is None]
        if not free or not self.queue:
            return
        prompts, limits, stops = [None] * self.dec.batch, [None] * self.dec.batch, [None] * self.dec.batch
        draft_settings = {}
        for b in free:
            while self.queue and self.queue[0].cancelled:  # cancelled while waiting: never admitted
                self.queue.popleft().finished = time.perf_counter()
            if not self.queue:
                break
            state = self.queue.popleft()
            req = state.request
            state.slot = b
            self.slots[b] = state
            prompts[b], limits[b], stops[b] = req.prompt, req.max_new_tokens, req.eos
            draft_settings[b] = (req.accept_prob, req.seed)  # None restores the default for a reused slot
        if isinstance(self.dec.draft, StubDraft):
            self.dec.draft.set_slots(draft_settings, self.dec.stream)
        self.dec.prefill(prompts, max_new_tokens=limits, eos=stops)

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

    def _drain_one(self) -> int:
        """Drain the oldest burst in flight and hand its tokens to their requests."""
        tokens = self.graph.drain()
        self._account(self._in_flight.popleft())
        return self._deliver(tokens, self.graph.last_acc)

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
        has_free = any(s is None for s in self.slots)
        return bool(self.queue and has_free) or any(s is not None and s.cancelled for s in self.slots)

    def step(self) -> int:
        """One iteration: admit, run a burst, drain, stream tokens, free finished slots.

        With the pipelined graph engine the next burst is enqueued before the last one's
        tokens are handed out, so the GPU keeps working while the host does; slots are
        only changed with nothing in flight. Returns the number of tokens delivered.
        """
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
        while len(self._in_flight) < depth and self._worth_launching():
            self._launch()
        return delivered + (self._drain_one() if self._in_flight else 0)

    def _worth_launching(self) -> bool:
        # A burst commits at least one token per round for every live slot, so once the
        # bursts in flight are bound to use up every remaining budget, another is waste.
        left = self.dec.host_left - self.dec.m_rounds * len(self._in_flight)
        return bool((left > 0).any())

    def _deliver(self, tokens, acc) -> int:
        now = time.perf_counter()
        self.bursts += 1
        # One conversion per burst, then plain list slicing: per-slot numpy calls would
        # dominate the host time of a 64-slot loop.
        rows, counts, acc_rows = tokens.data.tolist(), tokens.counts.tolist(), acc.tolist()
        finished = (self.dec.host_left == 0).tolist()
        for b, state in enumerate(self.slots):
            if state is None:
                continue
            n = counts[b]
            if n:
                new = rows[b][1 : 1 + n]
                if state.first_token is None:
                    state.first_token = now
                state.tokens += new
                state._new.extend(new)
                state.deliveries.append((now, n))
            state.accepted, state.rounds = acc_rows[b]
            if finished[b]:
                self._finish(b, now)
        delivered = tokens.total
        self.tokens_out += delivered
        return delivered

    def _finish(self, b: int, now: float | None = None) -> None:
        state = self.slots[b]
        state.finished = now or time.perf_counter()
        self.slots[b] = None

    def run_until_idle(self) -> None:
        """Serve until every submitted request has finished and nothing is in flight."""
        while not self.idle or self._in_flight:
            self.step()

    # ------------------------------------------------------------------ streaming

    def stream(self, state: RequestState) -> Iterator[int]:
        """Yield a request's tokens as they arrive, driving the loop when none are buffered."""
        while True:
            while state._new:
                yield state._new.popleft()
            if state.done:
                return
            self.step()

    async def astream(self, state: RequestState) -> AsyncIterator[int]:
        """Asyncio form of :meth:`stream`: bursts run in a worker thread, one at a time."""
        lock = self._async_lock()
        while True:
            while state._new:
                yield state._new.popleft()
            if state.done:
                return
            async with lock:
                if not state._new and not state.done:
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

"""The engine thread: the one thread that owns a :class:`ServeLoop` and steps it.

``ServeLoop`` is not thread-safe, so an asyncio server never touches it. Handlers talk to
the engine through a thread-safe inbox (submit, cancel, cancel-all, stop) guarded by one
condition variable; the engine thread applies the inbox between bursts, runs one
``loop.step()``, and hands what the step did back to the asyncio event loop with ONE
``call_soon_threadsafe`` per step (a wake-up of the event loop is a syscall).

The hand-off is the loop's own log (``ServeLoop.log``, typed events of
:mod:`graphburst.serving.events`): per drained burst a :class:`~.events.Tokens` with the
receiving states, slots, counts and the ring as arrays, exactly as the loop appended it. The
engine thread does no per-request work for a request that only received tokens; it
visits a request only when it is admitted or finishes (to keep the wait count for 429s
and to build its final update). Splitting the burst into per-request updates, host-side
stop tokens (``stop_token_ids`` after the first, which the device handles as its EOS)
and SSE encoding all happen on the event loop, off the engine's critical path. A stop
hit ends the stream there at once and cancels the request at the next burst boundary;
no token after the stop is ever forwarded.

When nothing is running the engine sleeps on the condition, so an idle server uses no CPU.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import traceback

from .events import Admitted, Retired, Tokens
from .request import Request, RequestState
from .loop import ServeLoop

STATS_PERIOD_S = 0.05  # loop.stats() snapshots for /metrics, at most this often


@dataclasses.dataclass
class Update:
    """What one burst did for one request, sent to its asyncio queue.

    ``tokens`` are the new tokens (possibly empty on the final update); ``reason`` is set on
    the last update of a request: ``"eos" | "stop" | "length" | "cancelled" | "error"``.
    Built on the event loop thread from the engine's per-burst arrays (:func:`_dispatch`).
    """

    index: int  # which choice of the HTTP request
    tokens: list
    time: float  # perf_counter when the burst's tokens were handed out
    reason: str | None = None
    error: str | None = None
    accepted: int = 0  # drafts accepted over the request's life (final update only)
    rounds: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Final:
    """Hand-off entry beside the loop's :class:`~.events.Tokens`: a request's last update."""

    ticket: "Ticket"
    update: Update


@dataclasses.dataclass(eq=False)
class Ticket:
    """A request as the engine thread tracks it; created by the asyncio side."""

    request: Request
    index: int
    sink: object  # sink(ticket, update), called on the event loop thread
    host_stops: frozenset = frozenset()
    # Event-loop side, never touched by the engine thread:
    arrived: float = 0.0  # perf_counter when the HTTP request arrived
    last: float | None = None  # time of the last delivery seen
    final: str | None = None  # finish reason once the last update arrived: nothing reaches it after
    # Engine-thread side:
    state: RequestState | None = None
    admitted: bool = False  # has left the wait queue (holds a slot or finished)
    cancelled: bool = False  # set by EngineThread.cancel (any thread)


class EngineThread(threading.Thread):
    """Owns ``loop`` and steps it; all other threads go through the inbox.

    Parameters
    ----------
    loop : ServeLoop
        Used by this thread only, from :meth:`start` on.
    aloop : asyncio.AbstractEventLoop
        Where updates are delivered (``Ticket.sink`` runs there).
    """

    def __init__(self, loop: ServeLoop, aloop):
        super().__init__(name="graphburst-engine", daemon=True)
        self.loop = loop
        self.aloop = aloop
        self._cond = threading.Condition()
        self._inbox: collections.deque = collections.deque()  # (op, ticket or None)
        self._stopping = False
        self._live: dict[int, Ticket] = {}  # id(ticket) -> ticket, engine thread only
        self.waiting = 0  # submitted, not yet admitted; read by the asyncio side for 429s
        self.failed: str | None = None  # set when loop.step() raised: the engine is dead
        self.snapshot: dict = self._stats()  # replaced (never mutated) for /metrics readers
        self._last_snapshot = 0.0
        loop.log = []  # what each step did, handed to the event loop as is (ServeLoop.log)

    # ------------------------------------------------------------------ any thread

    def submit(self, tickets: list[Ticket]) -> None:
        with self._cond:
            self.waiting += len(tickets)
            self._inbox.extend(("submit", t) for t in tickets)
            self._cond.notify()
        # Bursts that end on the device end at their next round now, not when the engine thread
        # comes to the inbox: it may be waiting for a burst to drain.
        self.loop.request_round_exit()

    def cancel(self, tickets: list[Ticket]) -> None:
        """After this returns no update but the final ``cancelled`` one reaches these tickets."""
        with self._cond:
            for t in tickets:
                t.cancelled = True  # read by _dispatch on the event loop: drops updates already scheduled
            self._inbox.extend(("cancel", t) for t in tickets)
            self._cond.notify()

    def cancel_all(self) -> None:
        with self._cond:
            self._inbox.append(("cancel_all", None))
            self._cond.notify()

    def stop(self) -> None:
        """Exit after the current burst; requests still live get a ``cancelled`` update."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    # ------------------------------------------------------------------ engine thread

    def run(self) -> None:
        # The CUDA current device is per thread: make the loop's device current here too.
        try:
            with self.loop.dec.backend.device():
                self._serve()
        except Exception as exc:  # noqa: BLE001 - a dead engine must fail its requests, not hang them
            traceback.print_exc()
            self.failed = self.failed or f"{type(exc).__name__}: {exc}"
            events: list = []
            for t in list(self._live.values()):
                self._close(t, "error", events, error=self.failed)
            self._publish(events)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._stopping and (self.loop.idle or self.failed):
                    # idle (or dead): sleep until a handler writes the inbox; a --tp rank 0
                    # (parallel/lockstep.py) wakes every heartbeat_s to keep its followers' wait alive
                    self._cond.wait(self.loop.heartbeat_s)
                # Under the lock submit() queues under, before the requests are taken: the stops asked for
                # so far are those of requests taken now or earlier (submit asks after queuing)
                self.loop.mark_intake()
                ops = list(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            events: list = []
            for op, ticket in ops:
                self._apply(op, ticket, events)
            if stopping:
                for t in list(self._live.values()):
                    self._close(t, "cancelled", events)
                self._publish(events)
                return
            failed = None
            if not self.loop.idle and self.failed is None:
                try:
                    self.loop.step()
                except Exception as exc:  # noqa: BLE001 - a dead engine must fail its requests, not hang them
                    traceback.print_exc()
                    failed = self.failed = f"{type(exc).__name__}: {exc}"
            self._take_log(events)  # tokens produced before a failure still reach their clients
            if failed is not None:
                for t in list(self._live.values()):
                    self._close(t, "error", events, error=failed)
            self._snapshot()
            self._publish(events)

    def _apply(self, op: str, ticket: Ticket | None, events: list) -> None:
        if op == "submit":
            if self.failed is not None:
                self._close(ticket, "error", events, error=self.failed)
                return
            try:
                # its round exit was asked for by submit() above, on arrival (ServeLoop.mark_intake)
                ticket.state = self.loop.submit(ticket.request, round_exit=False)
            except (ValueError, TypeError) as exc:  # the HTTP layer validates first; this is the backstop
                self._close(ticket, "error", events, error=str(exc))
                return
            ticket.state.owner = ticket
            self._live[id(ticket)] = ticket
        elif op == "cancel":
            if id(ticket) in self._live:
                self._close(ticket, "cancelled", events)
        elif op == "cancel_all":
            for t in list(self._live.values()):
                self._close(t, "cancelled", events)

    def _close(self, ticket: Ticket, reason: str, events: list, *, error: str | None = None) -> None:
        """Final update for ``ticket``; cancel its request in the loop if it still runs."""
        self._live.pop(id(ticket), None)  # before loop.cancel: its Retired event is then skipped
        state = ticket.state
        if state is not None and not state.done:
            self.loop.cancel(state)  # slot freed at the next burst boundary
        self._left_queue(ticket)
        acc = (state.accepted, state.rounds) if state is not None else (0, 0)
        events.append(Final(ticket, Update(ticket.index, [], time.perf_counter(), reason, error, *acc)))

    def _left_queue(self, ticket: Ticket) -> None:
        if not ticket.admitted:
            ticket.admitted = True
            with self._cond:
                self.waiting -= 1

    def _take_log(self, events: list) -> None:
        """Move the loop's log into ``events``: token entries as they are (arrays), a final
        update per request that finished; only admitted and finished requests are visited."""
        log, self.loop.log = self.loop.log, []
        for event in log:
            match event:
                case Tokens():
                    events.append(event)
                case Admitted(state) | Retired(state):
                    ticket = state.owner
                    if ticket is None or id(ticket) not in self._live:
                        continue  # closed by the engine already (cancel, stop): its final update is out
                    self._left_queue(ticket)
                    if isinstance(event, Retired):
                        del self._live[id(ticket)]
                        events.append(Final(ticket, Update(ticket.index, [], state.finished, state.finish_reason,
                                                           state.error, state.accepted, state.rounds)))
                case _:
                    raise AssertionError(f"unknown loop event {event!r}")

    def _snapshot(self) -> None:
        now = time.perf_counter()
        if now - self._last_snapshot >= STATS_PERIOD_S or self.loop.idle:
            self.snapshot = self._stats()
            self._last_snapshot = now

    def _stats(self) -> dict:
        """``loop.stats()`` plus the wait count and the GPU's busy and idle milliseconds so far.

        The idle fraction alone cannot be split into windows; the two totals can (a load
        benchmark reads them before and after its run). Read here, on the thread that owns
        the loop, from its burst clock (``loop.pipeline``).
        """
        overall = self.loop.pipeline.clock.overall
        return self.loop.stats() | {"waiting": self.waiting, "gpu_busy_ms": overall.busy_ms,
                                    "gpu_idle_ms": overall.idle_ms, "gpu_admission_ms": overall.admission_ms}

    def _publish(self, events: list) -> None:
        if events:
            try:
                self.aloop.call_soon_threadsafe(self._dispatch, events)
            except RuntimeError:  # the event loop is already closed: nobody is listening
                pass


    # ------------------------------------------------------------------ event loop thread

    def _dispatch(self, events: list) -> None:
        """Runs on the event loop: split one step's events into per-request updates for the sinks.

        Nothing reaches a ticket after its final update, and a ticket cancelled by its
        handler gets nothing but the final ``cancelled`` update.
        """
        for entry in events:
            if isinstance(entry, Final):
                ticket, update = entry.ticket, entry.update
                if ticket.final is None and (not ticket.cancelled or update.reason == "cancelled"):
                    ticket.sink(ticket, update)
                    ticket.final = update.reason
                continue
            assert isinstance(entry, Tokens), entry
            when, ring, acc, rows = entry.time, entry.ring, entry.acc, entry.rows
            for j, (state, b, n) in enumerate(zip(entry.states.tolist(), rows.tolist(),
                                                  entry.counts[rows].tolist())):
                ticket = state.owner
                if ticket is None or ticket.final is not None or ticket.cancelled:
                    continue
                tokens = ring[b, 1 : 1 + n].tolist()
                if ticket.host_stops:
                    hit = next((i for i, t in enumerate(tokens) if t in ticket.host_stops), None)
                    if hit is not None:
                        # The counters as of this burst (the engine's own final is dropped).
                        ticket.sink(ticket, Update(ticket.index, tokens[: hit + 1], when, "stop", None,
                                                   int(acc[j, 0]), int(acc[j, 1])))
                        ticket.final = "stop"
                        self.cancel([ticket])  # frees the slot at the next boundary; its final is dropped
                        continue
                ticket.sink(ticket, Update(ticket.index, tokens, when))

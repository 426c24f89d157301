"""The engine thread: the one thread that owns a :class:`ServeLoop` and steps it.

``ServeLoop`` is not thread-safe, so an asyncio server never touches it. Handlers talk to
the engine through a thread-safe inbox (submit, cancel, cancel-all, stop) guarded by one
condition variable; the engine thread applies the inbox between bursts, runs one
``loop.step()``, and hands every request's new tokens back to the asyncio event loop with
ONE ``call_soon_threadsafe`` per burst carrying all updates of that burst (one update per
request per burst, never one per token: a wake-up of the event loop is a syscall). When
nothing is running it sleeps on the condition, so an idle server uses no CPU.

Host-side stop tokens (``stop_token_ids`` after the first, which the device handles as
its EOS) are checked here, on the engine thread, so a hit cancels the request before the
next burst boundary and no token after the stop is ever forwarded.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import traceback

from .serve import Request, RequestState, ServeLoop

STATS_PERIOD_S = 0.05  # loop.stats() snapshots for /metrics, at most this often


@dataclasses.dataclass
class Update:
    """What one burst did for one request, sent to its asyncio queue.

    ``tokens`` are the new tokens (possibly empty on the final update); ``reason`` is set on
    the last update of a request: ``"eos" | "stop" | "length" | "cancelled" | "error"``.
    """

    index: int  # which choice of the HTTP request
    tokens: list
    time: float  # perf_counter when the burst's tokens were handed out
    reason: str | None = None
    error: str | None = None
    accepted: int = 0  # drafts accepted over the request's life (final update only)
    rounds: int = 0


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
    final: str | None = None  # finish reason once the last update arrived
    # Engine-thread side:
    state: RequestState | None = None
    sent: int = 0  # tokens already forwarded
    admitted: bool = False  # has left the wait queue (holds a slot or finished)
    cancelled: bool = False


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
        self.snapshot: dict = loop.stats()  # replaced (never mutated) for /metrics readers
        self._last_snapshot = 0.0

    # ------------------------------------------------------------------ any thread

    def submit(self, tickets: list[Ticket]) -> None:
        with self._cond:
            self.waiting += len(tickets)
            self._inbox.extend(("submit", t) for t in tickets)
            self._cond.notify()

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
            updates: list = []
            for t in list(self._live.values()):
                self._close(t, "error", updates, error=self.failed)
            self._publish(updates)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._stopping and (self.loop.idle or self.failed):
                    # idle (or dead): sleep until a handler writes the inbox; a --tp rank 0
                    # (parallel/lockstep.py) wakes every heartbeat_s to keep its followers' wait alive
                    self._cond.wait(getattr(self.loop, "heartbeat_s", None))
                ops = list(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            updates: list = []
            for op, ticket in ops:
                self._apply(op, ticket, updates)
            if stopping:
                for t in list(self._live.values()):
                    self._close(t, "cancelled", updates)
                self._publish(updates)
                return
            if not self.loop.idle and self.failed is None:
                try:
                    self.loop.step()
                except Exception as exc:  # noqa: BLE001 - a dead engine must fail its requests, not hang them
                    traceback.print_exc()
                    self.failed = f"{type(exc).__name__}: {exc}"
                    for t in list(self._live.values()):  # tokens already produced still reach the client
                        new = t.state.tokens_since(t.sent) if t.state is not None else []
                        self._close(t, "error", updates, error=self.failed, tokens=new)
            self._collect(updates)
            self._publish(updates)

    def _apply(self, op: str, ticket: Ticket | None, updates: list) -> None:
        if op == "submit":
            if self.failed is not None:
                self._close(ticket, "error", updates, error=self.failed)
                return
            try:
                ticket.state = self.loop.submit(ticket.request)
            except (ValueError, TypeError) as exc:  # the HTTP layer validates first; this is the backstop
                self._close(ticket, "error", updates, error=str(exc))
                return
            self._live[id(ticket)] = ticket
        elif op == "cancel":
            if id(ticket) in self._live:
                self._close(ticket, "cancelled", updates)
        elif op == "cancel_all":
            for t in list(self._live.values()):
                self._close(t, "cancelled", updates)

    def _close(self, ticket: Ticket, reason: str, updates: list, *, error: str | None = None,
               tokens: list | None = None) -> None:
        """Final update for ``ticket``; cancel its request in the loop if it still runs."""
        state = ticket.state
        if state is not None and not state.done:
            self.loop.cancel(state)  # slot freed at the next burst boundary
        if not ticket.admitted:
            ticket.admitted = True
            with self._cond:
                self.waiting -= 1
        self._live.pop(id(ticket), None)
        acc = (state.accepted, state.rounds) if state is not None else (0, 0)
        updates.append((ticket, Update(ticket.index, tokens or [], time.perf_counter(), reason, error, *acc)))

    def _collect(self, updates: list) -> None:
        """One update per live request that got tokens or finished in this burst."""
        admitted = 0
        for ticket in list(self._live.values()):
            state = ticket.state
            if not ticket.admitted and (state.slot is not None or state.done):
                ticket.admitted = True
                admitted += 1
            n = state.n_tokens  # an int from the loop's slot rows: no list is built for an idle ticket
            if n == ticket.sent and not state.done:
                continue
            new = state.tokens_since(ticket.sent)
            ticket.sent += len(new)
            if ticket.host_stops:
                hit = next((i for i, t in enumerate(new) if t in ticket.host_stops), None)
                if hit is not None:
                    self._close(ticket, "stop", updates, tokens=new[: hit + 1])
                    continue
            last = state.last_delivery
            when = last if new and last is not None else time.perf_counter()
            if state.done:
                self._live.pop(id(ticket))
                updates.append((ticket, Update(ticket.index, new, when, state.finish_reason, state.error,
                                               state.accepted, state.rounds)))
            else:
                updates.append((ticket, Update(ticket.index, new, when)))
        if admitted:
            with self._cond:
                self.waiting -= admitted
        now = time.perf_counter()
        if now - self._last_snapshot >= STATS_PERIOD_S or self.loop.idle:
            self.snapshot = self.loop.stats() | {"waiting": self.waiting}
            self._last_snapshot = now

    def _publish(self, updates: list) -> None:
        if updates:
            try:
                self.aloop.call_soon_threadsafe(_dispatch, updates)
            except RuntimeError:  # the event loop is already closed: nobody is listening
                pass


def _dispatch(updates: list) -> None:
    """Runs on the event loop: hand each update to its request's sink."""
    for ticket, update in updates:
        if ticket.cancelled and update.reason != "cancelled":
            continue  # cancelled by its handler: nothing but the final "cancelled" update reaches it
        ticket.sink(ticket, update)

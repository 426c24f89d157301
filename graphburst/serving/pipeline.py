"""Which bursts are in flight: launching, refilling and draining the serving loop's bursts.

The graph engine replays one captured :class:`BurstGraph`; pipelined (``gapless``) it
keeps up to ``depth`` bursts enqueued (two by default), so the host hands out one burst's
tokens and admits requests while the GPU runs the next ones. A graph with a ladder of burst
lengths (``BurstGraph(..., ladder=True)``) launches each burst at the length its ``rounds_for``
callable picks (the serving loop's, from its queue). The eager engine runs a burst that syncs every round, for comparison.
Each burst is timed on the device by a :class:`~graphburst.serving.timing.BurstClock`, and
tagged at launch with whether every batch slot was running a request (the steady window).

This module knows nothing about requests: :class:`~graphburst.serving.loop.ServeLoop` decides
when slots change (at burst boundaries, with bursts possibly still in flight: the decoder
drops a burst's tokens for slots refilled since its launch) and hands out what :meth:`drain`
returns.
"""

from __future__ import annotations

import collections
import functools

import numpy as np

from ..engine.mode import BurstMode
from ..engine.decoder import SpecDecoder
from ..capture import BurstGraph
from ..engine.round_exit import BURST_EXIT_REASONS
from .timing import BurstClock


def graph_of(dec: SpecDecoder, *, depth: int, graph_cls=BurstGraph, **kw) -> BurstGraph:
    """The ``graph_cls`` (a :class:`BurstGraph`) of ``dec`` that keeps ``depth`` bursts in
    flight (gapless past 1); ``kw`` go to its constructor."""
    return graph_cls(dec, gapless=depth > 1, depth=depth if depth > 1 else None, **kw)


class BurstPipeline:
    """Bursts of one decoder in flight, oldest first.

    Parameters
    ----------
    dec : SpecDecoder
    engine : BurstMode
        ``GRAPH`` or ``PER_ROUND_SYNC``.
    pipelined : bool
        Graph engine only: keep more than one burst in flight while the host works.
    depth : int
        Pipelined: bursts kept in flight (``BurstGraph``'s ``depth``).
    make_graph : callable, optional
        ``make_graph(depth=...)`` returns the graph to replay, gapless for a depth > 1
        (default: a :class:`BurstGraph` of ``dec``; tensor-parallel serving passes its
        checked graph).
    """

    def __init__(self, dec: SpecDecoder, engine: str, pipelined: bool, make_graph=None, depth: int = 2):
        self.dec = dec
        self.pipelined = bool(pipelined) and engine == BurstMode.GRAPH
        if make_graph is None:
            make_graph = functools.partial(graph_of, dec)
        self.graph = make_graph(depth=depth if self.pipelined else 1) if engine == BurstMode.GRAPH else None
        self.depth = self.graph.n_graphs if self.pipelined else 1  # bursts kept in flight
        self.clock = BurstClock(dec.backend, self.depth)
        self._in_flight: collections.deque = collections.deque()  # (timing events or None, steady) per burst
        self.launched = 0  # bursts launched so far (graph and eager): burst i is the i-th, from 0
        self.rounds = 0  # rounds the drained bursts ran (fewer than M a burst where bursts end on the device)
        # drained device-exit bursts by why they ended: M_max rounds run, every slot stopped, or a stop request
        self.exits = dict.fromkeys(BURST_EXIT_REASONS, 0)
        # device ms of a whole M-round burst, from the last drained burst that ran a round (None before
        # one, or without GPU timing): what the admission schedule weighs the host's admission time
        # against, as a device-exit burst may end after any number of rounds (zero while a stop is held)
        self.burst_ms = None
        #: a ladder graph's burst length for the next launch: ``rounds_for(pipeline) -> int`` (None: M rounds)
        self.rounds_for = None
        self.ladder = bool(self.graph is not None and self.graph.ladder)
        # ladder bursts launched, by their rounds
        self.rungs = dict.fromkeys(self.graph.rungs, 0) if self.ladder else {}

    def __len__(self) -> int:
        return len(self._in_flight)

    @property
    def oldest(self) -> int:
        """Launch index of the oldest burst in flight (:attr:`launched` when none is)."""
        return self.launched - len(self._in_flight)

    def launch(self, steady: bool) -> None:
        """Enqueue one graph burst; ``steady``: every batch slot runs a request."""
        events = self.clock.events()
        rounds = None
        if self.ladder and self.rounds_for is not None:
            rounds = self.graph.rung_for(self.rounds_for(self))
            self.rungs[rounds] += 1
        self.graph.replay(rounds=rounds, timing_events=events)
        self._in_flight.append((events, steady))
        self.launched += 1

    def drain(self):
        """Drain the oldest burst in flight: ``(BurstTokens, accept counters [B, 2])``, not yet handed out."""
        tokens = self.graph.drain()  # waits for the burst's completion event, recorded after its end event
        rounds = self.graph.last_rounds
        self.rounds += rounds
        reason = self.graph.last_exit_reason
        if reason in self.exits:  # None: a fixed-M burst
            self.exits[reason] += 1
        self.clock.account(*self._in_flight.popleft(), ended=True)
        self._burst_time(rounds)
        return tokens, self.graph.last_acc

    def _burst_time(self, rounds: int) -> None:
        busy = self.clock.last_busy_ms
        if busy is not None and rounds > 0:
            self.burst_ms = busy * self.dec.m_rounds / rounds

    def fill(self, steady: bool) -> None:
        """Launch bursts until ``depth`` are in flight or another would be waste."""
        while len(self._in_flight) < self.depth and self.worth_launching():
            self.launch(steady)

    def worth_launching(self) -> bool:
        # A burst commits at least one token per round for every live slot, so once the
        # bursts in flight are bound to use up every remaining budget, another is waste.
        # count_nonzero of the comparison, not max(): a numpy reduction costs ~1 µs of set-up.
        return np.count_nonzero(self.dec.host_left > self.rounds_in_flight) > 0

    @property
    def rounds_in_flight(self) -> int:
        """Rounds the bursts in flight run at most (the graph's count; the eager engine keeps none in flight)."""
        return 0 if self.graph is None else self.graph.rounds_in_flight

    @property
    def round_ms(self) -> float | None:
        """Device ms of one round, from :attr:`burst_ms` (None before a burst was timed)."""
        return None if self.burst_ms is None else self.burst_ms / self.dec.m_rounds

    def run_eager(self, steady: bool):
        """One eager burst that syncs every round: ``(BurstTokens, accept counters [B, 2])``."""
        events = self.clock.events()
        if events:
            events[0].record(self.dec.stream)
        tokens = self.dec.run_burst(mode=BurstMode.PER_ROUND_SYNC)
        self.launched += 1
        self.rounds += self.dec.m_rounds
        if events:
            events[1].record(self.dec.stream)
        self.clock.account(events, steady)
        self._burst_time(self.dec.m_rounds)
        return tokens, self.dec.accept_counters()

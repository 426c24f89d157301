"""GPU time of the serving loop's bursts, and the latency figures drawn from request timings.

:class:`BurstClock` brackets every burst with a CUDA event pair and, when the burst is
drained, adds its device time to ``busy`` and the gap since the previous burst ended to
``idle``. Two windows are kept:

- **overall**: every gap while some request held a slot (the idle fraction the loop has
  always reported, kept so before/after figures stay comparable);
- **steady**: only the gaps before bursts launched with every batch slot running a
  request, so ramp-up (slots still empty) and ramp-down (slots emptied and not refilled)
  do not count. Burst boundaries that refill slots do count: refilling is part of
  steady serving.

Idle time is not all waste: admission's device work (the models' prefill, the slot writes)
runs in the gaps. The loop brackets it with its own event pair (:meth:`BurstClock.admission_begin`
/ :meth:`~BurstClock.admission_end`), and each gap's **admission** span is tallied apart, as a
part of ``idle``. The span runs from the GPU reaching the first admission op to its finishing
the last, so it also holds any wait for the host between those ops: with a real model it is
mostly prefill compute, with zero-cost stubs mostly the host enqueueing the admission.
"""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np


@dataclasses.dataclass
class IdleTally:
    """GPU milliseconds busy in bursts and idle between them, over one window."""

    busy_ms: float = 0.0
    idle_ms: float = 0.0
    admission_ms: float = 0.0  # of idle_ms: the admission spans inside the gaps (module docstring)
    bursts: int = 0  # bursts counted (each adds its busy time, and its gap when there was one)

    def add(self, busy_ms: float, gap_ms: float | None, admission_ms: float = 0.0) -> None:
        self.busy_ms += busy_ms
        if gap_ms is not None:
            self.idle_ms += gap_ms
            self.admission_ms += min(admission_ms, gap_ms)  # event times round: a span never exceeds its gap
        self.bursts += 1

    @property
    def idle_fraction(self) -> float | None:
        total = self.busy_ms + self.idle_ms
        return self.idle_ms / total if total > 0 else None

    @property
    def admission_fraction(self) -> float | None:
        """The share of GPU time (busy + idle) spent in admission spans: a part of :attr:`idle_fraction`."""
        total = self.busy_ms + self.idle_ms
        return self.admission_ms / total if total > 0 else None


class BurstClock:
    """Device timing of bursts: CUDA event pairs on a GPU, nothing on the numpy backend.

    Parameters
    ----------
    backend : Backend
        The decoder's; no timing unless ``backend.is_gpu``.
    depth : int
        Bursts that may be in flight at once.
    """

    def __init__(self, backend, depth: int = 2):
        self.backend = backend
        self.pairs = depth + 1  # the bursts in flight plus the last drained burst's end, used for the next gap
        self.overall = IdleTally()
        self.steady = IdleTally()
        self._pairs = None
        self._launched = 0
        self._last_end = None
        self.last_busy_ms = None  # device time of the last burst accounted (None before one, or without a GPU)
        self._windows: list = []  # admission spans (start, end events) recorded since the last launch
        self._gap_windows: dict = {}  # id(a burst's start event) -> the admission spans of the gap before it
        self._window_pool: list = []  # event pairs of accounted spans, reused

    def events(self):
        """The (start, end) event pair for the next burst, or None without a GPU."""
        if not self.backend.is_gpu:
            return None
        if self._pairs is None:
            xp = self.backend.xp
            self._pairs = [(xp.cuda.Event(), xp.cuda.Event()) for _ in range(self.pairs)]
        self._launched += 1
        pair = self._pairs[self._launched % self.pairs]
        # Admission enqueued since the last launch ran in the gap before this burst (stream order).
        self._gap_windows[id(pair[0])], self._windows = self._windows, []
        return pair

    def admission_begin(self, stream):
        """Record the start of an admission span on ``stream``; the pair to end it with (None without a GPU)."""
        if not self.backend.is_gpu:
            return None
        pair = self._window_pool.pop() if self._window_pool else (self.backend.xp.cuda.Event(),
                                                                   self.backend.xp.cuda.Event())
        pair[0].record(stream)
        return pair

    def admission_end(self, pair, stream) -> None:
        """Record the end of the span :meth:`admission_begin` started."""
        if pair is not None:
            pair[1].record(stream)
            self._windows.append(pair)

    def forget_gap(self) -> None:
        """The loop had no work: the GPU's next gap is waiting for requests, not host overhead."""
        self._last_end = None

    def account(self, events, steady: bool, ended: bool = False) -> None:
        """Add a drained burst's device time and the gap before it (syncs its end event, unless
        ``ended``: the caller has waited for an event recorded after it, as a graph's drain has).

        Without timing events (numpy backend) only the burst counts are kept.
        """
        if events is None:
            self.overall.bursts += 1
            self.steady.bursts += steady
            return
        start, end = events
        elapsed = self.backend.xp.cuda.get_elapsed_time
        if not ended:
            end.synchronize()
        busy = elapsed(start, end)
        self.last_busy_ms = busy
        last = self._last_end
        gap = None if last is None else elapsed(last, start)
        admission = 0.0
        windows = self._gap_windows.pop(id(start), None)
        if windows:  # most gaps hold no admission: no generator, no pool growth
            admission = sum(elapsed(a, b) for a, b in windows)  # they precede ``end``: done
            self._window_pool += windows
        self.record(busy, gap, steady, admission)
        self._last_end = end

    def record(self, busy_ms: float, gap_ms: float | None, steady: bool, admission_ms: float = 0.0) -> None:
        """Count one burst: ``busy_ms`` on the device, ``gap_ms`` idle before it (None: no gap counted),
        ``admission_ms`` of that gap in admission spans."""
        self.overall.add(busy_ms, gap_ms, admission_ms)
        if steady:
            self.steady.add(busy_ms, gap_ms, admission_ms)


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

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
    bursts: int = 0  # bursts counted (each adds its busy time, and its gap when there was one)

    def add(self, busy_ms: float, gap_ms: float | None) -> None:
        self.busy_ms += busy_ms
        if gap_ms is not None:
            self.idle_ms += gap_ms
        self.bursts += 1

    @property
    def idle_fraction(self) -> float | None:
        total = self.busy_ms + self.idle_ms
        return self.idle_ms / total if total > 0 else None


class BurstClock:
    """Device timing of bursts: CUDA event pairs on a GPU, nothing on the numpy backend.

    Parameters
    ----------
    backend : Backend
        The decoder's; no timing unless ``backend.is_gpu``.
    """

    PAIRS = 3  # two bursts in flight plus the last drained burst's end, used for the next gap

    def __init__(self, backend):
        self.backend = backend
        self.overall = IdleTally()
        self.steady = IdleTally()
        self._pairs = None
        self._launched = 0
        self._last_end = None

    def events(self):
        """The (start, end) event pair for the next burst, or None without a GPU."""
        if not self.backend.is_gpu:
            return None
        if self._pairs is None:
            xp = self.backend.xp
            self._pairs = [(xp.cuda.Event(), xp.cuda.Event()) for _ in range(self.PAIRS)]
        self._launched += 1
        return self._pairs[self._launched % self.PAIRS]

    def forget_gap(self) -> None:
        """The loop had no work: the GPU's next gap is waiting for requests, not host overhead."""
        self._last_end = None

    def account(self, events, steady: bool) -> None:
        """Add a drained burst's device time and the gap before it (syncs its end event).

        Without timing events (numpy backend) only the burst counts are kept.
        """
        if events is None:
            self.overall.bursts += 1
            self.steady.bursts += steady
            return
        elapsed = self.backend.xp.cuda.get_elapsed_time
        events[1].synchronize()
        busy = elapsed(*events)
        gap = None if self._last_end is None else elapsed(self._last_end, events[0])
        self.record(busy, gap, steady)
        self._last_end = events[1]

    def record(self, busy_ms: float, gap_ms: float | None, steady: bool) -> None:
        """Count one burst: ``busy_ms`` on the device, ``gap_ms`` idle before it (None: no gap counted)."""
        self.overall.add(busy_ms, gap_ms)
        if steady:
            self.steady.add(busy_ms, gap_ms)


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

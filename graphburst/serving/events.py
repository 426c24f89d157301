"""What a serving loop did, as typed events: the entries of ``ServeLoop.log``.

A consumer that forwards tokens elsewhere (the JSONL writer, the HTTP engine thread, a
test) sets ``loop.log = []``; every step then appends, in order, one :class:`Tokens` per
drained burst that delivered tokens and per batch of first tokens handed out, one
:class:`Admitted` when a request takes a batch slot and one :class:`Retired` when a
request finishes for any reason (stop, length, cancel, error). The consumer reads them
by type (``isinstance`` or ``match``) and empties the list. The events are frozen: the
arrays they carry belong to the consumer.

:class:`LoopRecord` is where the loop's parts write what they did: the log (if a consumer
set one) and the loop's counters.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .request import RequestState


@dataclasses.dataclass(frozen=True, slots=True)
class Tokens:
    """One drained burst's tokens, for every request that received some; or the first tokens
    of requests just prefilled (one each, handed out before their first burst is drained:
    :mod:`graphburst.serving.first_tokens`).

    Row ``rows[i]`` of ``ring`` holds ``counts[rows[i]]`` tokens of ``states[i]``, from
    column 1. The engine thread splits these per request on the event loop, off the
    burst's critical path, so the loop does no per-request work here.
    """

    time: float  # perf_counter when the burst's tokens were handed out
    states: np.ndarray  # [r] object: the RequestState of each receiving slot
    rows: np.ndarray  # [r] int64: their batch slots
    counts: np.ndarray  # [B] int: tokens per slot in this burst
    ring: np.ndarray  # [B, 1 + R] int32: the drained ring (column 0 is the count)
    # [r, 2] int64: accepted drafts and rounds so far of each receiving request (a copy; 0 with first tokens)
    acc: np.ndarray

    def tokens_of(self, i: int) -> list:
        """The new tokens of ``states[i]`` as a list."""
        b = int(self.rows[i])
        return self.ring[b, 1 : 1 + int(self.counts[b])].tolist()


@dataclasses.dataclass(frozen=True, slots=True)
class Admitted:
    """A request took a batch slot (``state.slot``)."""

    state: RequestState


@dataclasses.dataclass(frozen=True, slots=True)
class Retired:
    """A request finished: ``state.finish_reason`` says why; no token reaches it after this."""

    state: RequestState


Event = Tokens | Admitted | Retired


class LoopRecord:
    """What a serving loop has done: the event log a consumer reads, and the loop's counters.

    One object the loop builds and hands to each of its parts that hands tokens out or
    finishes requests, so every part appends to the same log and counts into the same
    figures (``ServeLoop.log``, ``bursts``, ``tokens_out``, ``errors`` read it).

    Attributes
    ----------
    log : list or None
        None, or the list of events a consumer set (``ServeLoop.log``); parts append in order.
    bursts : int
        Bursts drained and handed out.
    tokens_out : int
        Tokens handed out (first tokens included).
    errors : int
        Requests the loop finished with an error.
    """

    __slots__ = ("log", "bursts", "tokens_out", "errors")

    def __init__(self):
        self.log: list | None = None
        self.bursts = 0
        self.tokens_out = 0
        self.errors = 0

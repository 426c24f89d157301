"""Submission to the serving loop: validation, request ids, the waiting queue.

A request is validated once, when it is submitted (:func:`~graphburst.serving.request.check_whole_request_fits`
and :func:`~graphburst.serving.request.check_request_sampling`); the validated values go on its
:class:`~graphburst.serving.request.RequestState`, which waits in ``queue`` until the loop admits
it at a burst boundary. Every request queued or running is known by id in ``live``:
an id already in flight is refused, and a made-up id (``auto-N``, a form refused from callers)
never equals one.

:class:`RequestIntake` is a part the loop owns (``ServeLoop.intake``). It never touches
batch slots: the loop pops admitted requests with :meth:`RequestIntake.take_waiting` and
tells it when one finishes (:meth:`RequestIntake.forget`).
"""

from __future__ import annotations

import collections
import itertools
import numbers
import re
import time
from collections.abc import Callable

from .request import Request, RequestState, check_request_sampling, check_whole_request_fits
from ..sampling.params import SamplingParams

#: The form of a made-up id (``auto-0``, ``auto-1``, ...). A caller's id of this form is refused, so a
#: made-up id never equals a caller's, whichever comes first.
MADE_UP_ID = re.compile(r"auto-[0-9]+")


class RequestIntake:
    """The front door of a serving loop: ``submit`` and ``validate``, ids, the waiting queue.

    Parameters
    ----------
    vocab, capacity : int
        The models' vocabulary and KV entries per slot (the request checks).
    sampling : bool
        Whether the loop decodes with rejection sampling (temperature > 0 allowed).
    slot_options : callable
        ``slot_options(options)``: the models' validated view of a request's options
        (``SpecDecoder.slot_options``); raises ValueError/TypeError for a key no model claims.

    Attributes
    ----------
    queue : collections.deque of RequestState
        Submitted requests waiting for a batch slot, oldest first (cancelled ones are
        skipped by :meth:`take_waiting`).
    live : dict
        id -> RequestState, for every request queued or running.
    """

    def __init__(self, *, vocab: int, capacity: int, sampling: bool, slot_options: Callable, fields: bool = False,
                 replays_ids: bool = False):
        self.vocab, self.capacity, self.sampling = vocab, capacity, bool(sampling)
        self.fields = bool(fields)  # the decoder applies the logits processing fields
        # True where ids come from a loop that made them up already (the followers of a lockstep group).
        self.replays_ids = bool(replays_ids)
        self._slot_options = slot_options
        self.queue: collections.deque[RequestState] = collections.deque()
        self._ids = itertools.count()
        self.live: dict = {}

    def __len__(self) -> int:
        """Requests waiting for a slot (cancelled ones not yet popped included)."""
        return len(self.queue)

    def validate(self, req: Request) -> Request:
        """Raise ValueError/TypeError naming the bad field; the request is not changed.

        The prompt check is the one ``SpecDecoder.prefill`` uses, so the loop accepts
        the same prompts (numpy integers and arrays included). An id already in flight
        is refused. A missing id is made up by :meth:`submit`, once every check passed (so a
        refused request uses up no id, and validate-then-submit accepts what validate did).
        """
        check_whole_request_fits(req, vocab=self.vocab, capacity=self.capacity)
        self._check_id(req)
        return req

    def _check_id(self, req: Request) -> None:
        # Ids are compared as given: 7 and "7" are two ids (a JSON reader sees two different values).
        if req.id is None:
            return  # made up by submit, after every check
        if isinstance(req.id, bool) or not isinstance(req.id, (str, numbers.Integral)):
            raise TypeError(f"id must be a str or an int, got {type(req.id).__name__}")
        elif isinstance(req.id, str) and MADE_UP_ID.fullmatch(req.id) and not self.replays_ids:
            raise ValueError(f"id {req.id!r} has the form of the ids made up for requests without one "
                             "(auto-N); choose another")
        elif req.id in self.live:
            other = self.live[req.id]
            where = "" if other.line is None else f" (line {other.line})"
            raise ValueError(f"id {req.id!r} is already in flight{where}")

    def check_sampling(self, req: Request) -> SamplingParams:
        """A request's sampling settings, validated at submission (``request.check_request_sampling``)."""
        return check_request_sampling(req, sampling=self.sampling, fields=self.fields, vocab=self.vocab)

    def _new_id(self) -> str:
        return f"auto-{next(self._ids)}"  # no caller's id has this form (MADE_UP_ID)

    def submit(self, req: Request, *, line: int | None = None) -> RequestState:
        """Queue a request (validated now); the loop admits it at a burst boundary.

        The loop serves the request as it was at submission: the validated prompt, budget
        and stop token are kept on its state, and later changes to ``req`` are not read.
        ``line``: the input line number, kept on the state for the caller's records.
        """
        row, limit, eos = check_whole_request_fits(req, vocab=self.vocab, capacity=self.capacity)
        self._check_id(req)
        options, sampling = self._slot_options(req.options), self.check_sampling(req)
        if req.id is None:
            req.id = self._new_id()
        state = RequestState(req, submitted=time.perf_counter(), line=line, slot_options=options, sampling=sampling,
                             row=row, limit=limit, eos=eos)
        self.live[req.id] = state
        self.queue.append(state)
        return state

    def take_waiting(self, n: int) -> list:
        """Pop up to ``n`` of the oldest waiting requests that are not done, oldest first
        (in one call: admission runs while the GPU may wait)."""
        taken, queue = [], self.queue
        while queue and len(taken) < n:
            state = queue.popleft()
            if state.finished is None:  # not done: one cancelled while waiting is never admitted
                taken.append(state)
        return taken

    def withdraw(self, state: RequestState) -> None:
        """Take a request that was never admitted out of the queue (a submit undone by the caller)."""
        self.queue.remove(state)

    def lookup(self, rid: str) -> RequestState | None:
        """The request in flight with this id, if any."""
        return self.live.get(rid)

    def forget(self, state: RequestState) -> None:
        """A request finished: its id may be used again."""
        if self.live.get(state.request.id) is state:
            del self.live[state.request.id]

    def forget_all(self, states) -> None:
        """:meth:`forget` of several finished requests."""
        live = self.live
        for state in states:
            rid = state.request.id
            if live.get(rid) is state:
                del live[rid]

"""Submission to the serving loop: validation, request ids, the waiting queue, cancellation.

A request is validated once, when it is submitted (:func:`~graphburst.serving.request.check_request`
and :func:`~graphburst.serving.request.check_request_sampling`); the validated values go on its
:class:`~graphburst.serving.request.RequestState`, which waits in ``queue`` until the loop admits
it at a burst boundary. Every request queued or running is known by id in ``_live_ids``:
an id already in flight is refused, and a made-up id (``auto-N``, a form refused from callers)
never equals one.

:class:`RequestIntake` is a mixin of :class:`~graphburst.serving.loop.ServeLoop`, which provides
``vocab``, ``sampling``, ``dec`` (``capacity``, ``slot_options``) and ``_retire`` (the end
of a request's life, which also touches its batch slot). This module never touches slots.
"""

from __future__ import annotations

import collections
import itertools
import numbers
import re
import time

from .request import Request, RequestState, check_request, check_request_sampling
from ..sampling.params import SamplingParams

#: The form of a made-up id (``auto-0``, ``auto-1``, ...). A caller's id of this form is refused, so a
#: made-up id never equals a caller's, whichever comes first.
MADE_UP_ID = re.compile(r"auto-[0-9]+")


class RequestIntake:
    """The front door of a serving loop: ``submit``, ``validate``, ``cancel``.

    Attributes
    ----------
    queue : collections.deque of RequestState
        Submitted requests waiting for a batch slot, oldest first.
    """

    def _init_intake(self) -> None:
        self.queue: collections.deque[RequestState] = collections.deque()
        self._ids = itertools.count()
        self._live_ids: dict = {}  # id -> RequestState, for every request queued or running

    def validate(self, req: Request) -> Request:
        """Raise ValueError/TypeError naming the bad field; fill in a missing id.

        The prompt check is the one ``SpecDecoder.prefill`` uses, so the loop accepts
        the same prompts (numpy integers and arrays included). An id already in flight
        is refused; a made-up id never equals one.
        """
        check_request(req, vocab=self.vocab, capacity=self.dec.capacity)
        self._check_id(req)
        return req

    #: True where ids come from a loop that made them up already (the followers of a lockstep group).
    replays_ids = False

    def _check_id(self, req: Request) -> None:
        # Ids are compared as given: 7 and "7" are two ids (a JSON reader sees two different values).
        if req.id is None:
            req.id = self._new_id()
        elif isinstance(req.id, bool) or not isinstance(req.id, (str, numbers.Integral)):
            raise TypeError(f"id must be a str or an int, got {type(req.id).__name__}")
        elif isinstance(req.id, str) and MADE_UP_ID.fullmatch(req.id) and not self.replays_ids:
            raise ValueError(f"id {req.id!r} has the form of the ids made up for requests without one "
                             "(auto-N); choose another")
        elif req.id in self._live_ids:
            other = self._live_ids[req.id]
            where = "" if other.line is None else f" (line {other.line})"
            raise ValueError(f"id {req.id!r} is already in flight{where}")

    def check_sampling(self, req: Request) -> SamplingParams:
        """A request's sampling settings, validated at submission (``request.check_request_sampling``)."""
        return check_request_sampling(req, sampling=self.sampling)

    def _new_id(self) -> str:
        return f"auto-{next(self._ids)}"  # no caller's id has this form (MADE_UP_ID)

    def submit(self, req: Request, *, line: int | None = None) -> RequestState:
        """Queue a request (validated now); it is admitted at the next burst boundary.

        The loop serves the request as it was at submission: the validated prompt, budget
        and stop token are kept on its state, and later changes to ``req`` are not read.

        Parameters
        ----------
        req : Request
        line : int, optional
            Input line number, kept on the state for the caller's records.
        """
        row, limit, eos = check_request(req, vocab=self.vocab, capacity=self.dec.capacity)
        self._check_id(req)
        state = RequestState(req, submitted=time.perf_counter(), line=line,
                             slot_options=self.dec.slot_options(req.options), sampling=self.check_sampling(req),
                             row=row, limit=limit, eos=eos)
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

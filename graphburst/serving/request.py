"""A serving request and its state in flight: what the caller sends, what the loop keeps.

:class:`Request` is what a caller submits; :func:`check_whole_request_fits` and
:func:`check_request_sampling` validate it once, at submission, and the validated values
(the prompt as a ``[n] int32`` row, the budget, the stop token, the sampling settings)
are kept on its :class:`RequestState`. The loop admits from those, so a caller changing
the ``Request`` object after submission changes nothing the loop does.

While a request holds a batch slot its tokens live in the loop's
:class:`~graphburst.serving.slot_tokens.SlotTokens` rows; when it leaves the slot they are
copied out once as arrays, and turned into Python lists only when read.
"""

from __future__ import annotations

import dataclasses
import secrets
import time

import numpy as np

from ..constants import UNBOUNDED_BUDGET
from ..sampling.params import FIELD_DEFAULTS, SamplingParams, check_sampling
from .slot_tokens import SlotTokens
from ..validate import check_int, check_prompt

#: The largest request a server reads: an HTTP body, a JSONL line (long token-id prompts are JSON
#: numbers, ~6 bytes a token).
MAX_REQUEST_BYTES = 16 * 2**20


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
    id : str or int, optional
        Made up when absent (``auto-N``, a form refused from callers); never equal to the id
        of another request in flight. 7 and "7" are different ids.
    temperature, top_k, top_p, seed : optional
        Sampling settings (``sampling_params.check_sampling``); None: greedy (temperature
        0), filters off. Temperature > 0 needs ``ServeLoop(..., sampling=True)``; a
        sampled request without a seed gets a random one (``RequestState.sampling``).
    logit_bias, presence_penalty, frequency_penalty, repetition_penalty, min_p, min_tokens, ignore_eos : optional
        The logits processing fields (``sampling.params.check_fields``), applied on the device
        inside the burst; None: off. They need ``ServeLoop(..., sampling=True, fields=True)``.
    """

    prompt: list
    max_new_tokens: int
    eos: int | None = None
    id: str | int | None = None
    options: dict | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    logit_bias: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None


def check_whole_request_fits(req: Request, *, vocab: int, capacity: int) -> tuple[np.ndarray, int, int | None]:
    """Validate a request's prompt, budget and stop token (not its id): the whole request must fit.

    Returns ``(prompt [n] int32, max_new_tokens, eos)``; raises ValueError/TypeError naming
    the bad field. The prompt and token checks are the ones ``SpecDecoder.prefill`` uses.

    The capacity rules differ, on purpose. The serving loop's rule (this one): the prompt
    plus the whole ``max_new_tokens`` budget must fit one slot's KV cache, so a request
    the loop accepts can never run out of cache half-way and lose its work.
    :meth:`graphburst.engine.decoder.SpecDecoder.check_first_burst_fits` (the decoder's, at prefill)
    only needs the prompt plus the tokens of one burst to fit; a caller driving the
    decoder directly may ask for more and is stopped by a ``CapacityError`` at the launch
    of a burst that would overflow.
    """
    if not isinstance(req, Request):
        raise TypeError(f"request must be a graphburst.serving.request.Request, got {type(req).__name__}")
    row = check_prompt("prompt", req.prompt, vocab)
    limit = check_int("max_new_tokens", req.max_new_tokens, maximum=UNBOUNDED_BUDGET - 1)
    eos = None if req.eos is None else check_int("eos", req.eos, minimum=0, maximum=vocab - 1)
    need = len(row) + limit
    if need > capacity:
        raise ValueError(f"prompt of {len(row)} tokens plus max_new_tokens={limit} needs "
                         f"{need} KV entries, but the cache holds {capacity}")
    return row, limit, eos


class SamplingOff(ValueError):
    """A request with temperature > 0 for a loop that decodes greedily; ``temperature`` is the request's.

    The message advises the Python remedy; a command (``graphburst serve``'s JSONL records) words its own.
    """

    def __init__(self, temperature: float):
        super().__init__(f"temperature {temperature} needs sampling, but this loop decodes greedily "
                         f"(build it with ServeLoop(..., sampling=True))")
        self.temperature = temperature


def check_request_sampling(req: Request, *, sampling: bool, fields: bool = False,
                           vocab: int | None = None) -> SamplingParams:
    """A request's sampling settings, validated (ValueError/TypeError naming the field and value).

    ``sampling`` says whether the loop decodes with rejection sampling; without it a
    request with temperature > 0 is refused. A sampled request with no seed gets a random one.
    ``fields``: the loop's decoder applies the logits processing fields (else a request that
    sets one is refused); ``vocab`` bounds ``logit_bias``'s token ids.
    """
    names = ("temperature", "top_k", "top_p", "seed") + tuple(FIELD_DEFAULTS)
    given = {f: getattr(req, f) for f in names if getattr(req, f) is not None}
    params = check_sampling(**given, vocab=vocab)
    used = params.fields
    if used and not fields:
        name = next(iter(used))
        raise ValueError(f"{name} = {used[name]!r} needs logits processing on the device, which this loop does not "
                         f"run (build it with ServeLoop(..., sampling=True, fields=True), or run graphburst serve "
                         f"--sampling --fields)")
    if params.temperature > 0 and not sampling:
        raise SamplingOff(params.temperature)
    if params.temperature > 0 and req.seed is None:
        params = dataclasses.replace(params, seed=secrets.randbits(64))
    return params


@dataclasses.dataclass(eq=False)
class RequestState:
    """A request in flight: its tokens so far and its timings (perf_counter seconds).

    While the request holds a batch slot its tokens, deliveries and accept counters live
    in the loop's :class:`~graphburst.serving.slot_tokens.SlotTokens` rows (filled with one
    vectorised copy per burst) and the properties below read them; when it leaves the
    slot they are copied out once as arrays.
    """

    request: Request
    slot: int | None = None
    submitted: float = 0.0
    admitted: float | None = None  # when it took a batch slot (its prefill follows at that boundary)
    finished: float | None = None
    cancelled: bool = False
    error: str | None = None  # why the loop gave up on this request; None unless finish_reason == "error"
    line: int | None = None  # the input line it came from (JSONL serving), if any
    owner: object = None  # whoever forwards its tokens (the HTTP engine's Ticket), found from ServeLoop.log
    slot_options: object = None  # the models' validated view of request.options (SpecDecoder.slot_options)
    sampling: SamplingParams | None = None  # validated sampling settings, seed filled in (check_request_sampling)
    # Validated at submission (check_whole_request_fits); admission reads these, never the Request.
    row: np.ndarray | None = None  # [n] int32 prompt
    limit: int = 0  # max_new_tokens
    eos: int | None = None
    _store: SlotTokens | None = None  # the loop's rows while this request runs in ``slot``
    _tokens: object = dataclasses.field(default_factory=list)  # once out of the slot: [n] int32 array, or a list
    _when: np.ndarray | None = None  # [d] float64 delivery times, once out of the slot
    _count: np.ndarray | None = None  # [d] int32 tokens per delivery, once out of the slot
    _acc: tuple = (0, 0)
    _read: int = 0  # tokens already yielded by ServeLoop.stream/astream

    # ------------------------------------------------------------------ reads

    @property
    def tokens(self) -> list:
        """Every token delivered so far (a new list while running; the final list once done)."""
        if self._store is not None:
            return self._store.read(self.slot)
        if isinstance(self._tokens, np.ndarray):  # built once, on the first read after leaving the slot
            self._tokens = self._tokens.tolist()
        return self._tokens

    @property
    def n_tokens(self) -> int:
        """``len(tokens)`` without building the list."""
        return len(self._tokens) if self._store is None else int(self._store.n[self.slot])

    def tokens_since(self, start: int) -> list:
        """``tokens[start:]``, reading only the new part."""
        if self._store is not None:
            return self._store.read(self.slot, start)
        part = self._tokens[start:]
        return part.tolist() if isinstance(part, np.ndarray) else part

    @property
    def deliveries(self) -> list:
        """``[(time, n_tokens), ...]``: the first token alone (handed out after the prefill, unless
        a lockstep loop serves it), then one per burst that delivered tokens to this request."""
        if self._store is not None:
            return self._store.deliveries(self.slot)
        if self._when is None:
            return []
        return list(zip(self._when.tolist(), self._count.tolist()))

    @property
    def last_delivery(self) -> float | None:
        """Time of the latest delivery, None before the first."""
        if self._store is not None:
            return self._store.last_time(self.slot)
        return float(self._when[-1]) if self._when is not None and len(self._when) else None

    @property
    def first_token(self) -> float | None:
        if self._store is not None:
            return self._store.first_time(self.slot)
        return float(self._when[0]) if self._when is not None and len(self._when) else None

    @property
    def accepted(self) -> int:
        """Drafts accepted, from the device counters."""
        return int(self._store.acc[self.slot, 0]) if self._store is not None else self._acc[0]

    @property
    def rounds(self) -> int:
        return int(self._store.acc[self.slot, 1]) if self._store is not None else self._acc[1]

    def _detach(self) -> None:
        """Copy this request's values out of the loop's rows (it is leaving its slot): array copies only."""
        store, b = self._store, self.slot
        if store is None:
            return
        self._tokens, self._when, self._count = store.take(b)
        self._acc = (int(store.acc[b, 0]), int(store.acc[b, 1]))
        self._store = None

    @staticmethod
    def _finish_rows(states: list, store: SlotTokens, slots: np.ndarray, now: float) -> None:
        """Requests ``states`` (``states[i]`` in ``slots[i]``) finished together at ``now``:
        :meth:`_detach` each (:meth:`SlotTokens.take_rows`, one call for all) and set ``finished``."""
        tokens, when, count, acc = store.take_rows(slots)
        for state, t, w, c, a in zip(states, tokens, when, count, acc):
            state._tokens, state._when, state._count, state._acc, state._store, state.finished = t, w, c, a, None, now

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
        eos = self.request.eos if self.row is None else self.eos  # the validated value once submitted
        if eos is not None and len(self._tokens) and self._tokens[-1] == eos:
            return "eos"
        return "length"

    def stats(self) -> dict:
        """Time to first token (and its two parts: the wait for a slot, then the prefill up to the
        first token's hand-out), tokens/s and mean accepted drafts per round."""
        first, admitted = self.first_token, self.admitted
        ttft = None if first is None else (first - self.submitted) * 1e3
        # Tokens arrive a burst at a time, so rate is taken over the request's whole life.
        span = (self.finished or time.perf_counter()) - self.submitted
        rounds = self.rounds
        return {
            "ttft_ms": ttft,
            "queue_ms": None if admitted is None else (admitted - self.submitted) * 1e3,
            "prefill_ms": None if first is None or admitted is None else (first - admitted) * 1e3,
            "tokens_per_s": self.n_tokens / span if span > 0 else None,
            "accepted_per_round": self.accepted / rounds if rounds else None,
        }

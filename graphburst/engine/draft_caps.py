"""Per-request speculation settings inside the one captured burst: a draft cap per slot.

A request may ask for fewer drafts a round than the decoder's ``k`` (the option ``k``; 0 is
plain decoding), and a decoder built with ``spec_max_batch`` switches speculation off for
every slot while more slots than that are active. Both are one kernel after each round's
draft chain (``cap_drafts``): a slot whose chain proposed more than its cap gets
``brk = [cap, 1]``, as if the chain broke there, so its round commits at most cap + 1
tokens. Every accept, greedy or sampled, already reads ``n_valid = clamp(brk[b, 0], 0, k)``
(the p-min break), so the tokens are those of a decoder with k = cap, and a sampled
request keeps its distribution.

What a cap saves is accepted work, not the round's compute: the graph still runs every
draft step and verifies k + 1 positions for every slot, since its shapes are fixed at
capture. A capped request (or a batch over ``spec_max_batch``) decodes at the cost of a
full speculative round per token it commits.

The cap of each slot is an option column (:mod:`graphburst.engine.admission.options`):
admission's one ``admit_slots`` launch writes it with the models' columns, so a refill
adds no launch and no upload.
"""

from __future__ import annotations

import functools

import numpy as np

from ..constants import NO_BATCH_LIMIT
from ..validate import check_int
from .program import Call

#: the request option a :class:`DraftCaps` reads
K_OPTION = "k"


class DraftCaps:
    """The per-slot draft caps of one decoder, and its batch-size switch.

    Parameters
    ----------
    batch, k : int
        The decoder's slots and drafts per round (k = 0, plain decoding: the option may only
        be 0, and there is no column and no launch).
    backend
        Allocates the cap column (on the current stream: build it under the decoder's).
    spec_max_batch : int or None
        Speculation is off (every cap 0) while more than this many slots are active
        (budget > 0); None never switches it off.

    Attributes
    ----------
    k_cap : [B] int32 device array
        Each slot's cap, ``k`` until a request asks for fewer (the option column).
    max_batch : int
        ``spec_max_batch``, or ``NO_BATCH_LIMIT``.
    """

    option_keys = frozenset({K_OPTION})

    def __init__(self, batch: int, k: int, backend, *, spec_max_batch: int | None = None):
        self.batch = check_int("batch", batch)
        self.k = check_int("k", k, minimum=0)
        self.max_batch = NO_BATCH_LIMIT if spec_max_batch is None else \
            check_int("spec_max_batch", spec_max_batch, minimum=0, maximum=NO_BATCH_LIMIT - 1)
        self.k_cap = backend.zeros((self.batch,), np.int32)  # [B] int32: drafts a slot's rounds may accept
        self.k_cap[...] = self.k

    def __repr__(self) -> str:
        limit = None if self.max_batch == NO_BATCH_LIMIT else self.max_batch
        return f"DraftCaps(batch={self.batch}, k={self.k}, spec_max_batch={limit})"

    # ------------------------------------------------------------------ the option hooks

    def slot_options(self, options: dict) -> tuple:
        """``(cap,)`` for one request's ``{"k": n}`` (``n`` in ``[0, k]``), ``(k,)`` without it; ``()``
        when k = 0 (nothing to cap)."""
        unknown = set(options) - self.option_keys
        if unknown:
            raise ValueError(f"unknown speculation option {sorted(unknown)[0]!r}")
        value = options.get(K_OPTION, self.k)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"option {K_OPTION!r} (drafts a round) must be an int in [0, {self.k}], got {value!r}")
        if not 0 <= value <= self.k:
            raise ValueError(f"option {K_OPTION!r} (drafts a round) must be in [0, {self.k}] (the decoder's k), "
                             f"got {value}")
        return (int(value),) if self.k else ()

    def option_columns(self) -> tuple:
        return (self.k_cap,) if self.k else ()

    def watched(self) -> tuple:
        return ()

    # ------------------------------------------------------------------ the round's call

    def call(self, ops, bufs) -> Call:
        """The ``cap_drafts`` launch of one round over ``bufs`` (after its draft chain)."""
        return Call("cap_drafts", functools.partial(ops.cap_drafts, bufs.budget, self.k_cap, bufs.brk, k=self.k,
                                                    max_batch=self.max_batch))

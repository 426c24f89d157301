"""Which request each batch slot of the serving loop holds, and where it stands.

Every part of :class:`~graphburst.serving.loop.ServeLoop` reads and writes the same slot state:
the boundary (:mod:`~graphburst.serving.admit`) frees and fills slots, delivery
(:mod:`~graphburst.serving.delivery`) appends a drained burst to them and frees those that
finished, and first tokens (:mod:`~graphburst.serving.first_tokens`) mark the slots whose
first token went out early. :class:`SlotTable` is that state, one object the loop builds and
hands to each part: per-slot arrays (so a burst's bookkeeping is a few vectorised writes),
the counts that let a step skip a scan, and the token rows (:class:`~.slot_tokens.SlotTokens`).
It knows nothing about the decoder, the intake or the log.
"""

from __future__ import annotations

import numpy as np

from .request import RequestState
from .slot_tokens import SlotTokens

#: ``SlotTable.first_copy`` of a slot with no first-token copy pending (copy ids start above it).
NO_COPY = 0


class SlotTable:
    """The per-slot state of a serving loop.

    Parameters
    ----------
    batch : int
        Batch slots.
    max_tokens : int
        Most tokens one request can receive (the decoder's KV capacity).
    burst_tokens : int
        Most tokens one burst delivers to a slot (the ring capacity, M * (k + 1)).

    Attributes
    ----------
    slots : list of RequestState or None
        ``[B]``: the request each slot holds (done or not), None for a free slot.
    slot_state : [B] object ndarray
        The same, indexable by an array of slots (delivery's gathers).
    running : [B] bool
        The slot holds a request that is not done: bursts' tokens reach it.
    prefilling : dict
        Slot -> prompt tokens already in the caches, admission order, for slots whose prompt
        is still being prefilled (such a slot holds its request but is idle in bursts).
    first_copy : [B] int64
        The first-token copy holding the slot's first token (:data:`NO_COPY`: none pending).
    lead : [B] bool
        The slot's first token was handed out early; its first burst is not yet drained.
    n_occupied, n_stale, n_lead : int
        Slots holding a request; of those, holding one that is done (freed at the next
        boundary); slots with ``lead`` set. Kept so a step tests an int, not an array.
    store : SlotTokens
        The slots' token rows, deliveries and accept counters.
    """

    __slots__ = ("batch", "slots", "slot_state", "running", "prefilling", "first_copy", "lead", "n_occupied",
                 "n_stale", "n_lead", "store")

    def __init__(self, batch: int, max_tokens: int, burst_tokens: int):
        self.batch = int(batch)
        self.slots: list[RequestState | None] = [None] * self.batch
        self.slot_state = np.full(self.batch, None, object)  # [B] object
        self.running = np.zeros(self.batch, bool)  # [B] bool
        self.prefilling: dict[int, int] = {}
        self.first_copy = np.full(self.batch, NO_COPY, np.int64)  # [B] int64
        self.lead = np.zeros(self.batch, bool)  # [B] bool
        self.n_occupied = 0
        self.n_stale = 0
        self.n_lead = 0
        # Tokens land in per-slot rows (one vectorised copy per burst); a request's
        # Python list is built when read or when it finishes.
        self.store = SlotTokens(self.batch, max_tokens, burst_tokens)

    def steady(self) -> bool:
        """Every batch slot runs a request (the window of the steady-state idle figure)."""
        return self.n_occupied == self.batch and self.n_stale == 0

    def free_slots(self) -> list:
        """Slots holding no request, ascending."""
        return [b for b, s in enumerate(self.slots) if s is None]

    def stale_slots(self) -> list:
        """Slots holding a request that is done (finished, cancelled or failed), ascending."""
        return [b for b, s in enumerate(self.slots) if s is not None and s.done]

    def held_slots(self) -> list:
        """Slots holding a request, done or not, ascending."""
        return [b for b, s in enumerate(self.slots) if s is not None]

    def occupy(self, slots: list, states: list) -> None:
        """Give ``states[i]`` the free slot ``slots[i]``: it holds the slot, its prompt still to prefill."""
        slots_of, slot_state, store = self.slots, self.slot_state, self.store
        for b, state in zip(slots, states):
            state.slot, state._store = b, store
            slots_of[b] = slot_state[b] = state  # an element at a time: a fancy write of objects costs more
        self.prefilling.update(dict.fromkeys(slots, 0))
        self.n_occupied += len(slots)
        store.reset(slots)

    def free(self, slots: list, index: np.ndarray | None = None) -> None:
        """Empty ``slots``; ``index``: the same as an int64 array, where the caller has one (the
        array writes below then convert no list)."""
        index = slots if index is None else index
        prefilling = self.prefilling
        for b in slots:
            self.slots[b] = None
            prefilling.pop(b, None)
        self.slot_state[index] = None
        self.n_occupied -= len(slots)
        self.first_copy[index] = NO_COPY  # a copy still pending for them is for nobody now
        if self.n_lead:
            self.n_lead -= np.count_nonzero(self.lead[index])
            self.lead[index] = False

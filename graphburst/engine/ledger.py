"""The host's record of every batch slot, shared by the decoder (bursts) and its admission (slots).

A :class:`SlotLedger` holds the host mirror of what has been drained (position, budget and
stop token per slot), the slot generations and the bursts in flight per sequence, and the
count of bursts that still fit every live slot. The decoder advances it at each launch and
drain; :class:`~graphburst.engine.admission.slots.Admission` writes it at each prefill and
release. One object both hold, not attributes one reads off the other: neither needs the
other to keep it.

A slot's **generation** changes whenever it is prefilled or released. A burst remembers
the generations it was launched under; when it is drained, the tokens it committed for a
slot whose generation has changed since are dropped (they belonged to the slot's previous
sequence, a finished or cancelled one), and the mirror ignores them.
"""

from __future__ import annotations

import collections

import numpy as np

from ..constants import NO_EOS

#: ``bursts_that_fit``'s value for a slot that any number of bursts fits (idle, finished, or its
#: whole budget fits the cache)
ANY_NUMBER = np.iinfo(np.int64).max


class SlotLedger:
    """Per-slot host state of one decoder.

    Parameters
    ----------
    batch : int
        Slots (B).
    capacity : int
        KV entries per slot (the smaller of the two models' caches).
    ring_capacity : int
        The most tokens one burst commits for a slot.

    Attributes
    ----------
    pos, left, eos : [B] int64
        The host mirror: each slot's position, tokens still allowed (0 = idle or finished;
        ``UNBOUNDED_BUDGET`` for no limit) and stop token (``NO_EOS`` for none). Updated in
        place only: the decoder's C drain (``host_ops.Mirror``) holds their addresses.
    gen : [B] int64
        Slot generations (updated in place, as ``pos``).
    epoch : int
        Bumped with any slot's generation: a drain compares generations only when it moved.
    launch_gen : deque of [epoch, [B] int64 or None]
        One entry per burst in flight, oldest first: the epoch at its launch, and the
        generations it was launched under, copied only when they change with the burst in
        flight (:meth:`new_generation`), not at every launch.
    inflight : [B] int64
        Bursts in flight that commit for each slot's current sequence (updated in place).
    launchable : int
        A lower bound on the bursts, beyond those in flight, that fit every live slot
        (``ANY_NUMBER`` when any number does); exact after :meth:`update_fits`.
    """

    def __init__(self, batch: int, capacity: int, ring_capacity: int):
        self.capacity, self.ring_capacity = capacity, ring_capacity
        self.pos = np.zeros(batch, np.int64)  # [B] int64
        self.left = np.zeros(batch, np.int64)  # [B] int64
        self.eos = np.full(batch, NO_EOS, np.int64)  # [B] int64
        self.gen = np.zeros(batch, np.int64)  # [B] int64
        self.epoch = 0
        self.launch_gen: collections.deque = collections.deque()
        self.inflight = np.zeros(batch, np.int64)  # [B] int64
        self.launchable = 0  # nothing is live before prefill

    def new_generation(self, slots: np.ndarray) -> None:
        """Slots (``[n]`` int64) prefilled or released: bursts in flight no longer commit for
        their sequence."""
        launch_gen = self.launch_gen
        if launch_gen and launch_gen[-1][1] is None:
            launched = self.gen.copy()  # the generations every burst launched since the last change saw
            for entry in reversed(launch_gen):
                if entry[1] is not None:
                    break
                entry[1] = launched
        self.gen[slots] += 1
        self.epoch += 1
        self.inflight[slots] = 0

    def bursts_that_fit(self) -> np.ndarray:
        """``[B]`` int64: how many more bursts each slot can take beyond those in flight for
        it; ``ANY_NUMBER`` when any number can.

        Over n bursts a live slot writes at most ``min(left, n * ring_capacity)`` tokens
        (its budget bounds it, and so does the ring), so n bursts fit iff
        ``pos + min(left, n * R) <= capacity``. A slot whose whole remaining budget fits
        never limits the count; idle and finished slots write nothing. Only the bursts
        launched since the slot's sequence was admitted count against it.
        """
        left = self.left
        whole_budget_fits = self.pos + left <= self.capacity
        by_ring = np.maximum(self.capacity - self.pos, 0) // self.ring_capacity - self.inflight
        return np.where((left <= 0) | whole_budget_fits, ANY_NUMBER, by_ring)

    def update_fits(self) -> None:
        """Recompute exactly how many more bursts fit every live slot."""
        self.launchable = int(self.bursts_that_fit().min(initial=ANY_NUMBER))

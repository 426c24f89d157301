"""One drained burst's committed tokens on the host: :class:`BurstTokens` over a copy of the ring.

The numpy path copies the ring (:func:`split_ring`) and clamps its counts here; the C path
(``host_ops.c``'s ``gb_drain``) fills a block of ring, counts and accept counters that
:meth:`BurstTokens.of_block` views.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .constants import PLACEHOLDER_TOKEN, RING_COUNT_COLUMN


class BurstTokens(Sequence):
    """The committed tokens of one burst, per sequence, over one host copy of the ring.

    Indexing gives sequence b's tokens as a ``[n_b] int32`` view; ``counts`` has every
    ``n_b`` at once, so the host never loops over sequences unless the caller does.

    Parameters
    ----------
    ring_host : [B, R] int32 numpy array
        A host copy of the ring (column 0 = count); it is owned by this object.
    """

    #: The address of the host block the views lie in (:meth:`of_block`), else None.
    addr = None
    #: Rounds the burst ran, for a device-exit burst (which may end before M); else None.
    rounds = None

    def __init__(self, ring_host: np.ndarray):
        self.data = ring_host
        # np.minimum/maximum, not np.clip: the same values at a third of the cost (once per burst on the host path)
        self.counts = np.minimum(np.maximum(ring_host[:, RING_COUNT_COLUMN], 0), ring_host.shape[1] - 1)  # [B]

    @classmethod
    def of_block(cls, block: np.ndarray, addr: int, batch: int) -> BurstTokens:
        """Tokens over a drained block ``[B*R1 ring | B counts | 2B acc]`` int32 at ``addr``, whose
        counts are filled in already (``host_ops.c``'s ``gb_drain``); ``acc``: ``[B, 2]`` view."""
        tokens = cls.__new__(cls)
        ring = block.size - 3 * batch
        tokens.data = block[:ring].reshape(batch, -1)  # [B, R1]
        tokens.counts = block[ring: ring + batch]  # [B]
        tokens.acc = block[ring + batch:].reshape(batch, 2)  # [B, 2]
        tokens.addr = addr
        return tokens

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, b):
        if isinstance(b, slice):
            return [self[i] for i in range(*b.indices(len(self)))]
        return self.data[b, 1 : 1 + self.counts[b]]

    def drop(self, rows: np.ndarray) -> None:
        """Forget the tokens of ``rows`` (``[B]`` bool): their counts become 0 (in place: a block's
        counts stay its view)."""
        np.copyto(self.counts, 0, where=rows)
        self.data[rows, RING_COUNT_COLUMN] = 0

    def drop_first(self, rows: np.ndarray) -> None:
        """Forget the first token of ``rows`` (``[r]`` int, each with a count > 0): the rest move up one."""
        self.data[rows, 1:-1] = self.data[rows, 2:]
        self.counts[rows] -= 1
        self.data[rows, RING_COUNT_COLUMN] = self.counts[rows]

    @property
    def total(self) -> int:
        """Tokens committed over the whole batch."""
        return int(self.counts.sum())

    def tail(self) -> np.ndarray:
        """``[B]`` each row's ring entry at its count: the last committed token where the count
        is > 0, the count column where it is 0 (so only meaningful where ``counts > 0``)."""
        width = self.data.shape[1]
        # One 1-D gather at flat offsets: a third of the cost of a 2-D fancy index.
        return self.data.ravel()[np.arange(0, width * len(self), width) + self.counts]

    def last(self) -> np.ndarray:
        """``[B]`` last committed token per sequence, PLACEHOLDER_TOKEN where none."""
        return np.where(self.counts > 0, self.tail(), PLACEHOLDER_TOKEN)


def split_ring(ring_host: np.ndarray) -> BurstTokens:
    """Per-sequence tokens of a host copy of ``ring [B, R] int32`` (copied, so the source may be reused)."""
    return BurstTokens(ring_host.copy())

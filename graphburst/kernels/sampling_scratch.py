"""Scratch buffers of the sampling kernels: per-tile partials at fixed addresses.

The sampling kernels cut each vocabulary row into tiles of ``SAMPLE_TILE`` tokens, one
block per tile, and pass per-tile partials from one kernel to the next through these
buffers. A decoder allocates them once with its other sampling buffers
(``StreamBufs.SAMPLING_LAYOUT`` includes :data:`SCRATCH_LAYOUT`), so a burst graph bakes
in their addresses and the captured region never allocates. Every cell a kernel reads
was written earlier in the same call (stale contents never matter), except the top-k /
top-p select's :data:`ZEROED` accumulators: they are allocated zeroed and the kernels
re-zero every cell they used before the call ends, so every graph replay starts clean.
"""

from __future__ import annotations

import numpy as np

from ..constants import RACES_PER_ROW, SAMPLE_TILE, SELECT_BINS


def n_tiles(vocab: int) -> int:
    """Tiles of ``SAMPLE_TILE`` tokens covering a row of ``vocab`` (the last may be partial)."""
    return -(-int(vocab) // SAMPLE_TILE)


#: name -> (shape as a function of (B, k, M, V), dtype). S = k + 1 scratch rows per
#: sequence: the most rows one sampling call works on (the target's k + 1 verify rows).
SCRATCH_LAYOUT = {
    "sel_thr": (lambda b, k, m, v: (b, k + 1), np.uint64),  # [B, S] smallest order key kept by top-k/top-p; 0 = all
    "tile_key": (lambda b, k, m, v: (b, k + 1, n_tiles(v)), np.uint64),  # [B, S, n_t] tile max order key
    "tile_sum": (lambda b, k, m, v: (b, k + 1, n_tiles(v)), np.float32),  # [B, S, n_t] tile sum of e
    "race_key": (lambda b, k, m, v: (b, k + 1, RACES_PER_ROW, n_tiles(v)), np.uint64),  # [B, S, 2, n_t] tile winner
    "race_w": (lambda b, k, m, v: (b, k + 1, RACES_PER_ROW, n_tiles(v)), np.float32),  # [B, S, 2, n_t] its weight
    # The top-k / top-p select (spec_probs_select):
    "sel_part": (lambda b, k, m, v: (b, k + 1, n_tiles(v)), np.uint64),  # [B, S, n_t] chunk max order key
    "sel_tick": (lambda b, k, m, v: (b, k + 1), np.uint32),  # [B, S] blocks of a row done; zero between calls
    "sel_hist": (lambda b, k, m, v: (b, k + 1, SELECT_BINS), np.uint32),  # [B, S, BINS] first-digit counts; zero
}

#: Scratch that must be zero when a call starts (allocated zeroed; the kernels leave it so).
ZEROED = frozenset({"sel_tick", "sel_hist"})


class SampleScratch:
    """The sampling scratch of :data:`SCRATCH_LAYOUT` on its own, for kernels run outside a
    decoder (tests, micro-benchmarks). A decoder's ``StreamBufs`` carries the same names.

    Parameters
    ----------
    batch : int
    rows : int
        Scratch rows per sequence (S): at least the rows of any call that uses it.
    vocab : int
    xp : module
        ``numpy`` or ``cupy``.
    """

    def __init__(self, batch: int, rows: int, vocab: int, xp=np):
        for name, (shape, dtype) in SCRATCH_LAYOUT.items():
            setattr(self, name, xp.zeros(shape(batch, rows - 1, 0, vocab), dtype))

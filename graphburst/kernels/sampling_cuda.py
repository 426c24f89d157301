"""Thin cupy wrappers for the sampling kernels in ``kernels.cu`` (temperature, top-k/top-p,
the draft race, lossless speculative acceptance), and the ops that compose them.

The same contract as :mod:`graphburst.kernels.cuda_ops`, whose memoized ``RawModule`` and
``_launch`` these wrappers share: each has the signature of its numpy twin in
``sampling_ref.py``, never allocates and never syncs. :mod:`graphburst.kernels.cuda_ops`
re-exports every public name here, so the backend's ``ops`` namespace is unchanged.
"""

from __future__ import annotations

import numpy as np

from ..constants import SAMPLE_THREADS, SELECT_THREADS
from .sampling_scratch import n_tiles

# One block of SAMPLE_THREADS per (tile of SAMPLE_TILE tokens, row): several blocks per row.
# Threads and tile size are part of the bit-exact contract with sampling_ref.py (they fix
# the summation order), so they are not tunable here. ``scratch`` is the decoder's
# StreamBufs (or a sampling_scratch.SampleScratch): per-tile partials at fixed addresses.

_PICK_THREADS = 32  # the pick kernels are one warp per row


def _scratch_rows(scratch, batch, rows, vocab) -> int:
    """Scratch rows per sequence (S), after checking the scratch fits the call."""
    s_rows, nt = scratch.tile_key.shape[1], scratch.tile_key.shape[2]
    assert scratch.tile_key.shape[0] >= batch and s_rows >= rows and nt == n_tiles(vocab), \
        (scratch.tile_key.shape, batch, rows, vocab)
    return s_rows


def _tile_grid(batch, vocab, step, n_rows):
    """(kernel step argument, grid) of a per-(tile, row) kernel: x = b * n_tiles + tile, y = row."""
    step_arg, grid_y = _step_arg(step, n_rows)
    return step_arg, (batch * n_tiles(vocab), grid_y)


_SELECT_BLOCKS = 512  # select blocks to aim for (a few per SM): rows split into chunks to reach it


def _select_grid(batch, vocab, step, n_rows):
    """(kernel step argument, chunks per row, grid) of ``spec_probs_select``: x = b * n_chunks
    + chunk, y = row. Chunks cut a row into equal runs (integer results: any split gives
    the same bits); at most one per SAMPLE_TILE tokens, the size of ``sel_part``."""
    step_arg, grid_y = _step_arg(step, n_rows)
    n_chunks = max(1, min(n_tiles(vocab), -(-_SELECT_BLOCKS // (batch * grid_y))))
    return step_arg, n_chunks, (batch * n_chunks, grid_y)


def probs_select(logits, temperature, top_k, top_p, scratch, *, step=None, min_p=None, stream):
    """``spec_probs_select``: ``scratch.sel_thr[b, r]`` <- the smallest order key min-p/top-k/top-p
    keep (``sampling_ref.select_thr``, bit for bit).

    One launch, grid (B * n_chunks, rows), SELECT_THREADS threads: the chunks find the row
    max and top-k's first radix digit; the row's last block finishes the select alone.
    Returns at once (thr 0) for rows without filters. Reads and re-zeroes
    ``scratch.sel_tick`` and ``scratch.sel_hist``.

    Parameters
    ----------
    logits : [B, T, V] float32
    temperature, top_p : [B] float32
    top_k : [B] int32
    scratch : StreamBufs or SampleScratch
    step : int or None
    min_p : [B] float32 or None (off)
    """
    batch, n_rows, vocab = logits.shape
    step_arg, n_chunks, grid = _select_grid(batch, vocab, step, n_rows)
    s_rows = _scratch_rows(scratch, batch, n_rows, vocab)
    args = (_i32(n_rows), _i32(vocab), step_arg, _i32(s_rows), _i32(n_chunks), logits, temperature, top_k, top_p,
            np.uint64(0) if min_p is None else min_p, scratch.sel_thr, scratch.sel_part, scratch.sel_tick, scratch.sel_hist)
    _launch("spec_probs_select", grid, (SELECT_THREADS,), args, stream)


def probs_tiles(logits, temperature, probs, scratch, race=None, *, step=None, stream):
    """``spec_probs_tiles``: e relative to each tile's maximum into ``probs``, tile max keys and
    sums (and the draft race's tile winners when ``race`` = (seed [B], pos [B])) into scratch.

    Grid (B * n_tiles, rows), SAMPLE_THREADS threads. Reads ``scratch.sel_thr``.

    Parameters
    ----------
    logits : [B, T, V] float32
    temperature : [B] float32
    probs : [B, T, V] float32, written (may be ``logits``)
    scratch : StreamBufs or SampleScratch
    race : (seed [B] uint64, pos [B] int32) or None
    step : int or None
    """
    batch, n_rows, vocab = logits.shape
    step_arg, grid = _tile_grid(batch, vocab, step, n_rows)
    s_rows = _scratch_rows(scratch, batch, n_rows, vocab)
    block = (SAMPLE_THREADS,)
    seed, pos = race if race is not None else (np.uint64(0), np.uint64(0))
    args = (_i32(n_rows), _i32(vocab), step_arg, _i32(s_rows), _i32(race is not None), logits, temperature,
            scratch.sel_thr, seed, pos, probs, scratch.tile_key, scratch.tile_sum, scratch.race_key, scratch.race_w)
    _launch("spec_probs_tiles", grid, block, args, stream)


def probs_normalize(temperature, probs, scratch, draft=None, *, step=None, stream):
    """``spec_probs_normalize``: ``probs`` <- e * s_t / total (one-hot at temperature <= 0); with
    ``draft`` = (draft_tok [B, T], draft_prob [B, T]) also the draft's token from the race.

    Grid (B * n_tiles, rows), SAMPLE_THREADS threads, after :func:`probs_tiles`.

    Parameters
    ----------
    temperature : [B] float32
    probs : [B, T, V] float32, normalised in place
    scratch : StreamBufs or SampleScratch
    draft : (draft_tok, draft_prob) or None
    step : int or None
    """
    batch, n_rows, vocab = probs.shape
    step_arg, grid = _tile_grid(batch, vocab, step, n_rows)
    s_rows = _scratch_rows(scratch, batch, n_rows, vocab)
    block = (SAMPLE_THREADS,)
    tok, prob = draft if draft is not None else (np.uint64(0), np.uint64(0))
    args = (_i32(n_rows), _i32(vocab), step_arg, _i32(s_rows), _i32(draft is not None), temperature,
            scratch.tile_key, scratch.tile_sum, scratch.race_key, scratch.race_w, probs, tok, prob)
    _launch("spec_probs_normalize", grid, block, args, stream)


def race_tiles(q, seed, pos, scratch, *, step=None, stream):
    """``spec_race_tiles``: each tile's race winner over q (draw DRAW_DRAFT) into scratch.

    Grid (B * n_tiles, rows), SAMPLE_THREADS threads.

    Parameters
    ----------
    q : [B, T, V] float32
    seed : [B] uint64
    pos : [B] int32
    scratch : StreamBufs or SampleScratch
    step : int or None
    """
    batch, n_rows, vocab = q.shape
    step_arg, grid = _tile_grid(batch, vocab, step, n_rows)
    s_rows = _scratch_rows(scratch, batch, n_rows, vocab)
    block = (SAMPLE_THREADS,)
    args = (_i32(n_rows), _i32(vocab), step_arg, _i32(s_rows), q, seed, pos, scratch.race_key, scratch.race_w)
    _launch("spec_race_tiles", grid, block, args, stream)


def race_pick(vocab, scratch, draft_tok, draft_prob, *, step=None, stream):
    """``spec_race_pick``: the race winner of each (b, row) from the tile winners.

    Grid (B, rows), one warp.

    Parameters
    ----------
    vocab : int
    scratch : StreamBufs or SampleScratch
    draft_tok : [B, T] int32, written
    draft_prob : [B, T] float32, written
    step : int or None
    """
    batch, n_rows = draft_tok.shape
    step_arg, grid_y = _step_arg(step, n_rows)
    s_rows = _scratch_rows(scratch, batch, n_rows, vocab)
    grid = (batch, grid_y)
    block = (_PICK_THREADS,)
    args = (_i32(n_rows), _i32(vocab), step_arg, _i32(s_rows), scratch.race_key, scratch.race_w, draft_tok,
            draft_prob)
    _launch("spec_race_pick", grid, block, args, stream)


def accept_tiles(vtok, p, q, brk, seed, pos, scratch, *, stream):
    """``spec_accept_tiles``: the accepted prefix, then each tile's residual and bonus race.

    Grid (B * n_tiles,), SAMPLE_THREADS threads.

    Parameters
    ----------
    vtok : [B, K1] int32
    p : [B, K1, V] float32
    q : [B, k, V] float32
    brk : [B, 2] int32
    seed : [B] uint64
    pos : [B] int32
    scratch : StreamBufs or SampleScratch
    """
    batch, k1 = vtok.shape
    vocab = p.shape[2]
    s_rows = _scratch_rows(scratch, batch, 1, vocab)
    grid = (batch * n_tiles(vocab),)
    block = (SAMPLE_THREADS,)
    args = (_i32(k1 - 1), _i32(vocab), _i32(s_rows), vtok, p, q, brk, seed, pos, scratch.race_key, scratch.race_w)
    _launch("spec_accept_tiles", grid, block, args, stream)


def accept_pick(vtok, p, q, brk, seed, pos, n_acc, last_pred, scratch, *, stream):
    """``spec_accept_pick``: n_acc and last_pred from the tiles' race winners. Grid (B,), one warp.

    Parameters
    ----------
    vtok, p, q, brk, seed, pos : as :func:`accept_tiles`
    n_acc, last_pred : [B] int32, written
    scratch : StreamBufs or SampleScratch
    """
    batch, k1 = vtok.shape
    vocab = p.shape[2]
    s_rows = _scratch_rows(scratch, batch, 1, vocab)
    grid = (batch,)
    block = (_PICK_THREADS,)
    args = (_i32(k1 - 1), _i32(vocab), _i32(s_rows), vtok, p, q, brk, seed, pos, scratch.race_key, n_acc, last_pred)
    _launch("spec_accept_pick", grid, block, args, stream)


# Ops: the kernels composed, with the numpy twins' signatures.


def probs_from_logits(logits, temperature, top_k, top_p, probs, scratch=None, *, step=None, min_p=None, stream):
    """Temperature, min-p, top-k and top-p: logits -> normalized probabilities (see sampling_ref).

    Three launches: ``spec_probs_select`` (grid (B * n_chunks, rows), returns at once
    without filters), ``spec_probs_tiles`` and ``spec_probs_normalize`` (grid (B * n_tiles, rows)).

    Parameters
    ----------
    logits : [B, T, V] float32
    temperature : [B] float32 (<= 0: one-hot at the argmax)
    top_k : [B] int32 (0: off)
    top_p : [B] float32 (1: off)
    probs : [B, T, V] float32, written; may be ``logits`` (in place)
    scratch : StreamBufs or SampleScratch with at least T rows
    step : int or None
        Only row ``step`` of each sequence; None: all T rows.
    min_p : [B] float32 or None
        Per-row min-p (0: off); None: off everywhere.
    """
    probs_select(logits, temperature, top_k, top_p, scratch, step=step, min_p=min_p, stream=stream)
    probs_tiles(logits, temperature, probs, scratch, step=step, stream=stream)
    probs_normalize(temperature, probs, scratch, step=step, stream=stream)


def draft_probs_sample(logits, temperature, top_k, top_p, seed, pos, probs, draft_tok, draft_prob, scratch=None, *,
                       step=None, stream):
    """Draft rows' probabilities and the draft's proposal from them, in three launches.

    Parameters
    ----------
    logits : [B, k, V] float32
    temperature, top_k, top_p : [B] (as :func:`probs_from_logits`)
    seed : [B] uint64
    pos : [B] int32, position of ``vtok[b, 0]`` (row t proposes the token at pos + t + 1)
    probs : [B, k, V] float32, written; may be ``logits``
    draft_tok : [B, k] int32, written
    draft_prob : [B, k] float32, written (the drawn token's probability)
    scratch : StreamBufs or SampleScratch with at least k rows
    step : int or None
        Only draft row ``step``; None: all k rows.
    """
    probs_select(logits, temperature, top_k, top_p, scratch, step=step, stream=stream)
    probs_tiles(logits, temperature, probs, scratch, (seed, pos), step=step, stream=stream)
    probs_normalize(temperature, probs, scratch, (draft_tok, draft_prob), step=step, stream=stream)


def sample_draft(q, seed, pos, draft_tok, draft_prob, scratch=None, *, step=None, stream):
    """Sample draft row t of each sequence (the token at ``pos + t + 1``) from given q.

    Two launches: ``spec_race_tiles`` (grid (B * n_tiles, rows)) and ``spec_race_pick``
    (one warp per (b, row)).

    Parameters
    ----------
    q : [B, k, V] float32
    seed : [B] uint64
    pos : [B] int32, position of ``vtok[b, 0]``
    draft_tok : [B, k] int32, written
    draft_prob : [B, k] float32, written (q of the drawn token)
    scratch : StreamBufs or SampleScratch with at least k rows
    step : int or None
        Only draft row ``step``; None: all k rows.
    """
    race_tiles(q, seed, pos, scratch, step=step, stream=stream)
    race_pick(q.shape[2], scratch, draft_tok, draft_prob, step=step, stream=stream)


def accept_sample(vtok, p, q, brk, seed, pos, n_acc, last_pred, scratch=None, *, stream):
    """Lossless speculative sampling; outputs mean what :func:`accept_greedy`'s do.

    Two launches: ``spec_accept_tiles`` (grid (B * n_tiles,)) races the replacement or
    bonus token per tile, ``spec_accept_pick`` (one warp per sequence) combines.

    Parameters
    ----------
    vtok : [B, K1] int32
    p : [B, K1, V] float32 target probabilities
    q : [B, k, V] float32 draft probabilities
    brk : [B, 2] int32
    seed : [B] uint64
    pos : [B] int32, position of ``vtok[b, 0]``
    n_acc : [B] int32, written (accepted drafts)
    last_pred : [B] int32, written (replacement or bonus token)
    scratch : StreamBufs or SampleScratch (one row is enough)
    """
    accept_tiles(vtok, p, q, brk, seed, pos, scratch, stream=stream)
    accept_pick(vtok, p, q, brk, seed, pos, n_acc, last_pred, scratch, stream=stream)


# Imported last, not first: cuda_ops re-exports this module's names, so whichever of
# the two is imported first, the other finds every name it needs already defined.
from .launch import _i32, _launch, _step_arg

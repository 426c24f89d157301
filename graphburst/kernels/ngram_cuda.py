"""Thin cupy wrappers of the prompt-lookup kernels (``kernels/ngram.cuh``); twins in ``ngram_ref``."""

from __future__ import annotations

from ..constants import NGRAM_THREADS, THREADS_PER_BLOCK
from .launch import _blocks, _i32, _launch, _or_null


def ngram_prefill(prompt, prompt_len, hist, hist_len, *, start=None, stream):
    """Copy prompts (or one chunk of each) into the history at ``start``.

    Parameters
    ----------
    prompt : [B, P_max] int32
    prompt_len : [B] int32, NO_PREFILL for rows left alone
    hist : [B, capacity] int32, written
    hist_len : [B] int32, written
    start : [B] int32 or None (all 0), the position of ``prompt[:, 0]``
    """
    batch, p_max = prompt.shape
    grid = (batch, _blocks(p_max, THREADS_PER_BLOCK))
    block = (THREADS_PER_BLOCK,)
    args = (_i32(p_max), _i32(hist.shape[1]), prompt, prompt_len, _or_null(start), hist, hist_len)
    _launch("ngram_prefill", grid, block, args, stream)


def ngram_search(vtok, pos_ctr, budget, n_min, n_max, hist, hist_len, draft_tok, draft_conf, brk, *, write_vtok,
                 stream):
    """One round's proposals of every sequence (see ``ngram_ref.ngram_search``).

    Parameters
    ----------
    vtok : [B, k + 1] int32, slot 0 read, slots 1..k written when ``write_vtok``
    pos_ctr, budget, n_min, n_max : [B] int32
    hist : [B, capacity] int32, read and extended
    hist_len : [B] int32, written
    draft_tok : [B, k] int32, written
    draft_conf : [B, k] float32, written
    brk : [B, 2] int32, written
    """
    batch, k = draft_tok.shape
    grid = (batch,)
    block = (NGRAM_THREADS,)
    args = (_i32(k), _i32(hist.shape[1]), _i32(bool(write_vtok)), vtok, pos_ctr, budget, n_min, n_max, hist, hist_len,
            draft_tok, draft_conf, brk)
    _launch("ngram_search", grid, block, args, stream)


def ngram_onehot_logits(prop, brk, logits, *, step, stream):
    """Sampling mode: draft row ``step`` as the one-hot logits of the proposals.

    Parameters
    ----------
    prop : [B, k] int32 proposals
    brk : [B, 2] int32
    logits : [B, k, V] float32, row ``step`` written
    """
    batch, k, vocab = logits.shape
    grid = (batch, _blocks(vocab, THREADS_PER_BLOCK))
    block = (THREADS_PER_BLOCK,)
    _launch("ngram_onehot_logits", grid, block, (_i32(k), _i32(vocab), _i32(step), prop, brk, logits), stream)


def ngram_append(draft_tok, pos_ctr, brk, hist, *, stream):
    """Sampling mode: the sampled drafts before the break into the history after ``pos_ctr``.

    Parameters
    ----------
    draft_tok : [B, k] int32
    pos_ctr : [B] int32
    brk : [B, 2] int32
    hist : [B, capacity] int32, written
    """
    batch, k = draft_tok.shape
    grid = (batch, _blocks(k, THREADS_PER_BLOCK))
    block = (THREADS_PER_BLOCK,)
    _launch("ngram_append", grid, block, (_i32(k), _i32(hist.shape[1]), draft_tok, pos_ctr, brk, hist), stream)

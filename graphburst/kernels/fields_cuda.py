"""Thin cupy wrappers for the logits processing kernels in ``kernels/fields.cuh``.

Each has the signature of its numpy twin in ``fields_ref.py`` (bit for bit), never allocates
and never syncs, so it can run inside a stream capture.
"""

from __future__ import annotations

from ..constants import FIELDS_SPAN, FIELDS_THREADS, MAX_K
from .launch import _blocks, _i32, _launch, _step_arg


def apply_fields(logits, vtok, pos, counts, prompt_seen, prompt_len, eos, min_tokens, presence, frequency, repetition,
                 bias_ids, bias_val, n_bias, *, step=None, stream):
    """``spec_apply_fields``: the fields applied to ``logits`` in place (``fields_ref.apply_fields``).

    Grid (B * ceil(V / FIELDS_SPAN), rows), FIELDS_THREADS threads; a block of a slot no field
    changes returns at once.

    Parameters
    ----------
    logits : [B, T, V] float32, in place
    vtok : [B, K1] int32
    pos, prompt_len, eos, min_tokens, n_bias : [B] int32
    counts : [B, V] int32
    prompt_seen : [B, V] uint8
    presence, frequency, repetition : [B] float32
    bias_ids : [B, NB] int32, bias_val : [B, NB] float32
    step : int or None: only row ``step``
    """
    batch, n_rows, vocab = logits.shape
    k1 = vtok.shape[1]
    assert k1 <= MAX_K + 1 and counts.shape == (batch, vocab) and prompt_seen.shape == (batch, vocab)
    step_arg, grid_y = _step_arg(step, n_rows)
    grid = (batch * _blocks(vocab, FIELDS_SPAN), grid_y)
    args = (_i32(n_rows), _i32(vocab), _i32(k1), step_arg, logits, vtok, pos, counts, prompt_seen, prompt_len, eos,
            min_tokens, presence, frequency, repetition, bias_ids, bias_val, n_bias, _i32(bias_ids.shape[1]))
    _launch("spec_apply_fields", grid, (FIELDS_THREADS,), args, stream)


def fields_commit(vtok, n_acc, n_commit, budget, pend, counts, *, stream):
    """``spec_fields_commit``: the round's generated tokens into ``counts``. One thread per slot.

    Parameters
    ----------
    vtok : [B, K1] int32
    n_acc, n_commit, budget, pend : [B] int32
    counts : [B, V] int32, updated
    """
    batch, k1 = vtok.shape
    args = (_i32(batch), _i32(k1), _i32(counts.shape[1]), vtok, n_acc, n_commit, budget, pend, counts)
    _launch("spec_fields_commit", (_blocks(batch, FIELDS_THREADS),), (FIELDS_THREADS,), args, stream)


def fields_reset(lengths, starts, counts, prompt_seen, *, stream):
    """``spec_fields_reset``: zero the rows of slots whose chunk starts a prompt. Grid
    (B * ceil(V / FIELDS_SPAN),), FIELDS_THREADS threads.

    Parameters
    ----------
    lengths, starts : [B] int32
    counts : [B, V] int32, prompt_seen : [B, V] uint8
    """
    batch, vocab = counts.shape
    _launch("spec_fields_reset", (batch * _blocks(vocab, FIELDS_SPAN),), (FIELDS_THREADS,),
            (_i32(vocab), lengths, starts, counts, prompt_seen), stream)


def fields_prompt(lengths, chunks, prompt_seen, *, stream):
    """``spec_fields_prompt``: mark the staged chunks' tokens in ``prompt_seen``. Grid
    (B * ceil(P_max / FIELDS_THREADS),), FIELDS_THREADS threads.

    Parameters
    ----------
    lengths : [B] int32
    chunks : [B, P_max] int32 (C-contiguous)
    prompt_seen : [B, V] uint8, updated
    """
    batch, p_max = chunks.shape
    _launch("spec_fields_prompt", (batch * _blocks(p_max, FIELDS_THREADS),), (FIELDS_THREADS,),
            (_i32(p_max), _i32(prompt_seen.shape[1]), lengths, chunks, prompt_seen), stream)


def fields_first(lengths, pend, counts, *, stream):
    """``spec_fields_first``: the first token of each prefilled slot into ``counts``. One thread per slot.

    Parameters
    ----------
    lengths, pend : [B] int32
    counts : [B, V] int32, updated
    """
    batch, vocab = counts.shape
    _launch("spec_fields_first", (_blocks(batch, FIELDS_THREADS),), (FIELDS_THREADS,),
            (_i32(batch), _i32(vocab), lengths, pend, counts), stream)

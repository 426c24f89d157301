"""Numpy twins of the generic burst kernels (``kernels/burst.cuh``): the executable specification.

Each function has the same name and signature as its CUDA wrapper in ``burst_cuda.py``
and updates its output arrays in place. The GPU tests hold the CUDA kernels to these
bit-exactly; the numpy backend runs them as its kernels. ``stream`` is accepted and
ignored: host execution is already in program order.

Shape legend: B = batch, K1 = k + 1, R = ring stride = M*(k+1) + 1, L = table entries.
"""

from __future__ import annotations

import numpy as np

from ..constants import PLACEHOLDER_TOKEN, UNBOUNDED_BUDGET

# --------------------------------------------------------------------------------------
# Generic kernels
# --------------------------------------------------------------------------------------


def seed_gather(pend, pos_ctr, vtok, pos_start, brk, ring, *, reset_ring, stream=None):
    """Start a round: ``vtok[:, 0] = pend``, ``vtok[:, 1:] = PLACEHOLDER_TOKEN``, anchor =
    position, break marker = ``[k, 0]``.

    Parameters
    ----------
    pend : [B] int32
    pos_ctr : [B] int32
    vtok : [B, K1] int32, written at column 0
    pos_start : [B] int32, written (the rollback anchor)
    brk : [B, 2] int32, written
    ring : [B, R] int32, count column zeroed when ``reset_ring``
    reset_ring : bool
        True on the first round of a burst.
    """
    k = vtok.shape[1] - 1
    vtok[:, 0] = pend
    vtok[:, 1:] = PLACEHOLDER_TOKEN
    pos_start[:] = pos_ctr
    brk[:, 0] = k
    brk[:, 1] = 0
    if reset_ring:
        ring[:, 0] = 0


def _n_valid(brk, k):
    return np.clip(brk[:, 0], 0, k)


def assemble_verify(pend, draft_tok, brk, vtok, *, stream=None):
    """``vtok[b] = [pend[b], drafts before the break..., PLACEHOLDER_TOKEN...]``.

    The break is ``n_valid = clip(brk[b, 0], 0, k)``.

    Parameters
    ----------
    pend : [B] int32
    draft_tok : [B, k] int32
    brk : [B, 2] int32
    vtok : [B, K1] int32, written
    """
    k = draft_tok.shape[1]
    keep = np.arange(k)[None, :] < _n_valid(brk, k)[:, None]
    vtok[:, 0] = pend
    vtok[:, 1:] = np.where(keep, draft_tok, PLACEHOLDER_TOKEN)


def accept_greedy(vtok, tgt_pred, brk, n_acc, last_pred, *, stream=None):
    """Greedy acceptance: longest prefix with ``vtok[b, 1+i] == tgt_pred[b, i]``.

    The prefix is cut at ``n_valid = clip(brk[b, 0], 0, k)``; the bonus token is
    ``tgt_pred[b, n]``, the target's prediction after the last accepted draft.

    Parameters
    ----------
    vtok, tgt_pred : [B, K1] int32
    brk : [B, 2] int32
    n_acc : [B] int32, written (accepted drafts, 0..k)
    last_pred : [B] int32, written (bonus token)
    """
    k = vtok.shape[1] - 1
    match = (vtok[:, 1:] == tgt_pred[:, :k]) & (np.arange(k)[None, :] < _n_valid(brk, k)[:, None])
    # Length of the leading run of True: index of the first False (k when none). A k = 0 round
    # (plain decoding) has no drafts to compare: n = 0.
    first_false = np.argmin(match, axis=1) if k > 0 else np.zeros(len(match), np.intp)
    n = np.where(match.all(axis=1), k, first_false).astype(np.int32)
    n_acc[:] = n
    last_pred[:] = tgt_pred[np.arange(len(n)), n]


def ring_commit(vtok, n_acc, last_pred, eos, budget, ring, pend, acc, n_commit, *, stream=None):
    """Append ``vtok[b, 0..n]`` to the ring, honouring EOS and the token budget.

    A sequence stops after committing its EOS token or when its budget reaches 0;
    ``UNBOUNDED_BUDGET`` never decreases. The bonus folds into ``pend`` only when the
    whole run was committed. Accept counters count committed drafts and rounds that
    committed anything.

    Parameters
    ----------
    vtok : [B, K1] int32
    n_acc, last_pred, eos : [B] int32
    budget : [B] int32, updated
    ring : [B, R] int32, updated (column 0 = count)
    pend : [B] int32, updated
    acc : [B, 2] int32, updated (``[accepted drafts, rounds]``)
    n_commit : [B] int32, written (tokens committed this round)
    """
    k = vtok.shape[1] - 1
    ring_cap = ring.shape[1] - 1
    for b in range(vtok.shape[0]):
        n = min(max(int(n_acc[b]), 0), k)
        cnt = min(max(int(ring[b, 0]), 0), ring_cap)
        left = int(budget[b])
        c = 0
        for i in range(n + 1):
            if left <= 0 or cnt + c >= ring_cap:
                break
            tok = int(vtok[b, i])
            ring[b, 1 + cnt + c] = tok
            c += 1
            if left != UNBOUNDED_BUDGET:
                left -= 1
            if tok == int(eos[b]):
                left = 0
        ring[b, 0] = cnt + c
        budget[b] = left
        n_commit[b] = c
        if c > 0:
            acc[b, 0] += c - 1
            acc[b, 1] += 1
        if c == n + 1:
            pend[b] = last_pred[b]


def rollback_stream(table, pos_start, n_commit, *, stream=None):
    """Set every length the pointer table names to ``pos_start + n_commit``.

    Parameters
    ----------
    table : PtrTable
        Entries resolve to ``[B] int32`` length arrays; 0 entries are skipped.
    pos_start, n_commit : [B] int32
    """
    target = (pos_start.astype(np.int64) + n_commit).astype(np.int32)
    for arr in table.resolve():
        if arr is not None:
            arr[:] = target


def epilogue(tgt_pred, eos, vtok, brk, n_acc, last_pred, budget, ring, pend, acc, n_commit, pos_start, pos_ctr,
             table, *, stream=None):
    """Fused round epilogue: exactly accept, commit, rollback, then seed the next round.

    The next round's seed never resets the ring (a burst's head seed does that).

    Parameters
    ----------
    As for :func:`accept_greedy`, :func:`ring_commit`, :func:`rollback_stream` and
    :func:`seed_gather`; ``pos_ctr`` may itself be an entry of ``table``.
    """
    accept_greedy(vtok, tgt_pred, brk, n_acc, last_pred)
    ring_commit(vtok, n_acc, last_pred, eos, budget, ring, pend, acc, n_commit)
    rollback_stream(table, pos_start, n_commit)
    seed_gather(pend, pos_ctr, vtok, pos_start, brk, ring, reset_ring=False)


def cap_drafts(budget, k_cap, brk, *, k, max_batch, stream=None):
    """The per-slot draft cap, after a round's draft chain: ``brk[b] = [cap_b, 1]`` where
    ``brk[b, 0] > cap_b``, as if the chain broke there.

    Parameters
    ----------
    budget : [B] int32
        Tokens still allowed; a slot with budget > 0 is active.
    k_cap : [B] int32
        Drafts each slot's request asked for; ``cap_b = clamp(k_cap[b], 0, k)``.
    brk : [B, 2] int32
        The chain's break, lowered in place.
    k, max_batch : int
        Drafts per round; while more than ``max_batch`` slots are active every ``cap_b`` is 0
        (``NO_BATCH_LIMIT``: never).
    """
    off = int(np.count_nonzero(budget > 0)) > max_batch
    cap = np.zeros_like(k_cap) if off else np.clip(k_cap, 0, k)
    over = brk[:, 0] > cap
    brk[over, 0] = cap[over]
    brk[over, 1] = 1


def admit_slots(table, budget, eos, acc, columns=None, *, stream=None):
    """Admission: each named slot gets its budget and stop token, zeroed accept counters
    and its per-slot model options.

    Parameters
    ----------
    table : [3 + C, n] int32
        Rows: slot, budget (``UNBOUNDED_BUDGET`` for none, 0 for a slot that stays idle),
        stop token (``NO_EOS`` for none), then one row per option column. Slots outside
        ``[0, B)`` are skipped.
    budget, eos : [B] int32, written at the named slots
    acc : [B, 2] int32, zeroed at the named slots
    columns : PtrTable of C [B] int32 arrays (a model's ``option_columns``), or None when C = 0;
        row ``3 + c`` is written to ``columns[c]`` at the named slots
    """
    n_cols = table.shape[0] - 3
    assert n_cols == (0 if columns is None else len(columns)), "admit_slots: one table row per option column"
    slots = table[0].astype(np.int64)
    ok = (slots >= 0) & (slots < budget.shape[0])
    budget[slots[ok]] = table[1][ok]
    eos[slots[ok]] = table[2][ok]
    acc[slots[ok]] = 0
    for c, column in enumerate(columns.resolve() if n_cols else ()):
        column.view(np.int32)[slots[ok]] = table[3 + c][ok]

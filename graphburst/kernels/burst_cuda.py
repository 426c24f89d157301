"""Thin cupy wrappers of the generic burst kernels (``kernels/burst.cuh``); twins in ``burst_ref``."""

from __future__ import annotations


from ..constants import CAP_THREADS, THREADS_PER_BLOCK
from .launch import _blocks, _i32, _launch, _layer_threads, _or_null


def seed_gather(pend, pos_ctr, vtok, pos_start, brk, ring, *, reset_ring, stream):
    batch, k1 = vtok.shape
    grid = (_blocks(batch, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    args = (_i32(batch), _i32(k1 - 1), _i32(bool(reset_ring)), pend, pos_ctr, vtok, pos_start, brk, ring,
            _i32(ring.shape[1]))
    _launch("spec_seed_gather", grid, block, args, stream)


def assemble_verify(pend, draft_tok, brk, vtok, *, stream):
    batch, k1 = vtok.shape
    grid = (_blocks(batch * k1, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    _launch("spec_assemble_verify", grid, block, (_i32(batch), _i32(k1 - 1), pend, draft_tok, brk, vtok), stream)


def accept_greedy(vtok, tgt_pred, brk, n_acc, last_pred, *, stream):
    batch, k1 = vtok.shape
    grid = (_blocks(batch, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    args = (_i32(batch), _i32(k1 - 1), vtok, tgt_pred, brk, n_acc, last_pred)
    _launch("spec_accept_greedy_dc", grid, block, args, stream)


def ring_commit(vtok, n_acc, last_pred, eos, budget, ring, pend, acc, n_commit, *, stream):
    batch, k1 = vtok.shape
    grid = (_blocks(batch, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    args = (_i32(batch), _i32(k1 - 1), _i32(ring.shape[1] - 1), vtok, n_acc, last_pred, eos, budget, ring,
            _i32(ring.shape[1]), pend, acc, n_commit)
    _launch("spec_ring_commit", grid, block, args, stream)


def rollback_stream(table, pos_start, n_commit, *, stream):
    batch = pos_start.shape[0]
    if len(table) == 0:
        return
    grid = (_blocks(batch, THREADS_PER_BLOCK), len(table))
    block = (THREADS_PER_BLOCK,)
    args = (_i32(batch), _i32(len(table)), table.ptrs, pos_start, n_commit)
    _launch("spec_rollback_stream", grid, block, args, stream)


def epilogue(tgt_pred, eos, vtok, brk, n_acc, last_pred, budget, ring, pend, acc, n_commit, pos_start, pos_ctr,
             table, *, stream):
    batch, k1 = vtok.shape
    grid = (batch,)
    block = (_layer_threads(len(table)),)
    args = (_i32(k1 - 1), _i32(ring.shape[1] - 1), tgt_pred, eos, vtok, brk, n_acc, last_pred, budget, ring,
            _i32(ring.shape[1]), pend, acc, n_commit, pos_start, pos_ctr, table.ptrs, _i32(len(table)))
    _launch("spec_epilogue", grid, block, args, stream)


def cap_drafts(budget, k_cap, brk, *, k, max_batch, stream):
    """The per-slot draft cap (see ``burst_ref.cap_drafts``). budget, k_cap: [B] int32; brk: [B, 2] int32.
    grid (1,), block (CAP_THREADS,)."""
    grid, block = (1,), (CAP_THREADS,)
    args = (_i32(brk.shape[0]), _i32(k), _i32(max_batch), budget, k_cap, brk)
    _launch("spec_cap_drafts", grid, block, args, stream)


def admit_slots(table, budget, eos, acc, columns=None, *, stream):
    """Admission's one launch (see ``burst_ref.admit_slots``).

    Parameters
    ----------
    table : [3 + C, n] int32, C-contiguous (slot, budget, stop token, then C option values per admitted slot)
    budget, eos : [B] int32
    acc : [B, 2] int32
    columns : PtrTable of C [B] int32 arrays, or None when C = 0
    """
    n_cols, n = table.shape[0] - 3, table.shape[1]
    assert n_cols == (0 if columns is None else len(columns)), "admit_slots: one table row per option column"
    grid = (_blocks(n, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    args = (_i32(n), _i32(budget.shape[0]), table, budget, eos, acc, _i32(n_cols),
            _or_null(None if columns is None else columns.ptrs))
    _launch("spec_admit_slots", grid, block, args, stream)


def empty_node(*, stream):
    """One launch of an empty kernel: the unit of the benchmark floor."""
    grid = (1,)
    block = (1,)
    _launch("gb_empty_node", grid, block, (), stream)

"""Thin cupy wrappers of the stub models' kernels (``kernels/stubs.cuh``); twins in ``stubs_ref``."""

from __future__ import annotations

import numpy as np

from ..constants import THREADS_PER_BLOCK
from .launch import _i32, _i64, _launch, _layer_threads, _or_null, _step_arg


def stub_prefill(prompt, prompt_len, kv_table, len_table, capacity, vocab, pos_ctr, pend, *, start=None, stream):
    batch, p_max = prompt.shape
    grid = (batch,)
    block = (_layer_threads(len(kv_table)),)
    args = (prompt, prompt_len, _or_null(start), _i32(p_max), kv_table.ptrs, len_table.ptrs, _i32(len(kv_table)), _i32(capacity),
            _i32(vocab), _or_null(pos_ctr), _or_null(pend))
    _launch("stub_prefill", grid, block, args, stream)


def stub_draft_step(step, vtok, pos_ctr, kv_table, len_table, capacity, vocab, seed, agree24, pmin24, cost_ns,
                    draft_tok, draft_conf, brk, *, extend_last=True, stream):
    batch, k = draft_tok.shape
    grid = (batch,)
    block = (_layer_threads(len(kv_table)),)
    args = (_i32(step), _i32(k), vtok, pos_ctr, kv_table.ptrs, len_table.ptrs, _i32(len(kv_table)), _i32(capacity),
            _i32(vocab), seed, agree24, _i32(pmin24), _i64(cost_ns), draft_tok, draft_conf, brk,
            _i32(bool(extend_last)))
    _launch("stub_draft_step", grid, block, args, stream)


def stub_verify(vtok, pos_ctr, kv_table, len_table, capacity, vocab, cost_ns, tgt_pred, *, stream):
    batch, k1 = vtok.shape
    grid = (batch,)
    block = (_layer_threads(len(kv_table)),)
    shared = 2 * k1 * np.dtype(np.uint32).itemsize
    args = (_i32(k1 - 1), vtok, pos_ctr, kv_table.ptrs, len_table.ptrs, _i32(len(kv_table)), _i32(capacity),
            _i32(vocab), _i64(cost_ns), tgt_pred)
    _launch("stub_verify", grid, block, args, stream, shared_mem=shared)


def stub_draft_append(draft_tok, pos_ctr, brk, kv_table, len_table, capacity, *, stream):
    batch, k = draft_tok.shape
    grid = (batch,)
    block = (_layer_threads(len(kv_table)),)
    args = (_i32(k), draft_tok, pos_ctr, brk, kv_table.ptrs, len_table.ptrs, _i32(len(kv_table)), _i32(capacity))
    _launch("stub_draft_append", grid, block, args, stream)


def stub_logits(pred, pos, logits, *, pos_offset, salt, spread, peak, step=None, stream):
    batch, n_rows, vocab = logits.shape
    step_arg, grid_y = _step_arg(step, n_rows)
    grid = (batch, grid_y)
    block = (THREADS_PER_BLOCK,)
    args = (_i32(n_rows), _i32(vocab), step_arg, pred, _i32(pred.shape[1]), pos, _i32(pos_offset),
            np.uint32(salt), np.float32(spread), np.float32(peak), logits)
    _launch("stub_logits", grid, block, args, stream)

"""Numpy twins of the stub models' kernels (``kernels/stubs.cuh``), bit for bit.

Same contract as ``burst_ref``: one function per CUDA wrapper in ``stubs_cuda.py``, same
signature, outputs updated in place. L = table entries.
"""

from __future__ import annotations

import numpy as np

from ..constants import NO_PREFILL
from .digest import (
    CONF_BITS,
    DIGEST_CORRUPT,
    DIGEST_INIT,
    agree_hash,
    combine,
    conf_hash,
    digest_step,
    mix32,
    target_token,
    u32,
    wrong_shift,
)
from .sampling_prims import ftz

_U32_ALL_ONES = np.uint64(0xFFFFFFFF)

# --------------------------------------------------------------------------------------
# Stub models
# --------------------------------------------------------------------------------------


def _prev_entry(rows, n, capacity):
    """Vectorised ``gb_prev_entry``: last entry below each length, INIT or CORRUPT."""
    safe = np.clip(n - 1, 0, capacity - 1)
    last = u32(rows[np.arange(rows.shape[0]), safe])
    out = np.where(n > 0, last, np.uint64(DIGEST_INIT))
    return np.where((n < 0) | (n > capacity), np.uint64(DIGEST_CORRUPT), out)


def _layers(kv_table, len_table):
    return [(kv, ln) for kv, ln in zip(kv_table.resolve(), len_table.resolve()) if kv is not None]


def stub_prefill(prompt, prompt_len, kv_table, len_table, capacity, vocab, pos_ctr, pend, *, start=None,
                 stream=None):
    """Write a prompt's (or one chunk's) digest entries into every layer of one stub cache.

    Sequences with ``prompt_len[b] == NO_PREFILL`` are left untouched. Others, with
    ``S = start[b]`` (0 when ``start`` is None; clipped to ``[0, capacity]``) and P the
    chunk's length (clipped to the row and to ``capacity - S``): the digest continues from
    entry ``S - 1`` (earlier chunks), entries ``[S, S + P)`` are written, lengths become
    ``S + P`` and, when given, ``pos_ctr[b] = S + P`` and ``pend[b]`` = the target's greedy
    token after the prompt. Prefilled whole or in chunks, a prompt leaves the same entries.

    Parameters
    ----------
    prompt : [B, P_max] int32
    prompt_len : [B] int32
    kv_table, len_table : PtrTable over the cache's layers
    pos_ctr, pend : [B] int32 or None, written
    start : [B] int32 or None, the position of ``prompt[:, 0]``
    """
    p_max = prompt.shape[1]
    rows_b = np.nonzero(prompt_len != NO_PREFILL)[0]
    s0 = np.zeros(len(rows_b), np.int32) if start is None else np.clip(start[rows_b], 0, capacity).astype(np.int32)
    plen = np.clip(prompt_len[rows_b], 0, np.minimum(p_max, capacity - s0)).astype(np.int32)
    mn = np.full(len(rows_b), _U32_ALL_ONES)
    mx = np.zeros(len(rows_b), np.uint64)
    for kv, ln in _layers(kv_table, len_table):
        c = _prev_entry(kv[rows_b], s0, capacity)
        for i in range(int(plen.max(initial=0))):
            live = i < plen
            step = digest_step(c, prompt[rows_b, i], s0 + np.int32(i))
            c = np.where(live, step, c)
            kv[rows_b[live], (s0 + i)[live]] = c[live].astype(np.uint32).view(np.int32)
        ln[rows_b] = s0 + plen
        mn = np.minimum(mn, c)
        mx = np.maximum(mx, c)
    if pos_ctr is not None:
        pos_ctr[rows_b] = s0 + plen
    if pend is not None:
        pend[rows_b] = target_token(combine(mn, mx), vocab).astype(np.int32)


def stub_draft_step(step, vtok, pos_ctr, kv_table, len_table, capacity, vocab, seed, agree24, pmin24,
                    cost_ns, draft_tok, draft_conf, brk, *, extend_last=True, stream=None):
    """One draft step of the stub draft (see ``stub_draft_step`` in kernels.cu).

    The proposal also goes to ``vtok[:, 1 + step]`` unless this step breaks the chain,
    so the stub needs no assemble step.

    Parameters
    ----------
    step : int
        Draft step j in ``[0, k)``.
    vtok : [B, K1] int32, column ``1 + step`` written
    pos_ctr : [B] int32
    kv_table, len_table : PtrTable over the draft's layers
    seed : [B] uint32
    agree24 : [B] int32, agreement probability in 24-bit fixed point
    pmin24 : int, p_min in 24-bit fixed point
    cost_ns : int, emulated cost (ignored on the host)
    draft_tok : [B, k] int32, written at column ``step``
    draft_conf : [B, k] float32, written at column ``step``
    brk : [B, 2] int32, set to ``[step, 1]`` when the chain breaks
    extend_last : bool
        On the last unbroken step also append the proposal's own entry (greedy mode); a
        sampling decoder passes False and appends its sampled draft with
        :func:`stub_draft_append`.
    """
    k = draft_tok.shape[1]
    active = np.nonzero(brk[:, 1] == 0)[0]
    if len(active) == 0:
        return
    x = vtok[active, 0] if step == 0 else draft_tok[active, step - 1]
    pos = pos_ctr[active] + np.int32(step)
    mn = np.full(len(active), _U32_ALL_ONES)
    mx = np.zeros(len(active), np.uint64)
    layers = _layers(kv_table, len_table)
    for kv, ln in layers:
        n = ln[active].copy()
        c = digest_step(_prev_entry(kv[active], n, capacity), x, pos)
        ok = (n >= 0) & (n < capacity)
        kv[active[ok], n[ok]] = c[ok].astype(np.uint32).view(np.int32)
        ln[active] = n + np.int32(1)
        mn = np.minimum(mn, c)
        mx = np.maximum(mx, c)
    truth = target_token(combine(mn, mx), vocab)
    h = agree_hash(seed[active].astype(np.uint64), pos + np.int32(1))
    h2 = conf_hash(h)
    disagree = (h >> np.uint64(8)).astype(np.int64) >= agree24[active]
    tok = np.where(disagree, (truth + wrong_shift(h2, vocab)) % vocab, truth).astype(np.int32)
    conf24 = (h2 >> np.uint64(8)).astype(np.int64)
    draft_tok[active, step] = tok
    draft_conf[active, step] = (conf24.astype(np.float32) * np.float32(1.0 / (1 << CONF_BITS)))
    breaks = conf24 < pmin24
    brk[active[breaks], 0] = step
    brk[active[breaks], 1] = 1
    vtok[active[~breaks], 1 + step] = tok[~breaks]
    if step != k - 1 or not extend_last:
        return
    ext = active[~breaks]
    for kv, ln in layers:
        n = ln[ext].copy()
        c = digest_step(_prev_entry(kv[ext], n, capacity), tok[~breaks], pos[~breaks] + np.int32(1))
        ok = (n >= 0) & (n < capacity)
        kv[ext[ok], n[ok]] = c[ok].astype(np.uint32).view(np.int32)
        ln[ext] = n + np.int32(1)


def stub_verify(vtok, pos_ctr, kv_table, len_table, capacity, vocab, cost_ns, tgt_pred, *, stream=None):
    """Verify trunk of the stub target over all k + 1 positions at once.

    Appends every position's entry at each layer's own length, grows the length by
    k + 1, and writes the target's greedy prediction after each position.

    Parameters
    ----------
    vtok : [B, K1] int32
    pos_ctr : [B] int32
    kv_table, len_table : PtrTable over the target's layers
    cost_ns : int, emulated cost (ignored on the host)
    tgt_pred : [B, K1] int32, written
    """
    batch, k1 = vtok.shape
    rows = np.arange(batch)
    mn = np.full((batch, k1), _U32_ALL_ONES)
    mx = np.zeros((batch, k1), np.uint64)
    for kv, ln in _layers(kv_table, len_table):
        n = ln.copy()
        c = _prev_entry(kv, n, capacity)
        for j in range(k1):
            c = digest_step(c, vtok[:, j], pos_ctr + np.int32(j))
            ok = (n >= 0) & (n + j < capacity)
            kv[rows[ok], (n + j)[ok]] = c[ok].astype(np.uint32).view(np.int32)
            mn[:, j] = np.minimum(mn[:, j], c)
            mx[:, j] = np.maximum(mx[:, j], c)
        ln[:] = n + np.int32(k1)
    tgt_pred[:] = target_token(combine(mn, mx), vocab).astype(np.int32)


def stub_draft_append(draft_tok, pos_ctr, brk, kv_table, len_table, capacity, *, stream=None):
    """Append the sampled last draft ``draft_tok[:, k-1]`` at ``pos_ctr + k`` (unbroken chains).

    Sampling mode's ``draft_append_last`` of the stub draft: each KV layer gets the
    entry at its own length, so the draft covers ``[anchor, anchor + k]``.

    Parameters
    ----------
    draft_tok : [B, k] int32
    pos_ctr : [B] int32
    brk : [B, 2] int32; sequences with ``brk[b, 1] != 0`` are skipped
    kv_table, len_table : PtrTable over the draft's layers
    """
    k = draft_tok.shape[1]
    ext = np.nonzero(brk[:, 1] == 0)[0]
    if len(ext) == 0:
        return
    tok, pos = draft_tok[ext, k - 1], pos_ctr[ext] + np.int32(k)
    for kv, ln in _layers(kv_table, len_table):
        n = ln[ext].copy()
        c = digest_step(_prev_entry(kv[ext], n, capacity), tok, pos)
        ok = (n >= 0) & (n < capacity)
        kv[ext[ok], n[ok]] = c[ok].astype(np.uint32).view(np.int32)
        ln[ext] = n + np.int32(1)


def stub_logits(pred, pos, logits, *, pos_offset, salt, spread, peak, step=None, stream=None):
    """The stub models' logit rows (``stub_logits`` in kernels.cu), bit for bit.

    Row t of sequence b is for the token at position ``P = pos[b] + pos_offset + t``
    whose greedy choice is ``g = pred[b, t]``: ``logit_i = ((h_i >> 8) * 2**-24) * spread``
    for ``i != g`` (``h_i`` a hash of (salt, P, g, i)) and ``logit_g = spread + peak``.

    Parameters
    ----------
    pred : [B, >= T] int32 greedy tokens (column t for row t)
    pos : [B] int32
    logits : [B, T, V] float32, written (row ``step`` only, or all)
    pos_offset : int
    salt : int, uint32
    spread, peak : float, > 0
    step : int or None
    """
    vocab = logits.shape[2]
    spread, peak = np.float32(spread), np.float32(peak)
    i_mix = (np.arange(vocab, dtype=np.uint64) * np.uint64(0x27D4EB2F) + np.uint64(0x165667B1)) & _U32_ALL_ONES
    rows = range(logits.shape[1]) if step is None else [step]
    for t in rows:
        g = pred[:, t]
        p = u32(pos.astype(np.int64) + pos_offset + t)
        key = mix32(np.uint64(salt) ^ mix32((p * np.uint64(0x9E3779B1) + u32(g) * np.uint64(0x85EBCA77))
                                            & _U32_ALL_ONES))
        h = mix32(key[:, None] ^ i_mix[None, :])
        row = ftz(((h >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)) * spread)
        hit = np.arange(vocab)[None, :] == g[:, None]
        logits[:, t] = np.where(hit, ftz(spread + peak), row)

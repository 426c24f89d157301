"""Numpy reference of every kernel in ``kernels.cu``: the executable specification.

Each function has the same name and signature as its CUDA wrapper in ``cuda_ops.py``
and updates its output arrays in place. The GPU tests hold the CUDA kernels to these
bit-exactly; the numpy backend runs them as its kernels. ``stream`` is accepted and
ignored: host execution is already in program order.

Shape legend: B = batch, K1 = k + 1, R = ring stride = M*(k+1) + 1, L = table entries.
"""

from __future__ import annotations

import numpy as np

from .constants import NO_PREFILL, PLACEHOLDER_TOKEN, UNBOUNDED_BUDGET
from .digest import (
    CONF_BITS,
    DIGEST_CORRUPT,
    DIGEST_INIT,
    agree_hash,
    combine,
    conf_hash,
    digest_step,
    target_token,
    u32,
    wrong_shift,
)
from .digest import mix32
from .sampling_ref import (  # noqa: F401 - the sampling kernels
    accept_sample, draft_probs_sample, ftz, probs_from_logits, sample_draft)


_U32_ALL_ONES = np.uint64(0xFFFFFFFF)


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
    ring : [B, R] int32, count slot zeroed when ``reset_ring``
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
    # Length of the leading run of True: index of the first False (k when none).
    n = np.where(match.all(axis=1), k, np.argmin(match, axis=1)).astype(np.int32)
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
    ring : [B, R] int32, updated (slot 0 = count)
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


def stub_prefill(prompt, prompt_len, kv_table, len_table, capacity, vocab, pos_ctr, pend, *, stream=None):
    """Write a prompt's digest entries into every layer of one stub cache.

    Sequences with ``prompt_len[b] == NO_PREFILL`` are left untouched. Others get
    entries ``[0, P)``, lengths ``P`` and, when given, ``pos_ctr[b] = P`` and
    ``pend[b]`` = the target's greedy token after the prompt.

    Parameters
    ----------
    prompt : [B, P_max] int32
    prompt_len : [B] int32
    kv_table, len_table : PtrTable over the cache's layers
    pos_ctr, pend : [B] int32 or None, written
    """
    p_max = prompt.shape[1]
    rows_b = np.nonzero(prompt_len != NO_PREFILL)[0]
    plen = np.clip(prompt_len[rows_b], 0, min(p_max, capacity)).astype(np.int32)
    mn = np.full(len(rows_b), _U32_ALL_ONES)
    mx = np.zeros(len(rows_b), np.uint64)
    for kv, ln in _layers(kv_table, len_table):
        c = np.full(len(rows_b), np.uint64(DIGEST_INIT))
        for i in range(int(plen.max(initial=0))):
            live = i < plen
            step = digest_step(c, prompt[rows_b, i], np.full(len(rows_b), i, np.int32))
            c = np.where(live, step, c)
            kv[rows_b[live], i] = c[live].astype(np.uint32).view(np.int32)
        ln[rows_b] = plen
        mn = np.minimum(mn, c)
        mx = np.maximum(mx, c)
    if pos_ctr is not None:
        pos_ctr[rows_b] = plen
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

"""Numpy reference of the sampling kernels in ``kernels.cu`` (section "Sampling").

Each public kernel function has the same signature as its CUDA wrapper in ``cuda_sampling_ops.py``
and writes its output arrays in place; ``scratch`` and ``stream`` are accepted and
ignored (the device keeps per-tile partials in the decoder's scratch buffers; here they
are local arrays). The GPU tests hold the kernels to these functions bit for bit
(tokens, counts and every probability bit), which is possible because the kernels fix
their float summation order by tiles (:func:`sampling_prims.tile_sum`,
:func:`sampling_prims.tile_combine`), use explicitly rounded float ops only, compute exp
and log with their own polynomials, and sample by an exponential race, an argmax that
no parallel split can change. The primitives (flush to zero, Philox, exp, log, keys,
tiles) are in :mod:`graphburst.kernels.sampling_prims`.

Randomness is Philox4x32-10 keyed by the request seed, counter
``[absolute position of the token being decided, draw index, group, 0]``: a draw is a
pure function of (seed, position, draw, element) and needs no state anywhere.

Shape legend: B = batch, T = rows per sequence, k = drafts, K1 = k + 1, V = vocabulary,
R = rows of a block of work, n_t = tiles per row.
"""

from __future__ import annotations

import numpy as np

from ..constants import DRAW_ACCEPT, DRAW_DRAFT, DRAW_RESAMPLE, PLACEHOLDER_TOKEN, SAMPLE_TILE
from .sampling_prims import (
    _div, _gt, _mul, _sub, exp_neg, expo, ftz, key_index, key_logit, order_key, race_key, race_words, race_words_at,
    tile_combine, tile_shape, tile_sum, tiled, uniform)

__all__ = ["probs_from_logits", "draft_probs_sample", "sample_draft", "accept_sample", "race", "select_thr",
           "ftz", "uniform", "exp_neg"]

_F32 = np.float32
_MASS_SCALE = _F32(2.0**32)
_ROW_BLOCK = 256  # rows per block of work: keeps the tiled temporaries in cache


def _blocks(rows: int):
    for r0 in range(0, rows, _ROW_BLOCK):
        yield slice(r0, min(rows, r0 + _ROW_BLOCK))


def _tile_max(x, fill):
    """Per-tile max of [R, V] values (order-free) -> [R, n_t]."""
    return tiled(x, fill).max(axis=(2, 3, 4))


def _race_partials(w, seed, pos, draw):
    """Per-tile race winners over weights [R, V] (flushed; candidates w > 0).

    Returns ``(race key [R, n_t] uint64, 0 = none; the winner's weight [R, n_t])``.
    """
    rows, vocab = w.shape
    cand = _gt(w, 0)
    r = np.zeros((rows, vocab), _F32)  # w / E at candidates
    ri, ci = np.nonzero(cand)
    if 4 * len(ri) < rows * vocab:  # sparse rows: one Philox call per candidate
        r[ri, ci] = _div(w[ri, ci], expo(race_words_at(seed[ri], np.asarray(pos)[ri], draw, ci)))
    else:  # dense rows: one Philox call per 4 elements, as on the device
        ex = expo(race_words(seed, pos, draw, -(-vocab // 4) * 4))[:, :vocab]
        r = _div(w, ex)
    rk = race_key(r, np.arange(vocab), cand)
    key = _tile_max(rk, np.uint64(0))
    t = tile_shape(vocab)
    flat = tiled(rk, np.uint64(0)).reshape(rows, t[0], -1)
    wt = tiled(np.asarray(w, _F32), _F32(0)).reshape(rows, t[0], -1)
    at = np.argmax(flat, axis=2)
    return key, np.where(key != 0, np.take_along_axis(wt, at[..., None], axis=2)[..., 0], _F32(0))


def race(w, seed, pos, draw):
    """Exponential race over non-negative weights: ``argmax_i w_i / E_i`` over ``w_i > 0``.

    ``E_i`` = :func:`sampling_prims.expo` of Philox word ``i % 4`` of counter
    ``[pos, draw, i // 4, 0]``; ties go to the lower index (never in practice).

    Parameters
    ----------
    w : [R, V] float32, >= 0 (flushed: a subnormal weight is no weight)
    seed : [R] uint64
    pos : [R] int
    draw : int

    Returns
    -------
    (token [R] int64, -1 when no weight is positive; its weight [R] float32)
    """
    key, wt = _race_partials(ftz(w), seed, pos, draw)
    best = key.argmax(axis=1)
    ar = np.arange(len(key))
    k = key[ar, best]
    return np.where(k != 0, key_index(k), -1), np.where(k != 0, wt[ar, best], _F32(0))


def minp_thr(logits, temperature, min_p):
    """The smallest order key min-p keeps, per row (0 where min_p is off: <= 0 or NaN, or at
    temperature <= 0): min-p keeps ``e = exp_neg((l - max) / T) >= min_p`` (the probability
    relative to the top one; the top token has e = 1, so at least it)."""
    rows = logits.shape[0]
    thr = np.zeros(rows, np.uint64)
    min_p = ftz(min_p)
    on = _gt(temperature, 0) & _gt(min_p, 0)
    if not on.any():
        return thr
    sel = np.nonzero(on)[0]
    key = order_key(logits[sel])
    l_max = key_logit(key.max(axis=1))
    e = exp_neg(_div(_sub(logits[sel], l_max[:, None]), temperature[sel, None]))
    kept = ~(e < min_p[sel, None])
    thr[sel] = np.where(kept, key, np.uint64(2**64 - 1)).min(axis=1)
    return thr


def select_thr(logits, temperature, top_k, top_p, min_p=None):
    """``spec_probs_select``: the smallest order key kept by min-p and top-k, then top-p, per row.

    Min-p (``min_p``, None: off; :func:`minp_thr`) and top-k (0 or >= V: off) each keep a run
    of the largest keys, and their intersection goes on to top-p: top-k keeps the k largest
    :func:`order_key`; top-p (>= 1 or NaN: off)
    then keeps the shortest run of those, in key order, whose integer mass
    ``floor(e * 2**32)`` reaches ``max(1, ceil(top_p * total mass))`` (float64), with
    ``e = exp_neg((l - max) / T)``. 0 (keep all) without filters or at temperature <= 0.

    Parameters
    ----------
    logits : [R, V] float32
    temperature, top_p : [R] float32
    top_k : [R] int32

    Returns
    -------
    [R] uint64
    """
    rows, vocab = logits.shape
    greedy = ~_gt(temperature, 0)
    top_p = ftz(top_p)
    thr = np.zeros(rows, np.uint64) if min_p is None else minp_thr(logits, temperature, min_p)
    k_on = ~greedy & (top_k > 0) & (top_k < vocab)
    p_on = ~greedy & (top_p < 1)
    if not (k_on | p_on).any():
        return thr
    key = order_key(logits)
    if k_on.any():
        srt = np.sort(key[k_on], axis=1)
        thr[k_on] = np.maximum(thr[k_on], srt[np.arange(k_on.sum()), vocab - top_k[k_on]])
    if p_on.any():
        sel = np.nonzero(p_on)[0]
        k_sel = key[sel]
        l_max = key_logit(k_sel.max(axis=1))
        e = exp_neg(_div(_sub(logits[sel], l_max[:, None]), temperature[sel, None]))
        mass = np.where(k_sel >= thr[sel, None], (e * _MASS_SCALE).astype(np.uint64), np.uint64(0))
        total = mass.sum(axis=1, dtype=np.uint64)
        need = np.ceil(top_p[sel].astype(np.float64) * total.astype(np.float64))
        need = np.maximum(need, 1.0).astype(np.uint64)
        order = np.argsort(k_sel, axis=1)[:, ::-1]
        cum = np.cumsum(np.take_along_axis(mass, order, axis=1), axis=1, dtype=np.uint64)
        j = np.argmax(cum >= need[:, None], axis=1)
        thr_p = np.take_along_axis(k_sel, order, axis=1)[np.arange(len(sel)), j]
        thr[sel] = np.maximum(thr[sel], thr_p)
    return thr


def _probs_rows(logits, temperature, top_k, top_p, seed=None, pos=None, min_p=None):
    """``spec_probs_select`` + ``spec_probs_tiles`` + ``spec_probs_normalize`` on [R, V].

    With ``seed``/``pos`` (a draft row, position of the token decided) also the draft race.

    Returns
    -------
    (probs [R, V] float32, token [R] int64 or None, its probability [R] float32 or None)
    """
    rows, vocab = logits.shape
    ar = np.arange(rows)
    greedy = ~_gt(temperature, 0)
    temp = np.where(greedy, _F32(1.0), temperature).astype(_F32)[:, None]
    thr = select_thr(logits, temperature, top_k, top_p, min_p)
    key = order_key(logits)
    t_key = _tile_max(key, np.uint64(0))  # [R, n_t] tile max order keys
    m_t = key_logit(t_key)  # [R, n_t] tile max logits
    tile_of = np.arange(vocab) // SAMPLE_TILE  # [V] tile of each token
    kept = key >= thr[:, None]
    e = np.where(kept, exp_neg(_div(_sub(logits, m_t[:, tile_of]), temp)), _F32(0.0)).astype(_F32)
    t_sum = tile_sum(tiled(e, _F32(0)))  # [R, n_t]
    max_key = t_key.max(axis=1)
    scale = exp_neg(_div(_sub(m_t, key_logit(max_key)[:, None]), temp))  # [R, n_t]
    total = tile_combine(_mul(t_sum, scale))  # [R]
    out = _div(_mul(e, scale[:, tile_of]), total[:, None])
    amax = key_index(max_key)
    out[greedy] = 0
    out[ar[greedy], amax[greedy]] = 1
    if seed is None:
        return out, None, None
    r_key, r_w = _race_partials(e, seed, pos, DRAW_DRAFT)
    r = np.ascontiguousarray((r_key >> np.uint64(32)).astype(np.uint32)).view(_F32)
    rescaled = race_key(_mul(r, scale), key_index(r_key), r_key != 0)
    best = rescaled.argmax(axis=1)
    win = rescaled[ar, best]
    tok = np.where(win != 0, key_index(win), PLACEHOLDER_TOKEN)
    prob = np.where(win != 0, _div(_mul(r_w[ar, best], scale[ar, best]), total), _F32(0))
    tok = np.where(greedy, amax, tok)
    prob = np.where(greedy, _F32(1), prob).astype(_F32)
    return out, tok, prob


def _rows(n, step):
    return range(n) if step is None else [step]


def probs_from_logits(logits, temperature, top_k, top_p, probs, scratch=None, *, step=None, min_p=None, stream=None):
    """Temperature, min-p, top-k and top-p: float32 logits -> normalized float32 probabilities.

    Per row: temperature <= 0 (or NaN) gives a one-hot at the argmax (lowest index on
    ties). Otherwise :func:`select_thr` picks the kept tokens (top-k = 1 therefore equals
    greedy), ``e_i = exp_neg((l_i - m_t) / T)`` with m_t the maximum logit of i's tile of
    ``SAMPLE_TILE`` tokens, ``s_t = exp_neg((m_t - max) / T)``, ``total`` =
    :func:`tile_combine` of ``tile_sum(e) * s`` and ``probs_i = e_i * s_t / total`` (0 where
    not kept). Bit-exact with the kernels.

    Parameters
    ----------
    logits : [B, T, V] float32 (finite or -inf; at least one finite value per row)
    temperature : [B] float32
    top_k : [B] int32
    top_p : [B] float32
    probs : [B, T, V] float32, written (may be ``logits`` itself)
    scratch : ignored (the device's per-tile partials)
    step : int or None
        Only row ``step`` of every sequence; None: all T rows.
    min_p : [B] float32 or None
        Per-row min-p (0: off; :func:`select_thr`); None: off everywhere.
    """
    for t in _rows(logits.shape[1], step):
        row = np.array(logits[:, t], _F32)
        for s in _blocks(len(row)):
            probs[s, t] = _probs_rows(row[s], temperature[s], top_k[s], top_p[s],
                                      min_p=None if min_p is None else min_p[s])[0]


def draft_probs_sample(logits, temperature, top_k, top_p, seed, pos, probs, draft_tok, draft_prob, scratch=None, *,
                       step=None, stream=None):
    """:func:`probs_from_logits` of draft rows plus the draft's proposal, in the same kernels.

    Row t of sequence b proposes the token at position ``pos[b] + t + 1`` by the race over
    the tiles' ``e`` (draw ``DRAW_DRAFT``); each tile's winner ``e_i / E_i`` is rescaled by
    ``s_t`` and the largest (value, index) wins, which is exactly a race over ``probs``
    up to the common factor ``1 / total``. Temperature <= 0: the argmax.

    Parameters
    ----------
    logits : [B, k, V] float32
    temperature, top_k, top_p, seed : [B]
    pos : [B] int32, position of ``vtok[b, 0]``
    probs : [B, k, V] float32, written (may be ``logits``)
    draft_tok : [B, k] int32, written (PLACEHOLDER_TOKEN without a candidate)
    draft_prob : [B, k] float32, written: ``probs[b, t, draft_tok[b, t]]`` (0 without)
    step : int or None
        Only draft row ``step``; None: all k rows.
    """
    for t in _rows(logits.shape[1], step):
        row = np.array(logits[:, t], _F32)
        for s in _blocks(len(row)):
            out, tok, prob = _probs_rows(row[s], temperature[s], top_k[s], top_p[s], seed[s],
                                         pos[s].astype(np.int64) + t + 1)
            probs[s, t] = out
            draft_tok[s, t] = tok
            draft_prob[s, t] = prob


def sample_draft(q, seed, pos, draft_tok, draft_prob, scratch=None, *, step=None, stream=None):
    """Draft proposals from given probabilities: row t of sequence b samples the token at
    position ``pos[b] + t + 1`` by :func:`race` (draw ``DRAW_DRAFT``).

    Parameters
    ----------
    q : [B, k, V] float32 draft probabilities
    seed : [B] uint64
    pos : [B] int32, position of ``vtok[b, 0]``
    draft_tok : [B, k] int32, written (PLACEHOLDER_TOKEN for a row without mass)
    draft_prob : [B, k] float32, written: ``q[b, t, draft_tok[b, t]]`` (0 without a token)
    scratch : ignored
    step : int or None
        Only draft row ``step``; None: all k rows.
    """
    for t in _rows(q.shape[1], step):
        for s in _blocks(q.shape[0]):
            tok, w = race(np.asarray(q[s, t], _F32), seed[s], pos[s].astype(np.int64) + t + 1, DRAW_DRAFT)
            draft_tok[s, t] = np.where(tok >= 0, tok, PLACEHOLDER_TOKEN)
            draft_prob[s, t] = w


def accept_prefix(vtok, p, q, brk, seed, pos):
    """``gb_accept_prefix``: (accepted prefix n [B] int64, n_valid [B])."""
    batch, k1 = vtok.shape
    k, vocab = k1 - 1, p.shape[2]
    ar = np.arange(batch)
    pos64 = pos.astype(np.int64)
    n_valid = np.clip(brk[:, 0], 0, k)
    n = np.zeros(batch, np.int64)
    alive = np.ones(batch, bool)
    for i in range(k):
        x = vtok[:, 1 + i].astype(np.int64)
        in_range = (x >= 0) & (x < vocab)
        xs = np.where(in_range, x, 0)
        u = uniform(seed, pos64 + i + 1, DRAW_ACCEPT)
        ok = alive & (i < n_valid) & in_range & _gt(p[ar, i, xs], _mul(u, q[ar, i, xs]))
        n += ok
        alive = ok
    return n, n_valid


def accept_sample(vtok, p, q, brk, seed, pos, n_acc, last_pred, scratch=None, *, stream=None):
    """Lossless speculative sampling, with the outputs of :func:`reference.accept_greedy`.

    For ``i < n_valid = clip(brk[b, 0], 0, k)`` in order, draft ``x = vtok[b, 1 + i]`` is
    accepted iff ``0 <= x < V`` and ``u * q[b, i, x] < p[b, i, x]`` (u: draw
    ``DRAW_ACCEPT`` at position ``pos[b] + i + 1``). ``n_acc[b]`` = accepted prefix n.
    ``last_pred[b]`` is the token for position ``pos[b] + n + 1`` by :func:`race` (draw
    ``DRAW_RESAMPLE``): after a rejection over ``max(0, p_n - q_n)`` (over ``p_n`` if that
    is all zero), otherwise (the break, or all k accepted) over ``p_n``; PLACEHOLDER_TOKEN
    if ``p_n`` has no mass.

    Parameters
    ----------
    vtok : [B, K1] int32
    p : [B, K1, V] float32 target probabilities
    q : [B, k, V] float32 draft probabilities
    brk : [B, 2] int32
    seed : [B] uint64
    pos : [B] int32, position of ``vtok[b, 0]``
    n_acc, last_pred : [B] int32, written
    scratch : ignored
    """
    batch = vtok.shape[0]
    ar = np.arange(batch)
    n, n_valid = accept_prefix(vtok, p, q, brk, seed, pos)
    at = pos.astype(np.int64) + n + 1
    tok = np.full(batch, -1, np.int64)
    for s in _blocks(batch):
        p_row = np.asarray(p[ar[s], n[s]], _F32)
        rej = n[s] < n_valid[s]
        tok_s = race(p_row, seed[s], at[s], DRAW_RESAMPLE)[0]
        if rej.any():
            d = _sub(p_row[rej], q[ar[s][rej], n[s][rej]])
            res = race(np.where(d > 0, d, _F32(0.0)).astype(_F32), seed[s][rej], at[s][rej], DRAW_RESAMPLE)[0]
            tok_s[rej] = np.where(res >= 0, res, tok_s[rej])
        tok[s] = tok_s
    n_acc[:] = n
    last_pred[:] = np.where(tok >= 0, tok, PLACEHOLDER_TOKEN)

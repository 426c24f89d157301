"""Numpy twins of the prompt-lookup kernels (``kernels/ngram.cuh``), bit for bit.

Same contract as ``burst_ref``: one function per CUDA wrapper in ``ngram_cuda.py``, same
signature, outputs updated in place. :func:`ngram_match` is the plain statement of the
search (the spec); :func:`ngram_search` computes it the way the kernel does (longest
common suffix per window end, then one max), and the tests hold the two equal.
"""

from __future__ import annotations

import numpy as np

from ..constants import NGRAM_MAX, NO_PREFILL, PLACEHOLDER_TOKEN


def ngram_match(history, n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt-lookup proposal for one sequence: the spec, written as plainly as possible.

    For n from ``n_max`` down to ``n_min``: the most recent earlier occurrence of the last
    n tokens (a window ``history[i : i + n]`` with at least one token after it, so
    ``i + n <= len - 1``; windows may overlap the suffix itself) gives up to k tokens that
    followed it, cut at the end of the history. None found: ``[]``.

    Parameters
    ----------
    history : sequence of int, the sequence so far (its last token is the pending one)
    n_min, n_max : int, 1 <= n_min; n_max < n_min searches nothing
    k : int, most tokens proposed
    """
    h = [int(t) for t in history]
    length = len(h)
    for n in range(n_max, n_min - 1, -1):
        if n > length - 1:  # no earlier window of n tokens with a token after it
            continue
        suffix = h[length - n:]
        for i in range(length - n - 1, -1, -1):
            if h[i : i + n] == suffix:
                return h[i + n : min(i + n + k, length)]
    return []


def _best_end(row: np.ndarray, lo: int, hi: int) -> int:
    """The kernel's pick over ``row`` (the history with the pending token last): the
    window end e maximising (m(e), e) with m(e) >= lo, or -1."""
    length = len(row)
    ends = np.arange(length - 1)  # e in [0, L - 2]
    if lo > hi or len(ends) == 0:
        return -1
    m = np.zeros(len(ends), np.int64)
    alive = np.ones(len(ends), bool)
    for t in range(min(hi, length - 1)):  # m(e) = leading run of hist[e - t] == hist[L - 1 - t]
        ok = alive & (ends - t >= 0)
        ok[ok] = row[ends[ok] - t] == row[length - 1 - t]
        m += ok
        alive = ok
    key = np.where(m >= lo, m * (1 << 32) + ends, -1)
    return int(ends[np.argmax(key)]) if key.max() >= 0 else -1


def ngram_prefill(prompt, prompt_len, hist, hist_len, *, start=None, stream=None):
    """hist[b, S:S + P] = prompt[b, :P], hist_len[b] = S + P, with S = start[b] (0 when
    ``start`` is None) clipped to ``[0, capacity]`` and P = prompt_len[b] clipped to the row
    and to ``capacity - S``; entries below S (earlier chunks) stay. Rows with
    ``NO_PREFILL`` are left alone.

    Parameters
    ----------
    prompt : [B, P_max] int32
    prompt_len : [B] int32
    hist : [B, capacity] int32, written
    hist_len : [B] int32, written
    start : [B] int32 or None, the position of ``prompt[:, 0]``
    """
    p_max, capacity = prompt.shape[1], hist.shape[1]
    for b, n in enumerate(np.asarray(prompt_len)):
        if n == NO_PREFILL:
            continue
        s = 0 if start is None else min(max(int(start[b]), 0), capacity)
        n = min(max(int(n), 0), p_max, capacity - s)
        hist[b, s:s + n] = prompt[b, :n]
        hist_len[b] = s + n


def ngram_search(vtok, pos_ctr, budget, n_min, n_max, hist, hist_len, draft_tok, draft_conf, brk, *, write_vtok,
                 stream=None):
    """One round's prompt-lookup proposals (``ngram_search`` in ngram.cuh).

    A slot is live when ``budget[b] > 0`` and ``0 <= P < capacity`` (P = ``pos_ctr[b]``).
    A live slot's history is ``hist[b, :P]`` plus the pending token ``vtok[b, 0]``; its
    proposal is :func:`ngram_match` of that with ``n_min[b]`` (at least 1) and
    ``n_max[b]`` (at most NGRAM_MAX), nv tokens. Then ``hist[b, P] = vtok[b, 0]``,
    ``hist[b, P + 1 + j]`` = proposal j (inside capacity), ``hist_len[b] = min(P + 1 + nv,
    capacity)``. Every slot: ``draft_tok[b]`` = the proposals then PLACEHOLDER_TOKEN,
    ``draft_conf[b]`` = 1 then 0, ``brk[b] = [nv, nv < k]``, and with ``write_vtok``
    ``vtok[b, 1:]`` = ``draft_tok[b]``. An idle slot proposes nothing (nv = 0).

    Parameters
    ----------
    vtok : [B, k + 1] int32
    pos_ctr, budget, n_min, n_max : [B] int32
    hist : [B, capacity] int32
    hist_len : [B] int32
    draft_tok : [B, k] int32
    draft_conf : [B, k] float32
    brk : [B, 2] int32
    """
    batch, k = draft_tok.shape
    capacity = hist.shape[1]
    for b in range(batch):
        p = int(pos_ctr[b])
        live = budget[b] > 0 and 0 <= p < capacity
        prop = np.zeros(0, np.int32)
        if live:
            row = np.append(np.asarray(hist[b, :p]), vtok[b, 0]).astype(np.int64)
            lo, hi = max(int(n_min[b]), 1), min(int(n_max[b]), NGRAM_MAX)
            e = _best_end(row, lo, hi)
            if e >= 0:
                prop = row[e + 1 : e + 1 + min(k, p - e)].astype(np.int32)
        nv = len(prop)
        draft_tok[b] = PLACEHOLDER_TOKEN
        draft_tok[b, :nv] = prop
        draft_conf[b] = 0.0
        draft_conf[b, :nv] = 1.0
        if write_vtok:
            vtok[b, 1:] = draft_tok[b]
        if live:
            hist[b, p] = vtok[b, 0]
            stop = min(p + 1 + nv, capacity)
            hist[b, p + 1 : stop] = prop[: stop - p - 1]
            hist_len[b] = stop
        brk[b] = (nv, int(nv < k))


def ngram_onehot_logits(prop, brk, logits, *, step, stream=None):
    """Sampling mode: ``logits[b, step]`` = 0 at the proposal, -inf elsewhere.

    The token is ``prop[b, step]`` for ``step < brk[b, 0]``, else 0 (a defined row past the
    break, never read by the accept); a token outside ``[0, V)`` also falls back to 0.

    Parameters
    ----------
    prop : [B, k] int32
    brk : [B, 2] int32
    logits : [B, k, V] float32, row ``step`` written
    """
    vocab = logits.shape[2]
    tok = np.where(step < brk[:, 0], prop[:, step], 0)
    tok = np.where((tok >= 0) & (tok < vocab), tok, 0)
    logits[:, step] = np.float32(-np.inf)
    logits[np.arange(len(tok)), step, tok] = 0.0


def ngram_append(draft_tok, pos_ctr, brk, hist, *, stream=None):
    """Sampling mode: ``hist[b, pos_ctr[b] + 1 + j] = draft_tok[b, j]`` for ``j < brk[b, 0]``
    (positions inside ``[0, capacity)`` only).

    Parameters
    ----------
    draft_tok : [B, k] int32
    pos_ctr : [B] int32
    brk : [B, 2] int32
    hist : [B, capacity] int32, written
    """
    k, capacity = draft_tok.shape[1], hist.shape[1]
    for b in range(draft_tok.shape[0]):
        for j in range(min(int(brk[b, 0]), k)):
            p = int(pos_ctr[b]) + 1 + j
            if 0 <= p < capacity:
                hist[b, p] = draft_tok[b, j]

"""Numpy twin of the logits processing kernels in ``kernels/fields.cuh``.

Per request (per slot b) and in vLLM's order, on the raw logits of the token decided at
absolute position ``pos[b] + r + 1`` (row r): ``min_tokens`` (the stop token's logit
becomes -inf while fewer than ``min_tokens[b]`` tokens were generated before it), then
``logit_bias`` (added), then ``repetition_penalty`` (over the prompt's and the generated
tokens: a logit > 0 is divided by it, any other multiplied), then ``frequency_penalty``
(``-= frequency * count``) and ``presence_penalty`` (``-= presence`` where ``count > 0``),
with ``count`` the generated tokens' counts. ``min_p`` is applied later, with top-k/top-p,
by the probability kernels (``sampling_ref.select_thr``).

History: ``counts[b]`` holds the generated tokens up to and including ``vtok[b, 0]`` (the
pending token); row r adds the drafts ``vtok[b, 1..r]`` (ids outside ``[0, V)``, the
placeholders past a break, count nothing). So each verify row sees exactly the history a
one-token-at-a-time decoder would, and the accept compares the processed ``p`` with the
draft's ``q``: speculation stays lossless.

Every float op is one rounded float32 operation with flush to zero (the device runs with
``-ftz=true``; :mod:`graphburst.kernels.sampling_prims`), so the kernel matches this bit for bit.
"""

from __future__ import annotations

import numpy as np

from ..constants import NO_PREFILL, UNBOUNDED_BUDGET
from .sampling_prims import _add, _div, _gt, _mul, _sub

__all__ = ["apply_fields", "fields_commit", "fields_first", "fields_prompt", "fields_reset"]

_F32 = np.float32


def _history(counts, vtok, r, vocab):
    """[B, V] int64: counts plus the drafts vtok[:, 1..r] (valid ids only)."""
    c = np.asarray(counts, np.int64).copy()
    for t in range(1, min(r, vtok.shape[1] - 1) + 1):
        tok = vtok[:, t].astype(np.int64)
        ok = (tok >= 0) & (tok < vocab)
        np.add.at(c, (np.flatnonzero(ok), tok[ok]), 1)
    return c


def active_slots(eos, min_tokens, presence, frequency, repetition, n_bias):
    """[B] bool: the slots whose logits some field changes (the kernel returns at once for the others)."""
    return ((n_bias > 0) | (presence != 0) | (frequency != 0) | (repetition != 1)
            | ((min_tokens > 0) & (eos >= 0)))


def apply_fields(logits, vtok, pos, counts, prompt_seen, prompt_len, eos, min_tokens, presence, frequency, repetition,
                 bias_ids, bias_val, n_bias, *, step=None, stream=None):
    """Apply the fields to logits in place (module docstring), row r of slot b with the history
    ``counts[b] + vtok[b, 1..r]``.

    Parameters
    ----------
    logits : [B, T, V] float32, processed in place
    vtok : [B, K1] int32 (K1 >= T: row r reads columns 1..r)
    pos : [B] int32: position of ``vtok[b, 0]``; row r decides the token at ``pos + r + 1``
    counts : [B, V] int32: generated tokens up to and including ``vtok[b, 0]``
    prompt_seen : [B, V] uint8: 1 for the tokens of the prompt
    prompt_len : [B] int32: the prompt's length P (tokens generated before row r: ``pos + r + 1 - P``)
    eos : [B] int32: stop token, or < 0 for none
    min_tokens : [B] int32
    presence, frequency, repetition : [B] float32
    bias_ids : [B, NB] int32, bias_val : [B, NB] float32: the first ``n_bias[b]`` entries of row b
        (distinct ids in ``[0, V)``)
    n_bias : [B] int32
    step : int or None: only row ``step`` (None: every row)
    """
    _, n_rows, vocab = logits.shape
    act = active_slots(eos, min_tokens, presence, frequency, repetition, n_bias)
    rows = range(n_rows) if step is None else [step]
    for r in rows:
        hist = _history(counts, vtok, r, vocab)  # [B, V]
        for b in np.flatnonzero(act):
            x = np.array(logits[b, r], _F32)
            made = int(pos[b]) + r + 1 - int(prompt_len[b])
            e = int(eos[b])
            if 0 <= e < vocab and made < int(min_tokens[b]):
                x[e] = -np.inf
            nb = int(n_bias[b])
            if nb > 0:
                bias = np.zeros(vocab, _F32)
                bias[bias_ids[b, :nb]] = bias_val[b, :nb]
                x = _add(x, bias)
            c = hist[b]
            rep = _F32(repetition[b])
            if rep != 1:
                seen = (prompt_seen[b] != 0) | (c > 0)
                x = np.where(seen, np.where(_gt(x, 0), _div(x, rep), _mul(x, rep)), x).astype(_F32)
            fr = _F32(frequency[b])
            if fr != 0:
                x = _sub(x, _mul(fr, c.astype(_F32)))
            pr = _F32(presence[b])
            if pr != 0:
                x = np.where(c > 0, _sub(x, pr), x).astype(_F32)
            logits[b, r] = x


def fields_commit(vtok, n_acc, n_commit, budget, pend, counts, *, stream=None):
    """After ``ring_commit``: count what the round generated into ``counts``.

    The committed drafts ``vtok[b, 1 .. n_commit - 1]`` and, when the whole run was
    committed (``n_commit == clip(n_acc, 0, k) + 1``) and the slot is still live
    (``budget > 0``), the new pending token ``pend[b]``: so ``counts`` keeps holding the
    generated tokens up to and including the pending one. Ids outside ``[0, V)`` count nothing.

    Parameters
    ----------
    vtok : [B, K1] int32
    n_acc, n_commit, budget, pend : [B] int32 (after ring_commit)
    counts : [B, V] int32, updated
    """
    batch, k1 = vtok.shape
    vocab = counts.shape[1]
    for b in range(batch):
        c = int(n_commit[b])
        for i in range(1, min(c, k1)):
            t = int(vtok[b, i])
            if 0 <= t < vocab:
                counts[b, t] += 1
        n = min(max(int(n_acc[b]), 0), k1 - 1)
        t = int(pend[b])
        if c == n + 1 and int(budget[b]) > 0 and 0 <= t < vocab:
            counts[b, t] += 1


def fields_reset(lengths, starts, counts, prompt_seen, *, stream=None):
    """Admission: zero ``counts[b]`` and ``prompt_seen[b]`` of every slot whose chunk starts a
    prompt (``lengths[b] != NO_PREFILL`` and ``starts[b] == 0``).

    Parameters
    ----------
    lengths, starts : [B] int32 (the staging's)
    counts : [B, V] int32, prompt_seen : [B, V] uint8, written
    """
    fresh = (np.asarray(lengths) != NO_PREFILL) & (np.asarray(starts) == 0)
    counts[fresh] = 0
    prompt_seen[fresh] = 0


def fields_prompt(lengths, chunks, prompt_seen, *, stream=None):
    """Admission: ``prompt_seen[b, chunks[b, i]] = 1`` for ``i < lengths[b]`` (ids in ``[0, V)``).

    Parameters
    ----------
    lengths : [B] int32 (NO_PREFILL: slot left alone)
    chunks : [B, P_max] int32
    prompt_seen : [B, V] uint8, updated
    """
    vocab = prompt_seen.shape[1]
    for b in range(len(lengths)):
        n = int(lengths[b])
        if n == NO_PREFILL:
            continue
        tok = np.asarray(chunks[b, :n], np.int64)
        tok = tok[(tok >= 0) & (tok < vocab)]
        prompt_seen[b, tok] = 1


def fields_first(lengths, pend, counts, *, stream=None):
    """Admission, after the first token: ``counts[b, pend[b]] += 1`` for prefilled slots.

    Parameters
    ----------
    lengths : [B] int32 (NO_PREFILL: slot left alone)
    pend : [B] int32
    counts : [B, V] int32, updated
    """
    vocab = counts.shape[1]
    for b in range(len(lengths)):
        t = int(pend[b])
        if int(lengths[b]) != NO_PREFILL and 0 <= t < vocab:
            counts[b, t] += 1


assert UNBOUNDED_BUDGET > 0  # an unbounded slot is live: fields_commit reads budget > 0

"""Shared pieces of the losslessness tests: fixed (p, q) pairs, a chi-square test, wrong rules.

The chi-square survival function uses the Wilson-Hilferty normal approximation (scipy is
not a dependency); ``test_sampling.py`` checks it against tabulated critical values.
"""

from __future__ import annotations

import math

import numpy as np

ALPHA = 1e-3  # significance of every losslessness test

V_SMALL = 12


def _norm(x):
    x = np.asarray(x, np.float64)
    return (x / x.sum()).astype(np.float32)


# Fixed (name, p, q) pairs over V_SMALL tokens; each stresses a different part of the rule.
PAIRS = [
    # overlapping but different: both accept and residual paths matter
    ("skewed", _norm(np.arange(1, V_SMALL + 1) ** 1.5), _norm(np.arange(V_SMALL, 0, -1) ** 1.0)),
    # q puts mass where p has none (tokens 6..11): those drafts must always be rejected
    ("q_outside_p", _norm([8, 6, 5, 4, 2, 1] + [0] * 6), _norm(np.ones(V_SMALL))),
    # p puts mass where q has none: only the residual can emit tokens 3..11
    ("p_outside_q", _norm(np.ones(V_SMALL) + np.arange(V_SMALL) % 3), _norm([5, 3, 2] + [0] * 9)),
]


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df), by the Wilson-Hilferty cube-root approximation."""
    if x <= 0:
        return 1.0
    s = 2.0 / (9.0 * df)
    z = ((x / df) ** (1.0 / 3.0) - (1.0 - s)) / math.sqrt(s)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def goodness_of_fit(tokens, p) -> tuple[float, str]:
    """p-value that ``tokens`` were drawn from ``p``; 0 when a token outside the support appears.

    Returns
    -------
    (p_value, description)
    """
    p = np.asarray(p, np.float64)
    p = p / p.sum()
    counts = np.bincount(np.asarray(tokens), minlength=len(p)).astype(np.float64)
    if len(counts) > len(p) or np.any(np.asarray(tokens) < 0):
        return 0.0, "token outside the vocabulary"
    support = p > 0
    if counts[~support].sum() > 0:
        return 0.0, f"{int(counts[~support].sum())} tokens where p = 0"
    n = counts.sum()
    expected = n * p[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    return chi2_sf(stat, df), f"chi2 = {stat:.1f}, df = {df}, n = {int(n)}"


def emitted(vtok, n_acc, last_pred, j):
    """Token emitted at draft position ``j`` (0-based) of each row, for rows that reach it."""
    n_acc = np.asarray(n_acc)
    reach = n_acc >= j
    tok = np.where(n_acc[reach] > j, np.asarray(vtok)[reach, 1 + j], np.asarray(last_pred)[reach])
    return tok


# ---------------------------------------------------------------------- rules, test-local


def _inverse_cdf(w, u):
    c = np.cumsum(np.asarray(w, np.float64))
    return np.minimum(np.searchsorted(c, u * c[-1], side="right"), len(c) - 1)


def one_draft(p, q, n, rule, rng):
    """First emitted token of ``n`` independent one-draft rounds under ``rule``.

    ``rule`` is ``"correct"`` (min(1, p/q), residual norm(max(0, p - q))) or a wrong variant:
    ``"no_residual"`` (replacement drawn from p), ``"ratio_forgotten"`` (accept with
    probability p(x)), ``"ratio_inverted"`` (accept with min(1, q/p)).
    """
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    x = _inverse_cdf(q, rng.random(n))
    u = rng.random(n)
    residual = np.maximum(p - q, 0.0)
    if rule == "correct":
        accept = u * q[x] < p[x]
    elif rule == "no_residual":
        accept = u * q[x] < p[x]
        residual = p
    elif rule == "ratio_forgotten":
        accept = u < p[x]
    elif rule == "ratio_inverted":
        accept = u * p[x] < q[x]
    else:
        raise ValueError(f"unknown rule {rule!r}")
    if residual.sum() == 0:
        residual = p
    return np.where(accept, x, _inverse_cdf(residual, rng.random(n)))


WRONG_RULES = ("no_residual", "ratio_forgotten", "ratio_inverted")


def round_inputs(n_rows: int, k: int, pairs):
    """p [n, k+1, V], q [n, k, V], seeds and positions for ``n_rows`` independent rounds.

    Draft position i uses ``pairs[i % len(pairs)]``; the bonus row reuses the last position's p.
    Seeds spread over all 64 bits; positions vary so both Philox key and counter move.
    """
    vocab = len(pairs[0][1])
    p = np.empty((n_rows, k + 1, vocab), np.float32)
    q = np.empty((n_rows, k, vocab), np.float32)
    for i in range(k):
        _, pi, qi = pairs[i % len(pairs)]
        p[:, i] = pi
        q[:, i] = qi
    p[:, k] = p[:, k - 1]
    rows = np.arange(n_rows, dtype=np.uint64)
    seed = (rows * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(0x0123456789ABCDEF)
    pos = ((np.arange(n_rows) * 7919) % 100_000).astype(np.int32)
    return p, q, seed, pos

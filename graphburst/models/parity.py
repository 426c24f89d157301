"""Token parity with a reference run, under the near-tie rule.

Two runs of one model with different kernels or reduction orders (HF against
graphburst, TP=2 against one GPU in bf16) emit the same greedy tokens until a near-tie
flips: two candidate tokens whose logits differ by less than the rounding between the
runs. From there on the continuations differ, and neither run is wrong. The rule: the
runs must agree up to the end, or up to a first divergence where the reference model's
teacher-forced logits of the two tokens differ by at most ``tol * max(1, |top logit|)``.
Tokens after a divergence are not compared; the agreed prefix is reported.

Used by ``graphburst bench real`` (HF and torch.compile against graphburst) and the
multi-GPU demo (TP/PP against the whole target on one GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Near-tie tolerance per dtype, relative to max(1, |top logit|): fp32 runs differ only in
# the last bits; bf16 keeps 8 mantissa bits, so a reduction in another order moves a
# logit by up to about 2**-8 of its size.
NEAR_TIE_TOL = {"float32": 1e-4, "bfloat16": 1e-2}


def first_divergence(a: Sequence, b: Sequence) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def near_tie(logits, a: int, b: int, tol: float) -> dict:
    """Is the choice between tokens a and b within ``tol * max(1, |top|)`` on these logits?

    Parameters
    ----------
    logits : [V] array or tensor
        The reference model's logits at the divergence.
    a, b : int
        The two runs' tokens there.

    Returns
    -------
    dict
        ``gap`` (|logit a - logit b|), ``allowed`` (the bound) and ``ok`` (gap <= allowed).
    """
    gap = abs(float(logits[a]) - float(logits[b]))
    allowed = tol * max(1.0, abs(float(logits.max())))
    return dict(gap=gap, allowed=allowed, ok=gap <= allowed)


def compare_tokens(tokens: Sequence[int], ref: Sequence[int], logits_after: Callable, tol: float) -> dict:
    """One sequence of a run against the reference run's, under the near-tie rule.

    Parameters
    ----------
    tokens, ref : sequences of int
        The run's tokens and the reference's; their common length is compared.
    logits_after : callable
        ``logits_after(prefix) -> [V]``: the reference model's teacher-forced logits after
        the prompt plus ``prefix`` (the agreed tokens), called only at a divergence.
    tol : float
        See :data:`NEAR_TIE_TOL`.

    Returns
    -------
    dict
        ``compared`` (tokens compared), ``agreed`` (the agreed prefix), ``divergence``
        (None, or ``at``, ``theirs``, ``ours`` and :func:`near_tie`'s fields) and ``ok``
        (no divergence, or a near-tie).
    """
    n = min(len(tokens), len(ref))
    at = first_divergence(list(tokens[:n]), list(ref[:n]))
    out = dict(compared=n, agreed=n if at is None else at, divergence=None, ok=True)
    if at is not None:
        tie = near_tie(logits_after(list(ref[:at])), tokens[at], ref[at], tol)
        out["divergence"] = dict(at=at, theirs=int(tokens[at]), ours=int(ref[at]), **tie)
        out["ok"] = tie["ok"]
    return out


def describe(res: dict) -> str:
    """A short account of :func:`compare_tokens`'s result for a table cell."""
    d = res["divergence"]
    if d is None:
        return f"all {res['compared']}"
    verdict = "near-tie" if d["ok"] else "NOT a near-tie"
    return (f"token {d['at']}: {d['theirs']} vs {d['ours']}, gap {d['gap']:.4f} "
            f"{'<=' if d['ok'] else '>'} {d['allowed']:.4f} ({verdict})")


def teacher_forced_logits(model, prompt: list, prefix: list):
    """``[V] float32``: a Llama's teacher-forced logits after prompt + prefix (writes its KV row 0)."""
    import torch

    dev = model.kv[0].device
    ids = torch.tensor([list(prompt) + list(prefix)], dtype=torch.int64, device=dev)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    last = torch.tensor([ids.shape[1] - 1], device=dev)
    with torch.no_grad():
        return model(ids, zero, [zero] * len(model.layers), torch.arange(1, device=dev), logits_at=last)[0, 0].float()

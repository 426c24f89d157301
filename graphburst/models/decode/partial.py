"""A projection's output as the kernel after it reads it: whole, or as split-K partial sums.

The weight-streaming GEMV (``decode/gemv.py``) splits a narrow projection along K and sums
the partials in a second launch. The folded decode path (``decode/folded.py``) drops that
launch: the kernel that consumes the projection adds the partials itself, in split order,
adds the bias and rounds once, which is what the sum pass computes. A :class:`Partial`
carries what that consumer needs. This module imports no Triton, so the plain-torch
references use it too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: ``Partial.splits`` of an output held whole: ``parts`` is the ``[M, N]`` result, bias included
WHOLE = 0


class Partial(NamedTuple):
    """``parts`` [M, N] ``dtype`` (``splits == WHOLE``: the output itself, bias added), or ``parts``
    [splits, M, N] float32 partial sums over K, to be added in split order, plus ``bias`` [N] (or None),
    then rounded once to ``dtype``."""

    parts: torch.Tensor
    splits: int
    bias: torch.Tensor | None
    dtype: torch.dtype

    @classmethod
    def whole(cls, y: torch.Tensor) -> "Partial":
        """An output already summed and rounded (an ``nn.Linear`` call's, a reference's)."""
        return cls(y, WHOLE, None, y.dtype)

    @property
    def shape(self) -> tuple[int, int]:
        """[M, N] of the output."""
        return tuple(self.parts.shape[-2:])


def dense(p: Partial) -> torch.Tensor:
    """The output of ``p`` in plain torch: [M, N] ``p.dtype`` (the sum pass's arithmetic: split order, fp32,
    bias last, one rounding)."""
    if p.splits == WHOLE:
        return p.parts
    acc = p.parts[0].clone()
    for s in range(1, p.splits):
        acc += p.parts[s]
    if p.bias is not None:
        acc += p.bias.float()
    return acc.to(p.dtype)


class AttentionSplits(NamedTuple):
    """Split-KV attention's output before its combine (``decode/attention.py``), for a consumer that
    combines it as it loads it (the folded o_proj): ``o`` [B, T, H, S, D] float32 each split's partial
    output, ``lse`` [B, T, H, S] float32 its log2-sum-exp (-inf: the split saw nothing), ``length`` [B]
    int32 the valid KV rows before the call and ``rows`` the cache's rows per sequence (together they say
    which splits ran: the ones past a sequence's rows wrote nothing), ``block`` the attention's KV rows per
    tile, ``dtype`` the combined output's."""

    o: torch.Tensor
    lse: torch.Tensor
    length: torch.Tensor
    rows: int
    block: int
    dtype: torch.dtype

    @property
    def splits(self) -> int:
        return self.o.shape[3]

    @property
    def shape(self) -> tuple[int, int]:
        """[B * T, H * D] of the combined output, as the o projection reads it."""
        b, t, h, _, d = self.o.shape
        return b * t, h * d


def combined(a: AttentionSplits) -> torch.Tensor:
    """The combined output of ``a`` in plain torch, [B * T, H * D] ``a.dtype``: the splits that ran, each
    weighted by ``exp2(lse - max lse)``."""
    b, t, h, s, d = a.o.shape
    n_valid = (a.length.long().clamp(min=0) + t).clamp(max=a.rows)  # [B]
    tiles = -(-n_valid // a.block)
    per = -(-tiles // s)
    active = -(-tiles // per)  # [B] splits that ran
    ran = torch.arange(s, device=a.o.device).view(1, 1, 1, s) < active.view(b, 1, 1, 1)  # [B, 1, 1, S]
    lse = torch.where(ran, a.lse, float("-inf"))
    w = torch.exp2(lse - lse.amax(-1, keepdim=True))  # [B, T, H, S]; split 0 always ran: the max is finite
    o = torch.where(ran.unsqueeze(-1), a.o, 0.0)
    y = (w.unsqueeze(-1) * o).sum(3) / w.sum(3, keepdim=True)
    return y.to(a.dtype).view(b * t, h * d)

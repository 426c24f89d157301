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

"""The bucket arithmetic of the prefill graphs (:mod:`~graphburst.models.prefill_graphs`): the
ladders a call's rows and length are rounded up, which buckets a warm-up makes, and what their
outputs keep. Pure functions of sizes, apart from the graphs that capture and replay them.
"""

from __future__ import annotations

import bisect

from ..validate import check_int

#: rows of a bucket: padding rows cost a whole prompt's compute each, so the steps are fine
ROW_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
#: tokens per row of a bucket (then doubling past the last)
LENGTH_LADDER = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
#: the largest bucket graphed (rows x length): its activations stay reserved in the pool
DEFAULT_MAX_TOKENS = 8192
#: The cost of one more prefill call, in padded tokens: a call reads every weight once
#: (2 bytes per parameter at 4.8 TB/s) and a token costs 2 FLOPs per parameter (at the
#: ~600 bf16 TFLOP/s a prefill GEMM reaches on the H200), so a call costs as much as
#: 600e12 / 4.8e12 = 125 tokens, whatever the model's size.
CALL_COST_TOKENS = 128
#: The extra cost of a call that runs eagerly (a bucket's first use): its launches cost the
#: host ~10 ms on an H200 (1b shape), what the GPU spends on ~1000 prompt tokens.
EAGER_CALL_COST_TOKENS = 1024
#: A bucket is captured at its second call (its first runs eagerly and unpadded).
CAPTURE_AT_USE = 2


def _up(ladder, n: int) -> int:
    """The smallest ladder value >= n (doubling the last value past the ladder's end)."""
    i = bisect.bisect_left(ladder, n)
    if i < len(ladder):
        return ladder[i]
    top = ladder[-1]
    while top < n:
        top *= 2
    return top


def _ladder_to(ladder, top: int) -> list[int]:
    """Every value :func:`_up` can give that is <= ``top``: the ladder, then its doublings."""
    out = [v for v in ladder if v <= top]
    v = ladder[-1] * 2
    while v <= top:
        out.append(v)
        v *= 2
    return out


def warm_sizes(max_rows: int, max_tokens: int = DEFAULT_MAX_TOKENS, max_length: int | None = None) -> list:
    """The ``(rows, length)`` buckets a warm-up of ``max_rows`` captures, largest first.

    Every bucket whose rows are at most the bucket of ``max_rows`` (rows of a call never
    exceed the batch, so a few rows cover most admissions under load), whose length is at
    most the bucket of ``max_length`` (None: any; a prompt never exceeds the KV capacity,
    nor a chunk the chunk size) and whose ``rows x length <= max_tokens``. Largest first:
    the shared pool then grows to its largest bucket's activations at the first capture
    and the later, smaller ones reuse that memory.
    """
    max_rows = check_int("max_rows", max_rows, minimum=0)
    if max_rows == 0:
        return []
    top_len = max_tokens if max_length is None else min(max_tokens, _up(LENGTH_LADDER, max_length))
    sizes = [(r, p) for r in _ladder_to(ROW_LADDER, _up(ROW_LADDER, max_rows))
             for p in _ladder_to(LENGTH_LADDER, min(top_len, max_tokens // r))]
    return sorted(sizes, key=lambda rp: (-rp[0] * rp[1], -rp[0]))


def continued_warm_lengths(max_length: int | None, max_tokens: int = DEFAULT_MAX_TOKENS) -> list:
    """The lengths of the one-row continued buckets a warm-up makes for a prefill chunk of
    ``max_length`` tokens (None: no chunks, none), longest first.

    One row: an admission continues at most one prompt (the loop prefills whole prompts that
    fit its chunk budget, oldest first, then one chunk of the next), and its fresh prompts run
    apart (``admission._fresh_and_continued``). Every length up the ladder to the chunk's bucket:
    a later chunk is whatever budget is left."""
    if max_length is None:
        return []
    top = min(_up(LENGTH_LADDER, max_length), max_tokens)
    return sorted(_ladder_to(LENGTH_LADDER, top), reverse=True)


def warm_output_bytes(max_rows: int, vocab: int, max_tokens: int = DEFAULT_MAX_TOKENS,
                      max_length: int | None = None, continued: bool = False) -> int:
    """Bytes the outputs of a warm-up with a head keep in the pool: ``[R_b, 1, V]`` float32 per
    bucket, fresh ones and (``continued``) the one-row continued ones."""
    rows = sum(r for r, _ in warm_sizes(max_rows, max_tokens, max_length))
    if continued and max_rows:
        rows += len(continued_warm_lengths(max_length, max_tokens))
    return rows * vocab * 4


def padded_bucket(rows: int, length: int, max_tokens: int) -> tuple[int, int] | None:
    """``(rows, length)`` of the padded bucket a call of that size runs in, or None (eager):
    each rounded up its ladder, within ``max_tokens`` rows x length."""
    r, p = _up(ROW_LADDER, rows), _up(LENGTH_LADDER, length)
    return (r, p) if r * p <= max_tokens else None

"""The stub models' hash arithmetic, shared by the numpy reference and the CPU greedy oracle.

Every function works on Python ``int`` and on ``numpy.uint64`` arrays holding uint32
values: products of two values below 2**32 fit in uint64, and every step masks back to
32 bits, so both forms reproduce the CUDA ``u32`` arithmetic in ``kernels.cu`` exactly.
"""

from __future__ import annotations

import numpy as np

MASK32 = 0xFFFFFFFF
DIGEST_INIT = 0x2545F491  # c[-1]: the digest of the empty prefix
DIGEST_CORRUPT = 0xDEADBEEF  # stands in for a KV read at an out-of-range length
CONF_BITS = 24  # confidences and acceptance thresholds are 24-bit fixed point
CONF_ONE = 1 << CONF_BITS


def u32(x):
    """Reinterpret int32 tokens/positions (int or array) as uint32 held in uint64."""
    if isinstance(x, np.ndarray):
        return (x.astype(np.int64) & MASK32).astype(np.uint64)
    return int(x) & MASK32


def mix32(x):
    """lowbias32 finaliser (``gb_mix32``)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def digest_step(prev, tok, pos):
    """``c[p] = f(c[p-1], token[p], p)`` (``gb_digest_step``); tok and pos are int32."""
    t = (((u32(tok) * 0x9E3779B1) & MASK32) + ((u32(pos) * 0x85EBCA77) & MASK32) + 0x165667B1) & MASK32
    return mix32(prev ^ mix32(t))


def combine(mn, mx):
    """Digest agreed by all layers, or a garbled one when any layer disagrees."""
    garbled = mix32(mn ^ ((mx * 0x27D4EB2F) & MASK32) ^ 0x94D049BB)
    if isinstance(mn, np.ndarray):
        return np.where(mn == mx, mn, garbled)
    return mn if mn == mx else garbled


def target_token(digest, vocab: int):
    """The target stub's greedy token for a prefix digest (``gb_target_token``)."""
    return mix32(digest ^ 0x68E31DA4) % vocab


def agree_hash(seed, pos):
    """Draft agreement hash keyed by (seed, position of the predicted token)."""
    return mix32(seed ^ mix32((((u32(pos) * 0x27D4EB2D) & MASK32) + 0x1B873593) & MASK32))


def conf_hash(h):
    """Second hash of the draft stub: confidence in its top 24 bits."""
    return mix32(h ^ 0x5BD1E995)


def wrong_shift(h2, vocab: int):
    """Offset in [1, vocab) that turns the true token into a guaranteed-wrong draft."""
    return 1 + mix32(h2 ^ 0xCC9E2D51) % (vocab - 1)


def fixed24(p: float) -> int:
    """A probability in [0, 1] as the 24-bit threshold the kernels compare against."""
    return int(round(float(p) * CONF_ONE))


def prefix_digest(tokens) -> int:
    """Digest of a whole token prefix, positions counted from 0."""
    c = DIGEST_INIT
    for pos, tok in enumerate(tokens):
        c = digest_step(c, int(tok), pos)
    return c


def greedy_reference(prompt, n_tokens: int, vocab: int) -> list[int]:
    """The target stub's greedy autoregressive continuation of ``prompt``.

    This is the oracle every burst is checked against: it never touches a KV cache,
    so any error in rollback, commit or acceptance shows up as a token mismatch.

    Parameters
    ----------
    prompt : sequence of int
        Prompt tokens, each in ``[0, vocab)``.
    n_tokens : int
        Number of tokens to generate.
    vocab : int
        Vocabulary size of the target stub.

    Returns
    -------
    list of int
        ``n_tokens`` greedy tokens following the prompt.
    """
    c = prefix_digest(prompt)
    pos = len(prompt)
    out = []
    for _ in range(n_tokens):
        tok = int(target_token(c, vocab))
        out.append(tok)
        c = digest_step(c, tok, pos)
        pos += 1
    return out

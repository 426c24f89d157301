"""Numpy twins of the sampling kernels' device primitives (``kernels.cu``, "Sampling").

Float32 arithmetic with flush to zero, Philox4x32-10, ``gb_exp_neg``, the exponential
variate ``gb_expo`` of the race, order keys and the fixed reduction trees. The row
kernels built from them are in :mod:`graphburst.kernels.sampling_ref`.

Flush to zero: CuPy compiles every RawModule through NVRTC with ``-ftz=true`` appended
unconditionally (``cupy/cuda/compiler.py``), so on the device every float32 operation,
comparisons included, reads a subnormal input as a signed zero and flushes a subnormal
result to one. Every float op below that can meet a subnormal therefore goes through
:func:`ftz` on its inputs and its output (``_add``, ``_sub``, ``_mul``, ``_div``, ``_gt``).

Reduction order (``tile_sum``, ``tile_combine``): each float sum is a fixed tree, so the
device's parallel split and numpy give the same bits. A warp's xor butterfly
(``v += shfl_xor(v, 16)``, then 8, 4, 2, 1) leaves every lane holding
``halve(halve(...(x)))`` with ``halve(x) = x[:n/2] + x[n/2:]`` (addition commutes, so
lanes l and l ^ o compute the same sum).
"""

from __future__ import annotations

import numpy as np

from ..constants import SAMPLE_THREADS, SAMPLE_TILE
from .sampling_scratch import n_tiles

NT = SAMPLE_THREADS
TILE = SAMPLE_TILE
VEC = 4  # consecutive elements per thread access (one float4; one Philox block of 4 words)
N_VEC = TILE // (VEC * NT)  # float4 accesses per thread per tile
N_WARPS = NT // 32
_U32 = np.uint64(0xFFFFFFFF)
_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))
_F32 = np.float32
_LOG2E = _F32(float.fromhex("0x1.715476p+0"))
_LN2 = _F32(float.fromhex("0x1.62e430p-1"))
# Taylor coefficients ln(2)^i / i! of 2^f, highest degree first, as float32.
_EXP2_POLY = tuple(_F32(float.fromhex(h)) for h in (
    "0x1.ffcbfcp-17", "0x1.430912p-13", "0x1.5d87fep-10", "0x1.3b2ab6p-7",
    "0x1.c6b08ep-5", "0x1.ebfbe0p-3", "0x1.62e430p-1", "0x1p0"))
# 1 / (2j + 1), j = 5 .. 0: 2 atanh(s) = 2s * sum_j z^j / (2j + 1), z = s^2.
_ATANH_POLY = tuple(_F32(1.0 / d) for d in (11, 9, 7, 5, 3, 1))
_V_MAX = _F32(float.fromhex("0x1.fffffep-1"))  # largest float32 below 1
FLT_MIN = _F32(2.0**-126)  # smallest normal float32: anything smaller in magnitude is flushed


# --------------------------------------------------------------------------------------
# Flush-to-zero float32 arithmetic (the device runs with -ftz=true)
# --------------------------------------------------------------------------------------


def ftz(x):
    """Subnormal float32 values -> zero of the same sign (NaN and inf pass through).

    Parameters
    ----------
    x : array_like float32

    Returns
    -------
    float32 array of the same shape
    """
    x = np.asarray(x, _F32)
    return np.where(np.abs(x) < FLT_MIN, np.copysign(_F32(0.0), x), x).astype(_F32, copy=False)


def _add(a, b):
    return ftz(ftz(a) + ftz(b))


def _sub(a, b):
    # -inf - -inf (a tile of masked logits) is NaN on the device too; the twin says so quietly.
    with np.errstate(invalid="ignore"):
        return ftz(ftz(a) - ftz(b))


def _mul(a, b):
    return ftz(ftz(a) * ftz(b))


def _div(a, b):
    with np.errstate(all="ignore"):
        return ftz(ftz(a) / ftz(b))


def _gt(a, b):
    """``a > b`` as ``setp.gt.ftz.f32`` compares: subnormal operands count as zero."""
    return ftz(a) > ftz(b)


# --------------------------------------------------------------------------------------
# Counter-based randomness
# --------------------------------------------------------------------------------------


def philox4x32_10(counter, key):
    """Philox4x32-10 (Salmon et al., SC'11) on uint32 words, vectorised.

    Parameters
    ----------
    counter : array_like [..., 4] uint32
    key : array_like [..., 2] uint32

    Returns
    -------
    [..., 4] uint32
    """
    c = [np.asarray(counter, np.uint64)[..., j] for j in range(4)]
    k0, k1 = (np.asarray(key, np.uint64)[..., j] for j in range(2))
    for r in range(10):
        if r:
            k0 = (k0 + _PHILOX_W[0]) & _U32
            k1 = (k1 + _PHILOX_W[1]) & _U32
        p0 = _PHILOX_M[0] * c[0]
        p1 = _PHILOX_M[1] * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & _U32, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & _U32]
    return np.stack(c, axis=-1).astype(np.uint32)


def _key(seed):
    seed = np.asarray(seed, np.uint64)
    return np.stack([seed & _U32, seed >> np.uint64(32)], axis=-1)


def uniform(seed, pos, draw):
    """24-bit uniform in [0, 1) for (seed, absolute position, draw index), as in ``gb_uniform``.

    Parameters
    ----------
    seed : [N] uint64
    pos : [N] int (taken modulo 2**32, like the kernel's int -> u32 cast)
    draw : int, one of the ``DRAW_*`` constants

    Returns
    -------
    [N] float32
    """
    pos32 = np.asarray(pos, np.int64) & 0xFFFFFFFF
    ctr = np.stack(np.broadcast_arrays(pos32, np.int64(draw), np.int64(0), np.int64(0)), axis=-1)
    word0 = philox4x32_10(ctr, _key(seed))[..., 0]
    return (word0 >> np.uint32(8)).astype(_F32) * _F32(2.0**-24)


def race_words_at(seed, pos, draw, idx):
    """:func:`race_words` of single elements: row r's element ``idx[r]`` (any int shape [N]).

    Parameters
    ----------
    seed : [N] uint64
    pos : [N] int (modulo 2**32)
    draw : int
    idx : [N] int

    Returns
    -------
    [N] uint32
    """
    idx = np.asarray(idx, np.int64)
    pos32 = np.asarray(pos, np.int64) & 0xFFFFFFFF
    ctr = np.stack(np.broadcast_arrays(pos32, np.int64(draw), idx // VEC, np.int64(0)), axis=-1)
    words = philox4x32_10(ctr, _key(seed))
    return np.take_along_axis(words, (idx % VEC)[:, None], axis=1)[:, 0]


def race_words(seed, pos, draw, n_elem):
    """Philox words of the race: element i of a row uses word ``i % 4`` of counter
    ``[pos, draw, i // 4, 0]`` (one Philox call per 4 consecutive elements, as a thread's
    float4 on the device).

    Parameters
    ----------
    seed : [R] uint64
    pos : [R] int (modulo 2**32)
    draw : int
    n_elem : int, a multiple of 4

    Returns
    -------
    [R, n_elem] uint32
    """
    pos32 = np.asarray(pos, np.int64) & 0xFFFFFFFF
    groups = np.arange(n_elem // VEC, dtype=np.int64)
    rows = len(pos32)
    ctr = np.zeros((rows, len(groups), 4), np.int64)
    ctr[..., 0] = pos32[:, None]
    ctr[..., 1] = draw
    ctr[..., 2] = groups[None, :]
    key = np.broadcast_to(_key(seed)[:, None, :], (rows, len(groups), 2))
    return philox4x32_10(ctr, key).reshape(rows, n_elem)


# --------------------------------------------------------------------------------------
# exp, log, exponential variates
# --------------------------------------------------------------------------------------


def exp_neg(x):
    """``gb_exp_neg``: e^x for x <= 0 from float32 * + rint only; below 2^-125 (and NaN) -> 0."""
    x = np.asarray(x, _F32)
    with np.errstate(all="ignore"):
        y = _mul(x, _LOG2E)  # x and y flushed; below, |products| < 2**-37 vanish in the add anyway
        small = ~(y >= _F32(-125.0))
        y = np.minimum(np.where(small, _F32(0.0), y), _F32(0.0))
        n = np.rint(y)
        f = _sub(y, n)
        r = np.full_like(f, _EXP2_POLY[0])
        for c in _EXP2_POLY[1:]:
            r = r * f + c
        scale = ((n.astype(np.int32) + np.int32(127)) << np.int32(23)).view(_F32)
        return np.where(small, _F32(0.0), r * scale)  # r >= 0.7, scale >= 2**-125: normal


def neg_log1m(v):
    """``gb_neg_log1m``: -log(1 - v) for float32 0 < v < 1, relative error ~1e-7.

    v < 1/4: log1p(f) with f = -v exactly (full relative precision as v -> 0, where the
    race needs it). Otherwise u = 1 - v (one rounding) = m * 2^e with m in [3/4, 3/2],
    f = m - 1 exact. log1p(f) = 2 atanh(s), s = f / (2 + f), |s| <= 1/5, by its series to
    z^5 (z = s^2). Every intermediate is normal for v >= 2^-32, so no flush happens.
    """
    v = np.asarray(v, _F32)
    with np.errstate(all="ignore"):
        low = v < _F32(0.25)
        u = (_F32(1.0) - v).astype(_F32)
        bits = u.view(np.uint32)
        ex = ((bits >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32) - 127
        m = ((bits & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)).view(_F32)
        big = m > _F32(1.5)
        m = np.where(big, m * _F32(0.5), m).astype(_F32)
        ex = ex + big.astype(np.int32)
        f = np.where(low, -v, m - _F32(1.0)).astype(_F32)
        e = np.where(low, _F32(0.0), ex.astype(_F32)).astype(_F32)
        s = (f / (_F32(2.0) + f)).astype(_F32)
        z = (s * s).astype(_F32)
        r = np.full_like(z, _ATANH_POLY[0])
        for c in _ATANH_POLY[1:]:
            r = (r * z + c).astype(_F32)
        lg = ((_F32(2.0) * s) * r).astype(_F32)
        return (-(e * _LN2 + lg)).astype(_F32)


def expo(words):
    """``gb_expo``: a standard exponential variate from one uint32 Philox word.

    v = (word | 1) * 2^-32 (rounded to float32 once, as ``__uint2float_rn``; capped below
    1), E = -log(1 - v). v keeps 32 random bits where E is small, which is where the race
    is decided, so ties between equal weights are ~2^-32 events rather than 2^-24.
    """
    w = (np.asarray(words, np.uint32) | np.uint32(1)).astype(np.float64).astype(_F32)  # one RN rounding
    v = np.minimum((w * _F32(2.0**-32)).astype(_F32), _V_MAX)
    return neg_log1m(v)


# --------------------------------------------------------------------------------------
# Order keys
# --------------------------------------------------------------------------------------


def order_key(x):
    """``gb_order_key`` of [..., V] float32 rows: logit order, lower index first on ties.

    The kernel's ``x == 0.0f`` test runs flushed, so a subnormal logit ranks as +0 too.
    """
    x = np.ascontiguousarray(x, _F32)
    bits = np.where(ftz(x) == 0, np.uint32(0), x.view(np.uint32))
    bits = np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000))
    idx = ~np.arange(x.shape[-1], dtype=np.uint32)
    return (bits.astype(np.uint64) << np.uint64(32)) | idx.astype(np.uint64)


def key_logit(key):
    """``gb_key_logit``: the logit of an order key (a flushed or negative zero comes back as +0)."""
    hb = (np.asarray(key, np.uint64) >> np.uint64(32)).astype(np.uint32)
    bits = np.where(hb & np.uint32(0x80000000), hb & np.uint32(0x7FFFFFFF), ~hb)
    return np.ascontiguousarray(bits, np.uint32).view(_F32)


def key_index(key):
    """Token index of an order or race key (its low word, complemented)."""
    return (~(np.asarray(key, np.uint64) & _U32).astype(np.uint32)).astype(np.int64)


def race_key(r, idx, candidate):
    """``gb_race_key``: (bits of r >= 0) << 32 | ~index for candidates, 0 (none) otherwise."""
    bits = np.ascontiguousarray(ftz(r), _F32).view(np.uint32).astype(np.uint64)
    low = (~np.asarray(idx, np.uint32)).astype(np.uint64)
    return np.where(candidate, (bits << np.uint64(32)) | low, np.uint64(0))


# --------------------------------------------------------------------------------------
# Tiles and fixed-order sums
# --------------------------------------------------------------------------------------


def tile_shape(vocab: int) -> tuple:
    """``(n_tiles, N_VEC', P, VEC)``: the layout :func:`tiled` gives a row of ``vocab``.

    Several tiles: the device's full ``(N_VEC, NT)``. One tile: only the threads (rounded
    up to a power of two, P) and float4s that hold elements; the rest would add exact
    zeros (x + 0 = x for x >= 0, and a halving step whose upper half is 0 returns the lower
    half), so the sums are the device's bit for bit without padding small rows to a tile.
    """
    nt = n_tiles(vocab)
    if nt > 1 or vocab > VEC * NT:
        return nt, N_VEC, NT, VEC
    used = -(-vocab // VEC)
    return 1, 1, 1 << (used - 1).bit_length(), VEC


def tiled(x, fill):
    """[R, V] -> [R, n_tiles, nv, P, VEC] (:func:`tile_shape`), padded with ``fill``: element
    ``t*TILE + (j*NT + tid)*VEC + c`` is thread ``tid``'s float4 j, lane c, of tile t."""
    rows, vocab = x.shape
    shape = tile_shape(vocab)
    pad = np.full((rows, int(np.prod(shape))), fill, dtype=x.dtype)
    pad[:, :vocab] = x
    return pad.reshape((rows,) + shape)


def untile(x, vocab):
    """Inverse of :func:`tiled`: [R, n_tiles, nv, P, VEC] -> [R, vocab]."""
    return x.reshape(x.shape[0], -1)[:, :vocab]


def halve_tree(x):
    """The xor-butterfly sum over the last axis (a power of two): halve until one is left."""
    x = np.asarray(x, _F32)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = _add(x[..., :h], x[..., h:])
    return x[..., 0]


def tile_sum(w):
    """The block sum of ``gb_tile_reduce`` for each tile of :func:`tiled` weights >= 0 (flushed).

    Each thread adds its elements left to right (j outer, c inner), each warp runs the xor
    butterfly, then the warp totals are halved the same way.

    Returns
    -------
    [R, T] float32
    """
    acc = np.zeros(w.shape[:2] + (w.shape[3],), _F32)
    for j in range(w.shape[2]):
        for c in range(VEC):
            acc = _add(acc, w[:, :, j, :, c])
    lanes = min(32, acc.shape[-1])
    warps = halve_tree(acc.reshape(acc.shape[:2] + (-1, lanes)))
    return halve_tree(warps)


def tile_combine(x):
    """``gb_warp_combine``: the sum of [R, T] tile values in one warp's fixed order: lane l
    adds tiles l, l + 32, l + 64, ... left to right, then the xor butterfly.

    Returns
    -------
    [R] float32
    """
    rows, nt = x.shape
    per_lane = -(-nt // 32)
    pad = np.zeros((rows, per_lane * 32), _F32)
    pad[:, :nt] = x
    lanes = np.zeros((rows, 32), _F32)
    for s in range(per_lane):
        lanes = _add(lanes, pad[:, s * 32:(s + 1) * 32])
    return halve_tree(lanes)

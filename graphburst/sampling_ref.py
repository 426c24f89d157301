"""Numpy reference of the sampling kernels in ``kernels.cu`` (section "Sampling").

Each public kernel function has the same name and signature as its CUDA wrapper in
``cuda_ops.py`` and writes its output arrays in place; ``stream`` is accepted and ignored.
The GPU tests hold the kernels to these functions bit for bit (tokens, counts and every
probability bit), which is possible because the kernels fix their float summation order
(see :func:`block_scan`), use explicitly rounded float ops only, and compute exp with
:func:`exp_neg` rather than a libm whose last bit differs between host and device.

Flush to zero: CuPy compiles every RawModule through NVRTC with ``-ftz=true`` appended
unconditionally (``cupy/cuda/compiler.py``), so on the device every float32 operation,
comparisons included, reads a subnormal input as a signed zero and flushes a subnormal
result to one. Every float op below that can meet a subnormal therefore goes through
:func:`ftz` on its inputs and its output (``_sub``, ``_mul``, ``_div``, ``_gt``), and so
does the zero test of :func:`order_key`. Sums of flushed non-negative weights (the row
sums and scans) need no flush: a sum of non-negative normal floats is never subnormal.

Randomness is Philox4x32-10 keyed by the request seed; the counter is
``[absolute position of the token being decided, draw index, 0, 0]``, so a draw is a pure
function of (seed, position, draw) and needs no state anywhere.

Shape legend: B = batch, T = rows per sequence, k = drafts, K1 = k + 1, V = vocabulary.
"""

from __future__ import annotations

import numpy as np

from .constants import DRAW_ACCEPT, DRAW_DRAFT, DRAW_RESAMPLE, PLACEHOLDER_TOKEN, SAMPLE_THREADS

NT = SAMPLE_THREADS
N_WARPS = NT // 32
_U32 = np.uint64(0xFFFFFFFF)
_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))
_F32 = np.float32
_LOG2E = _F32(float.fromhex("0x1.715476p+0"))
# Taylor coefficients ln(2)^i / i! of 2^f, highest degree first, as float32.
_EXP2_POLY = tuple(_F32(float.fromhex(h)) for h in (
    "0x1.ffcbfcp-17", "0x1.430912p-13", "0x1.5d87fep-10", "0x1.3b2ab6p-7",
    "0x1.c6b08ep-5", "0x1.ebfbe0p-3", "0x1.62e430p-1", "0x1p0"))
_MASS_SCALE = _F32(2.0**32)
_ROW_BLOCK = 2048  # rows per block in sample_rows: keeps [rows, NT] temporaries in cache
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


def _sub(a, b):
    return ftz(ftz(a) - ftz(b))


def _mul(a, b):
    return ftz(ftz(a) * ftz(b))


def _div(a, b):
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
    seed = np.asarray(seed, np.uint64)
    pos32 = np.asarray(pos, np.int64) & 0xFFFFFFFF
    ctr = np.stack(np.broadcast_arrays(pos32, np.int64(draw), np.int64(0), np.int64(0)), axis=-1)
    key = np.stack([seed & _U32, seed >> np.uint64(32)], axis=-1)
    word0 = philox4x32_10(ctr, key)[..., 0]
    return (word0 >> np.uint32(8)).astype(_F32) * _F32(2.0**-24)


# --------------------------------------------------------------------------------------
# Float building blocks, in the kernels' exact operation order
# --------------------------------------------------------------------------------------


def exp_neg(x):
    """``gb_exp_neg``: e^x for x <= 0 from float32 * + rint only; below 2^-125 -> 0."""
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


def order_key(x):
    """``gb_order_key`` of a [R, V] float32 row block: logit order, lower index first on ties.

    The kernel's ``x == 0.0f`` test runs flushed, so a subnormal logit ranks as +0 too.
    """
    bits = np.where(ftz(x) == 0, np.uint32(0), np.ascontiguousarray(x, _F32).view(np.uint32))
    bits = np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000))
    idx = ~np.arange(x.shape[-1], dtype=np.uint32)
    return (bits.astype(np.uint64) << np.uint64(32)) | idx.astype(np.uint64)


def _chunks(w):
    """[R, V] -> [R, NT, C] zero-padded: thread t's chunk is w[:, t*C:(t+1)*C]."""
    rows, vocab = w.shape
    c_len = -(-vocab // NT)
    pad = np.zeros((rows, NT * c_len), _F32)
    pad[:, :vocab] = w
    return pad.reshape(rows, NT, c_len)


def _chunk_sums(ch):
    acc = np.zeros(ch.shape[:2], _F32)
    for c in range(ch.shape[2]):
        acc = acc + ch[:, :, c]
    return acc


def block_scan(part):
    """``gb_block_scan``: inclusive scan of [R, NT] chunk sums in the kernel's order.

    Kogge-Stone inside each warp of 32, Kogge-Stone over the warp totals, then each warp
    but the first adds the previous warp's inclusive total.
    """
    rows = part.shape[0]
    loc = part.reshape(rows, N_WARPS, 32).astype(_F32)
    for d in (1, 2, 4, 8, 16):
        nxt = loc.copy()
        nxt[:, :, d:] = loc[:, :, d:] + loc[:, :, :-d]
        loc = nxt
    tot = loc[:, :, 31].copy()
    d = 1
    while d < N_WARPS:
        nxt = tot.copy()
        nxt[:, d:] = tot[:, d:] + tot[:, :-d]
        tot = nxt
        d *= 2
    out = loc.copy()
    out[:, 1:, :] = tot[:, :-1, None] + loc[:, 1:, :]
    return out.reshape(rows, NT)


def row_sum(w):
    """The kernels' fixed-order sum of each row of a [R, V] float32 block (flushed, >= 0)."""
    return block_scan(_chunk_sums(_chunks(w)))[:, -1]


def sample_rows(w, u):
    """``gb_sample_row`` for each row: inverse-CDF draw from non-negative weights.

    Rows are processed in blocks so the [rows, NT] temporaries stay in cache.

    Parameters
    ----------
    w : [R, V] float32, >= 0
    u : [R] float32 uniforms

    Returns
    -------
    [R] int64, -1 for a row without positive weight
    """
    rows = w.shape[0]
    out = np.full(rows, -1, np.int64)
    for r0 in range(0, rows, _ROW_BLOCK):
        out[r0:r0 + _ROW_BLOCK] = _sample_block(w[r0:r0 + _ROW_BLOCK], u[r0:r0 + _ROW_BLOCK])
    return out


def _sample_block(w, u):
    rows, vocab = w.shape
    w = ftz(w)  # every use of a weight on the device (sum, > 0) reads it flushed
    ch = _chunks(w)
    c_len = ch.shape[2]
    scan = block_scan(_chunk_sums(ch))
    total = scan[:, -1]
    positive = w > 0
    last_pos = np.where(positive.any(axis=1), vocab - 1 - np.argmax(positive[:, ::-1], axis=1), -1)
    ok = (total > 0) & (last_pos >= 0)
    target = _mul(np.asarray(u, _F32), total)  # may be subnormal for a tiny total
    above = scan > target[:, None]
    first = np.argmax(above, axis=1)
    ar = np.arange(rows)
    run = np.where(first > 0, scan[ar, np.maximum(first - 1, 0)], _F32(0.0)).astype(_F32)
    chunk = ch[ar, first]
    pick = np.full(rows, -1, np.int64)
    last_c = np.full(rows, -1, np.int64)
    for c in range(c_len):
        idx = first.astype(np.int64) * c_len + c
        wc = chunk[:, c]
        run = run + wc
        last_c = np.where((idx < vocab) & (wc > 0), idx, last_c)
        pick = np.where((pick < 0) & (idx < vocab) & (run > target), idx, pick)
    walked = np.where(pick >= 0, pick, np.where(last_c >= 0, last_c, last_pos))
    return np.where(ok, np.where(above.any(axis=1), walked, last_pos), -1)


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


def _probs_rows(logits, temperature, top_k, top_p):
    """One [R, V] block of ``spec_probs_from_logits`` (per-row settings of length R)."""
    rows, vocab = logits.shape
    ar = np.arange(rows)
    key = order_key(logits)
    amax = np.argmax(key, axis=1)
    greedy = ~_gt(temperature, 0)  # NaN, 0 and a (flushed) subnormal temperature
    top_p = ftz(top_p)
    with np.errstate(all="ignore"):
        temp = np.where(greedy, _F32(1.0), temperature).astype(_F32)
        e = exp_neg(_div(_sub(logits, logits[ar, amax][:, None]), temp[:, None]))
        thr = np.zeros(rows, np.uint64)
        k_on = ~greedy & (top_k > 0) & (top_k < vocab)
        if k_on.any():
            srt = np.sort(key[k_on], axis=1)
            thr[k_on] = srt[np.arange(k_on.sum()), vocab - top_k[k_on]]
        p_on = ~greedy & (top_p < 1)
        if p_on.any():
            sel = np.nonzero(p_on)[0]
            k_sel = key[sel]
            mass = np.where(k_sel >= thr[sel, None], (e[sel] * _MASS_SCALE).astype(np.uint64), np.uint64(0))
            total = mass.sum(axis=1, dtype=np.uint64)
            need = np.ceil(top_p[sel].astype(np.float64) * total.astype(np.float64))
            need = np.maximum(need, 1.0).astype(np.uint64)
            order = np.argsort(k_sel, axis=1)[:, ::-1]
            cum = np.cumsum(np.take_along_axis(mass, order, axis=1), axis=1, dtype=np.uint64)
            j = np.argmax(cum >= need[:, None], axis=1)
            thr_p = np.take_along_axis(k_sel, order, axis=1)[np.arange(len(sel)), j]
            thr[sel] = np.maximum(thr[sel], thr_p)
        kept = key >= thr[:, None]
        e = np.where(kept, e, _F32(0.0))
        out = np.where(kept, _div(e, row_sum(e)[:, None]), _F32(0.0)).astype(_F32)
    out[greedy] = 0
    out[ar[greedy], amax[greedy]] = 1
    return out


def probs_from_logits(logits, temperature, top_k, top_p, probs, *, step=None, stream=None):
    """Temperature, top-k and top-p: float32 logits -> normalized float32 probabilities.

    Per row: temperature <= 0 (or NaN) gives a one-hot at the argmax (lowest index on
    ties, like ``argmax``). Otherwise top-k (0 or >= V: off) keeps the k tokens with the
    largest :func:`order_key`; top-p (>= 1 or NaN: off) then keeps the shortest run of
    those, in key order, whose integer mass ``floor(e * 2**32)`` reaches
    ``max(1, ceil(top_p * total mass))`` (float64), with ``e = exp_neg((l - max) / T)``;
    probs = kept e / :func:`row_sum` of kept e, 0 elsewhere. Top-k = 1 therefore equals
    greedy. Bit-exact with the kernel.

    Parameters
    ----------
    logits : [B, T, V] float32 (finite or -inf; at least one finite value per row)
    temperature : [B] float32
    top_k : [B] int32
    top_p : [B] float32
    probs : [B, T, V] float32, written (may be ``logits`` itself)
    step : int or None
        Only row ``step`` of every sequence; None: all T rows.
    """
    steps = range(logits.shape[1]) if step is None else [step]
    for t in steps:
        probs[:, t] = _probs_rows(np.asarray(logits[:, t], _F32), temperature, top_k, top_p)


def sample_draft(q, seed, pos, draft_tok, draft_prob, *, step=None, stream=None):
    """Draft proposals: row t of sequence b samples the token at position ``pos[b] + t + 1``.

    Uses draw ``DRAW_DRAFT``; ``pos`` is the position of ``vtok[b, 0]``.

    Parameters
    ----------
    q : [B, k, V] float32 draft probabilities
    seed : [B] uint64
    pos : [B] int32
    draft_tok : [B, k] int32, written (PLACEHOLDER_TOKEN for a row without mass)
    draft_prob : [B, k] float32, written: ``q[b, t, draft_tok[b, t]]`` (0 without a token)
    step : int or None
        Only draft row ``step``; None: all k rows.
    """
    batch = q.shape[0]
    ar = np.arange(batch)
    steps = range(q.shape[1]) if step is None else [step]
    for t in steps:
        u = uniform(seed, pos.astype(np.int64) + t + 1, DRAW_DRAFT)
        tok = sample_rows(np.asarray(q[:, t], _F32), u)
        draft_tok[:, t] = np.where(tok >= 0, tok, PLACEHOLDER_TOKEN)
        draft_prob[:, t] = np.where(tok >= 0, q[ar, t, np.maximum(tok, 0)], _F32(0.0))


def accept_sample(vtok, p, q, brk, seed, pos, n_acc, last_pred, *, stream=None):
    """Lossless speculative sampling, with the outputs of :func:`reference.accept_greedy`.

    For ``i < n_valid = clip(brk[b, 0], 0, k)`` in order, draft ``x = vtok[b, 1 + i]`` is
    accepted iff ``0 <= x < V`` and ``u * q[b, i, x] < p[b, i, x]`` (u: draw
    ``DRAW_ACCEPT`` at position ``pos[b] + i + 1``). ``n_acc[b]`` = accepted prefix n.
    ``last_pred[b]`` is the token for position ``pos[b] + n + 1`` (draw ``DRAW_RESAMPLE``):
    after a rejection from ``norm(max(0, p_n - q_n))`` (from ``p_n`` if that is all zero),
    otherwise (the break, or all k accepted) from ``p_n``; PLACEHOLDER_TOKEN if ``p_n``
    has no mass.

    Parameters
    ----------
    vtok : [B, K1] int32
    p : [B, K1, V] float32 target probabilities
    q : [B, k, V] float32 draft probabilities
    brk : [B, 2] int32
    seed : [B] uint64
    pos : [B] int32, position of ``vtok[b, 0]``
    n_acc, last_pred : [B] int32, written
    """
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
    u = uniform(seed, pos64 + n + 1, DRAW_RESAMPLE)
    p_row = np.asarray(p[ar, n], _F32)
    tok = np.full(batch, -1, np.int64)
    rej = n < n_valid
    if rej.any():
        d = _sub(p_row[rej], q[ar[rej], n[rej]])
        tok[rej] = sample_rows(np.where(d > 0, d, _F32(0.0)).astype(_F32), u[rej])
    retry = tok < 0
    tok[retry] = sample_rows(p_row[retry], u[retry])
    n_acc[:] = n
    last_pred[:] = np.where(tok >= 0, tok, PLACEHOLDER_TOKEN)

"""The decode layer's projections with the work around them folded in: fewer kernels per layer.

At B = 1 a decode layer on the GEMV path (``decode/gemv.py``) is ~14 kernels, each a few µs
of latency even overlapped by programmatic dependent launch: the two norms, SiLU x up and
four split-K sum passes stand between the projections. Here each projection's kernel does
that work in its prologue, on the tiles it loads anyway:

* **norm** (:func:`norm_linear`): the residual add and RMSNorm before qkv_proj, gate_up_proj
  and the head. Each program first sums the squares of its rows over all of K (the rows
  are a few KB at M <= 16, read from L2), then normalises each x tile as it loads it. The
  new residual (x + delta) goes to a fresh buffer, written by the programs of the first
  column tile and split only: the other programs still read the old x, so it cannot be
  updated in place.
* **SiLU** (:func:`silu_linear`): ``silu(gate) * up`` of the gate/up projection, computed
  per K tile in the down projection's prologue.
* **split-K sums**: a projection split along K leaves its fp32 partials (a
  :class:`~graphburst.models.decode.partial.Partial`); the consumer (the next norm, the
  SiLU prologue, :func:`rope_kv_write`) adds them in split order, adds the bias and rounds
  once, as the sum pass would.
* **the attention's combine** (:func:`linear` over an
  :class:`~graphburst.models.decode.partial.AttentionSplits`): at one row (``COMBINE_MAX_M``)
  o_proj weighs the split-KV attention's partial outputs as it loads them.

A layer is then qkv (norm folded), RoPE + KV write, attention (and, past one row, its
combine when split), o_proj, gate_up (norm folded), down (SiLU folded): 6-7 kernels.
Every rounding is the one the unfolded kernels make (``decode/fused.py``: the residual sum
to the activations' dtype, the normalised row, silu before the multiply), so the two paths
differ only in the order the norm's sum of squares and a combine's sums are taken.
:mod:`graphburst.models.decode.reference` holds the plain-torch references. Every kernel
follows ``decode/launch.py``'s PDL rule: before its wait it loads only weights, and every
store comes after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused import rope_place
from .gemv import DOT_BLOCK_M, FMA_MAX_M, SUM_BLOCK, GemvConfig, _accumulate, _split_k_sum, _tile, pick_config
from .launch import INTERPRETED, launch_options, pdl_on, pdl_wait
from .partial import WHOLE, AttentionSplits, Partial

#: what a folded GEMV's x tile is (its ``PROLOGUE`` constexpr): x itself, norm(x + delta), silu(gate) * up,
#: split-KV attention's partial outputs combined
PLAIN, NORM, SILU, COMBINE = 0, 1, 2, 3
#: ``D_SPLITS`` of a norm with no delta to add (the first layer's: x is the embedding)
NO_DELTA = -1
# The same values as the kernels see them (a jit function reads only constexpr globals).
_NORM, _SILU, _COMBINE = tl.constexpr(NORM), tl.constexpr(SILU), tl.constexpr(COMBINE)
_NO_DELTA = tl.constexpr(NO_DELTA)
#: rows (M = B * T) up to which the o projection combines the attention's splits itself. Each program reads
#: every split's partial output over its K range: at one row and 16 splits about the bytes of its weight
#: tile (from L2), at M rows M times that, where the combine kernel reads them once.
COMBINE_MAX_M = 1
#: rows up to which ``decode_kernels="folded"`` folds (``llama_decode.folded_ops``): the multiply-accumulate
#: path's. Past it the ``tl.dot`` path keeps a [16, BLOCK_K] prologue tile per program at a cut BLOCK_K, and
#: measured in the forward profile (bf16, B = 1, T = 5) its projections took 2.3x (SmolLM2-135M's shape) and
#: 3.3x (1b's) the time of the unfolded GEMV's, more than the launches folding saves.
FOLD_MAX_M = FMA_MAX_M
#: fp32 prologue values one thread may hold in the ``tl.dot`` path (M > 1): the norm keeps x and each of
#: the delta's partials as [BLOCK_M, BLOCK_K] tiles, SiLU the gate's and the up's, a combine its splits'.
#: Measured with ptxas for sm_90 (BLOCK_M 16, BLOCK_N 32, 4 warps, arguments aligned as the model's are):
#: SiLU over 2 partials spilled 1120 bytes a thread at BLOCK_K 256 (128 values) and none at 128 (64); over
#: 3 partials 72 bytes at 128 (96) and none at 64; a combine of 4 splits 256 bytes at 256 (160) and none at
#: 128; the norm over 8 partials 16 bytes at 256 (288) and none at 128.
#: (``tests/models/decode/test_decode_kernels_compile.py`` holds every launched variant to no spill.)
PROLOGUE_VALUES_PER_THREAD = 64


def prologue_block_k(prologue: int, d_splits: int, block_m: int, config: GemvConfig) -> int:
    """K per tile of a folded GEMV: the GEMV's own, halved (down to 16, ``tl.dot``'s least) while the
    prologue's live tiles pass :data:`PROLOGUE_VALUES_PER_THREAD` (``d_splits``: the Partial's splits, or
    ``WHOLE`` / ``NO_DELTA``). The multiply-accumulate path (one row) and the plain prologue keep it."""
    if prologue == PLAIN or block_m == 1:
        return config.block_k
    parts = max(1, d_splits)
    live = 2 * parts if prologue == SILU else parts + 1
    block_k = config.block_k
    while block_k > 16 and block_m * block_k * live > PROLOGUE_VALUES_PER_THREAD * 32 * config.num_warps:
        block_k //= 2
    return block_k


@triton.jit
def _partial(p_ptr, pb_ptr, rows, cols, ok, M, W, sp_m, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """fp32 values of a Partial of width ``W`` at (``rows``, ``cols``), broadcastable offsets: the whole
    output's (``SPLITS == 0``, row stride ``sp_m``), or its partials [SPLITS, M, W] summed in split order
    plus the bias, before the one rounding the caller makes. Zeros where not ``ok``."""
    if SPLITS == 0:
        v = tl.load(p_ptr + rows * sp_m + cols, mask=ok, other=0.0).to(tl.float32)
    else:
        v = tl.load(p_ptr + rows * W + cols, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLITS):
            v += tl.load(p_ptr + (s * M + rows) * W + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            v += tl.load(pb_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return v


@triton.jit
def _residual(x_ptr, d_ptr, db_ptr, rows, ks, ok, M, K, sx_m, sd_m, D_SPLITS: tl.constexpr, D_BIAS: tl.constexpr):
    """The residual stream's tile ``x + delta``, rounded to x's dtype as torch's add rounds it (the delta
    rounded first, as its sum pass would); x alone without a delta."""
    x = tl.load(x_ptr + rows * sx_m + ks, mask=ok, other=0.0)
    if D_SPLITS != _NO_DELTA:
        d = _partial(d_ptr, db_ptr, rows, ks, ok, M, K, sd_m, D_SPLITS, D_BIAS).to(x.dtype)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _combined(o_ptr, lse_ptr, len_ptr, rows, ks, m_ok, k_ok, K, T, s_rows, SPLITS: tl.constexpr,
              HD: tl.constexpr, A_BLOCK: tl.constexpr):
    """fp32 [rows, ks] of split-KV attention's output combined from its splits (``AttentionSplits``), as the
    attention's combine computes it: the splits that ran (from each sequence's length), each weighted by
    ``exp2(lse - max lse)``. Zeros where not ``ok``."""
    ok = m_ok[:, None] & k_ok[None, :]
    length = tl.maximum(tl.load(len_ptr + rows // T, mask=m_ok, other=0), 0)  # an idle slot's sentinel reads as 0
    tiles = tl.cdiv(tl.minimum(length + T, s_rows), A_BLOCK)
    active = tl.cdiv(tiles, tl.cdiv(tiles, SPLITS))  # [rows] splits that ran (the rest wrote nothing)
    base = (rows[:, None] * (K // HD) + (ks // HD)[None, :]) * SPLITS  # (row, head) -> its first split
    mx = tl.where(ok, float("-inf"), 0.0)
    for s in tl.static_range(SPLITS):
        mx = tl.maximum(mx, tl.load(lse_ptr + base + s, mask=ok & (s < active)[:, None], other=float("-inf")))
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # split 0 always ran; this only keeps masked lanes finite
    num = tl.zeros_like(mx)
    den = tl.zeros_like(mx)
    for s in tl.static_range(SPLITS):
        ran = ok & (s < active)[:, None]
        w = tl.exp2(tl.load(lse_ptr + base + s, mask=ran, other=float("-inf")) - mx)
        num += w * tl.load(o_ptr + (base + s) * HD + (ks % HD)[None, :], mask=ran, other=0.0)
        den += w
    return tl.where(ok, num / tl.where(den > 0, den, 1.0), 0.0)


@triton.jit
def _x_tile(x_ptr, d_ptr, db_ptr, nw_ptr, w_ptr, lse_ptr, len_ptr, rows, ks, m_ok, k_ok, rstd, M, K, sx_m, sd_m,
            T_att, s_rows, PROLOGUE: tl.constexpr, D_SPLITS: tl.constexpr, D_BIAS: tl.constexpr, HD: tl.constexpr,
            A_BLOCK: tl.constexpr):
    """The ``[BLOCK_M, BLOCK_K]`` x tile at K offsets ``ks`` in W's dtype, zeros past M and K."""
    ok = m_ok[:, None] & k_ok[None, :]
    r2, k2 = rows[:, None], ks[None, :]
    if PROLOGUE == _NORM:  # (x + delta) * rstd * norm weight, rounded once
        h = _residual(x_ptr, d_ptr, db_ptr, r2, k2, ok, M, K, sx_m, sd_m, D_SPLITS, D_BIAS).to(tl.float32)
        nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        x = (h * rstd[:, None] * nw[None, :]).to(w_ptr.dtype.element_ty)
    elif PROLOGUE == _SILU:  # the Partial is [gate | up], 2K wide
        g = _partial(d_ptr, db_ptr, r2, k2, ok, M, 2 * K, sd_m, D_SPLITS, D_BIAS).to(w_ptr.dtype.element_ty)
        u = _partial(d_ptr, db_ptr, r2, K + k2, ok, M, 2 * K, sd_m, D_SPLITS, D_BIAS).to(w_ptr.dtype.element_ty)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(w_ptr.dtype.element_ty)  # F.silu rounds before the multiply
        x = (act.to(tl.float32) * u.to(tl.float32)).to(w_ptr.dtype.element_ty)
    elif PROLOGUE == _COMBINE:  # d_ptr holds the splits' outputs, D_SPLITS of them
        x = _combined(d_ptr, lse_ptr, len_ptr, rows, ks, m_ok, k_ok, K, T_att, s_rows, D_SPLITS, HD,
                      A_BLOCK).to(w_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + r2 * sx_m + k2, mask=ok, other=0.0)
    return x


@triton.jit
def _folded_gemv(x_ptr, d_ptr, db_ptr, nw_ptr, res_ptr, w_ptr, b_ptr, y_ptr, part_ptr, lse_ptr, len_ptr,
                 M, N, K, sx_m, sd_m, sw_n, sy_m, k_per_split, eps, T_att, s_rows,
                 PROLOGUE: tl.constexpr, D_SPLITS: tl.constexpr, D_BIAS: tl.constexpr, HD: tl.constexpr,
                 A_BLOCK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr, DOT_F32: tl.constexpr,
                 PREC: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n[:, None] * sw_n  # [BLOCK_N, 1]
    k_lo = split * k_per_split  # whole tiles per split, as the GEMV's
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w = _tile(w_rows, k_lo + offs_k, n_ok, k_hi, EVEN_K)  # a weight: loaded before the PDL wait
    pdl_wait(PDL)  # x, the delta, the gate/up partials are earlier kernels' outputs; every store comes after
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if PROLOGUE == _NORM:
        # The norm needs the whole row: every program sums its rows' squares over all of K. The first column
        # tile's first split also writes the new residual, once per row.
        ss = tl.zeros([BLOCK_M], tl.float32)
        # the rows this program writes the residual of: all its rows in the first column tile's first split
        # (a vector compare: the interpreter cannot AND a bool block with a scalar one)
        res_ok = m_ok & ((offs_m * 0 + pid_n + split) == 0)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            ok = m_ok[:, None] & (ks < K)[None, :]
            h = _residual(x_ptr, d_ptr, db_ptr, offs_m[:, None], ks[None, :], ok, M, K, sx_m, sd_m, D_SPLITS,
                          D_BIAS)
            if D_SPLITS != _NO_DELTA:
                tl.store(res_ptr + offs_m[:, None] * K + ks[None, :], h, mask=res_ok[:, None] & (ks < K)[None, :])
            hf = h.to(tl.float32)
            ss += tl.sum(hf * hf, 1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # M = 1: products summed over K once, after the loop
    ks = k_lo + offs_k
    x = _x_tile(x_ptr, d_ptr, db_ptr, nw_ptr, w_ptr, lse_ptr, len_ptr, offs_m, ks, m_ok, ks < k_hi, rstd, M, K,
                sx_m, sd_m, T_att, s_rows, PROLOGUE, D_SPLITS, D_BIAS, HD, A_BLOCK)
    acc = _accumulate(acc, x, w, DOT, DOT_F32, PREC)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        ks = k0 + offs_k
        x = _x_tile(x_ptr, d_ptr, db_ptr, nw_ptr, w_ptr, lse_ptr, len_ptr, offs_m, ks, m_ok, ks < k_hi, rstd, M,
                    K, sx_m, sd_m, T_att, s_rows, PROLOGUE, D_SPLITS, D_BIAS, HD, A_BLOCK)
        acc = _accumulate(acc, x, _tile(w_rows, ks, n_ok, k_hi, EVEN_K), DOT, DOT_F32, PREC)
    if not DOT:
        acc = tl.sum(acc, 1)[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * sy_m + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + (split * M + offs_m)[:, None] * N + offs_n[None, :], acc, mask=ok)


def _check_partial(p: Partial, m: int, width: int, dtype: torch.dtype) -> None:
    assert p.shape == (m, width) and p.dtype == dtype, "shapes checked by the model"
    assert p.parts.stride(-1) == 1 and (p.splits == WHOLE or p.parts.is_contiguous())


def _launch(prologue: int, m: int, k: int, weight: torch.Tensor, bias, *, x=None, delta: Partial | None = None,
            att: AttentionSplits | None = None, norm_weight=None, eps: float = 0.0, config: GemvConfig | None = None,
            fma: bool | None = None, pdl: bool = False) -> tuple[Partial, torch.Tensor | None]:
    """One folded GEMV over ``weight`` [N, K]: (its output as a Partial, the new residual or None)."""
    n = weight.shape[0]
    dtype = weight.dtype
    assert weight.shape[1] == k and weight.stride(1) == 1, "shapes checked by the model"
    cfg = config or pick_config(n, k, weight.device, dtype)
    fma = m <= FMA_MAX_M if fma is None else fma
    assert not fma or m == 1, "the multiply-accumulate path keeps one x row"
    block_m = 1 if fma else DOT_BLOCK_M
    tiles = triton.cdiv(k, cfg.block_k)
    split_k = max(1, min(cfg.split_k, tiles))
    k_per_split = triton.cdiv(tiles, split_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)  # no split past K
    d_splits = att.splits if att is not None else NO_DELTA if delta is None else delta.splits
    block_k = prologue_block_k(prologue, d_splits, block_m, cfg)  # divides k_per_split: both powers of two
    out = torch.empty((m, n), dtype=dtype, device=weight.device) if split_k == 1 else None
    part = torch.empty((split_k, m, n), dtype=torch.float32, device=weight.device) if split_k > 1 else out
    res = None
    if prologue == NORM and delta is not None:
        res = torch.empty((m, k), dtype=dtype, device=weight.device)
    d = delta.parts if delta is not None else att.o if att is not None else weight
    sd_m = d.stride(0) if delta is not None and delta.splits == WHOLE else 0
    # the attention's splits: their log2-sum-exps, the lengths that say which ran, T, the cache's rows, head_dim
    lse, lengths = (att.lse, att.length) if att is not None else (weight, weight)
    t_att, s_rows, hd, a_block = (att.o.shape[1], att.rows, att.o.shape[4], att.block) if att is not None else \
        (1, 1, 1, 1)
    xt = weight if x is None else x
    sx_m = 0 if x is None else x.stride(0)
    has_bias = bias is not None
    pdl = pdl_on(pdl)
    grid = (triton.cdiv(n, cfg.block_n), split_k, triton.cdiv(m, block_m))
    _folded_gemv[grid](xt, d, delta.bias if delta is not None and delta.bias is not None else weight,
                       weight if norm_weight is None else norm_weight, weight if res is None else res, weight,
                       bias if has_bias else weight, part if out is None else out, part, lse, lengths, m, n, k,
                       sx_m, sd_m, weight.stride(0), n, k_per_split, eps, t_att, s_rows, PROLOGUE=prologue,
                       D_SPLITS=d_splits, D_BIAS=delta is not None and delta.bias is not None, HD=hd, A_BLOCK=a_block,
                       BLOCK_M=block_m, BLOCK_N=cfg.block_n,
                       BLOCK_K=block_k, SPLIT_K=split_k, EVEN_K=k % block_k == 0, HAS_BIAS=has_bias,
                       DOT=not fma, DOT_F32=INTERPRETED and dtype != torch.float32,
                       PREC="ieee" if dtype == torch.float32 else "tf32", PDL=pdl, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, **launch_options(pdl))
    y = Partial.whole(out) if split_k == 1 else Partial(part, split_k, bias, dtype)
    return y, res


def linear(x: torch.Tensor | AttentionSplits, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: GemvConfig | None = None, fma: bool | None = None, pdl: bool = False) -> Partial:
    """``x @ weight.T + bias`` with no sum pass: a split-K projection leaves its partials to its consumer.

    Parameters
    ----------
    x : [M, K] float32 or bfloat16, last dim contiguous, M <= ``gemv.MAX_M`` (one row tile); or the
        AttentionSplits of an attention of M = B * T rows and K = H * D, combined tile by tile here
        (the o projection, in place of the attention's combine launch)
    weight : [N, K] x's dtype, last dim contiguous; bias : [N] x's dtype, optional
    config, fma : the GEMV's tiling and multiply-accumulate path (``gemv.gemv``'s)
    pdl : bool
        Programmatic dependent launch (``decode/launch.py``; off under the interpreter).

    Returns
    -------
    Partial of [M, N]

    grid ``(cdiv(N, block_n), split_k, cdiv(M, BLOCK_M))``, as the GEMV's; no second launch.
    """
    m, k = x.shape
    if isinstance(x, AttentionSplits):
        assert x.dtype == weight.dtype and x.o.is_contiguous() and x.lse.is_contiguous(), "shapes checked by the model"
        return _launch(COMBINE, m, k, weight, bias, att=x, config=config, fma=fma, pdl=pdl)[0]
    assert x.stride(1) == 1 and x.dtype == weight.dtype, "shapes checked by the model"
    return _launch(PLAIN, m, k, weight, bias, x=x, config=config, fma=fma, pdl=pdl)[0]


def norm_linear(x: torch.Tensor, delta: Partial | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None = None, config: GemvConfig | None = None, fma: bool | None = None,
                pdl: bool = False) -> tuple[Partial, torch.Tensor]:
    """``h = x + delta`` (rounded to x's dtype), then ``rmsnorm(h) * norm_weight @ weight.T + bias``, one kernel.

    Parameters
    ----------
    x : [M, K] float32 or bfloat16, contiguous: the residual stream (not written)
    delta : Partial of [M, K] in x's dtype (the last sublayer's output), or None (h = x)
    norm_weight : [K] x's dtype; eps : float
    weight : [N, K] x's dtype, last dim contiguous; bias : [N], optional
    config, fma, pdl : as :func:`linear`'s

    Returns
    -------
    (Partial of [M, N], h) where h is a new [M, K] residual, or x itself without a delta

    grid as :func:`linear`'s.
    """
    m, k = x.shape
    assert x.is_contiguous() and x.dtype == weight.dtype and norm_weight.shape == (k,), "shapes checked by the model"
    if delta is not None:
        _check_partial(delta, m, k, x.dtype)
    y, res = _launch(NORM, m, k, weight, bias, x=x, delta=delta, norm_weight=norm_weight, eps=eps, config=config,
                     fma=fma, pdl=pdl)
    return y, x if res is None else res


def silu_linear(gate_up: Partial, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemvConfig | None = None, fma: bool | None = None, pdl: bool = False) -> Partial:
    """``(silu(gate) * up) @ weight.T + bias`` where ``gate_up = [gate | up]``, one kernel.

    Parameters
    ----------
    gate_up : Partial of [M, 2K] in weight's dtype (the gate/up projection's output)
    weight : [N, K], last dim contiguous; bias : [N], optional
    config, fma, pdl : as :func:`linear`'s

    Returns
    -------
    Partial of [M, N]

    grid as :func:`linear`'s.
    """
    m, k2 = gate_up.shape
    k = k2 // 2
    _check_partial(gate_up, m, 2 * k, weight.dtype)
    return _launch(SILU, m, k, weight, bias, delta=gate_up, config=config, fma=fma, pdl=pdl)[0]


def materialize(p: Partial, pdl: bool = False) -> torch.Tensor:
    """The output a Partial stands for, [M, N] ``p.dtype``: the partials summed in split order, the bias
    added, rounded once (the GEMV's own sum pass, grid ``(M, cdiv(N, SUM_BLOCK))``); a whole one as it is."""
    if p.splits == WHOLE:
        return p.parts
    _, m, n = p.parts.shape
    out = torch.empty((m, n), dtype=p.dtype, device=p.parts.device)
    pdl = pdl_on(pdl)
    _split_k_sum[(m, triton.cdiv(n, SUM_BLOCK))](p.parts, p.parts if p.bias is None else p.bias, out, m, n,
                                                  out.stride(0), SPLIT_K=p.splits, HAS_BIAS=p.bias is not None,
                                                  BLOCK=SUM_BLOCK, PDL=pdl, num_warps=4, **launch_options(pdl))
    return out


@triton.jit
def _rope_kv_write(p_ptr, pb_ptr, q_ptr, cos_ptr, sin_ptr, pos_ptr, len_ptr, kv_ptr,
                   skv_2, skv_b, skv_s, skv_h, s_rows, n_pos, T, R, sp_m,
                   SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr,
                   D: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)  # b * T + t; int64: b * skv_b passes 2^31 elements in large caches
    b = tok // T
    t = tok % T
    pdl_wait(PDL)  # positions, lengths and qkv come from earlier kernels; the KV rows may still be read
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + b).to(tl.int32) + t, 0), n_pos - 1)
    row = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0) + t, s_rows - 1)  # a corrupt length still writes in bounds
    HALF: tl.constexpr = D // 2
    NH: tl.constexpr = H + 2 * KVH
    hd = tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF)
    h_ok = (hd < NH)[:, None] & (j < HALF)[None, :]
    cols = hd[:, None] * D + j[None, :]
    x1 = _partial(p_ptr, pb_ptr, tok, cols, h_ok, R, NH * D, sp_m, SPLITS, HAS_BIAS).to(q_ptr.dtype.element_ty)
    x2 = _partial(p_ptr, pb_ptr, tok, cols + HALF, h_ok, R, NH * D, sp_m, SPLITS, HAS_BIAS).to(q_ptr.dtype.element_ty)
    q_dst = q_ptr + tok * (H * D) + hd[:, None] * D + j[None, :]  # q to its own buffer: the Partial may be partials
    rope_place(x1, x2, q_dst, kv_ptr, cos_ptr, sin_ptr, pos, row, b, hd, j, h_ok, skv_2, skv_b, skv_s, skv_h, H, KVH,
               D)


def rope_kv_write(qkv: Partial, cos: torch.Tensor, sin: torch.Tensor, start_pos: torch.Tensor, length: torch.Tensor,
                  kv: torch.Tensor, n_heads: int, tokens: int, pdl: bool = False) -> torch.Tensor:
    """RoPE of q and k from the qkv projection's Partial; k and v into the cache at row ``length[b] + t``.

    Parameters
    ----------
    qkv : Partial of [B * T, (H + 2 KVH) * D] (the qkv projection's output, rows b-major)
    cos, sin : [P, D] float32 tables (both halves hold the same frequencies)
    start_pos : [B] int32 or int64, position of token 0 (clamped into the table)
    length : [B] int32, valid KV rows before the call (the write row is clamped to S - 1)
    kv : [2, Bc, S, KVH, D] qkv's dtype, contiguous, Bc >= B
    n_heads : int
        H, the query heads.
    tokens : int
        T, the tokens per sequence.
    pdl : bool
        Programmatic dependent launch (``decode/launch.py``; off under the interpreter).

    Returns
    -------
    q : [B, T, H, D] qkv's dtype, rotated (a new buffer: the Partial may be partial sums)

    grid ``(B * T,)``: one program rotates and places every head of one token.
    """
    r, width = qkv.shape
    kvh, d = kv.shape[3], kv.shape[4]
    nh = n_heads + 2 * kvh
    assert width == nh * d and r % tokens == 0 and kv.is_contiguous() and kv.dtype == qkv.dtype
    _check_partial(qkv, r, width, qkv.dtype)
    q = torch.empty((r // tokens, tokens, n_heads, d), dtype=qkv.dtype, device=kv.device)
    sp_m = qkv.parts.stride(0) if qkv.splits == WHOLE else 0
    pdl = pdl_on(pdl)
    _rope_kv_write[(r,)](qkv.parts, qkv.parts if qkv.bias is None else qkv.bias, q, cos, sin, start_pos, length, kv,
                         kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), kv.shape[2], cos.shape[0], tokens, r,
                         sp_m, SPLITS=qkv.splits, HAS_BIAS=qkv.bias is not None, H=n_heads, KVH=kvh, D=d,
                         BLOCK_H=triton.next_power_of_2(nh), PDL=pdl, num_warps=4, **launch_options(pdl))
    return q

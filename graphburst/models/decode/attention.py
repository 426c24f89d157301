"""Decode / verify attention against a static KV cache that reads only each sequence's valid rows.

Flash-decoding in Triton: one program per (sequence, KV head, split) loads K/V tiles once
for the whole query group (GQA: the group's G heads times the chunk's T tokens are the
rows of one ``tl.dot``), keeps an online softmax in fp32 and, when the rows are split
over several programs, writes a partial output and its log-sum-exp that
:func:`_combine` merges. The grid is fixed (sized from the batch, the KV heads and the
cache's rows), so it can be captured in a CUDA graph; *what* each program reads comes
from the lengths on the device: a sequence's ``length + T`` valid rows are cut into
``splits`` equal chunks of whole tiles, so the work follows the valid rows and not the
allocated capacity, and the programs past a sequence's rows exit at once.

Token t of sequence b (query position ``length[b] + t``, its own K/V already written
at that row) attends to rows ``<= length[b] + t``; rows ``>= length[b] + T`` are never
read. A negative length (an idle slot's sentinel) reads as 0. Offsets are int64: a
batch index times the cache's batch stride passes 2^31 elements in large caches. :func:`graphburst.models.decode.reference.decode_attention_ref` is the plain-torch
reference. ``pdl=True`` launches both kernels with programmatic dependent launch
(``decode/launch.py``): every program waits first, since all it reads (lengths, q, KV,
the partials) was written by earlier kernels.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .launch import INTERPRETED, launch_options, pdl_on, pdl_wait
from .partial import AttentionSplits

#: KV rows per tile (one ``tl.dot``'s N).
BLOCK_N = 64
#: programs the split heuristic aims for per SM (two waves' worth keeps every SM busy).
PROGRAMS_PER_SM = 2
#: the most splits of one (sequence, KV head); a power of two (the combine loads them as one vector).
MAX_SPLITS = 64
# Under the interpreter (``launch.INTERPRETED``) the bf16 ``tl.dot`` operands are widened to fp32 first
# (after rounding p to bf16, as the GPU path does), which computes the same products.
#: the most query rows (tokens x group heads) per program; more take a third grid axis.
MAX_BLOCK_M = 64
#: finite stand-in for -inf as the running max: exp2(-inf - (-inf)) would be NaN on a fully masked row.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _split_attention(q_ptr, kv_ptr, len_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
                     sq_b, sq_t, sq_h, skv_2, skv_b, skv_s, skv_h, so_b, so_t, so_h,
                     scale_log2, s_rows, T,
                     G: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PREC: tl.constexpr,
                     DOT_F32: tl.constexpr, PDL: tl.constexpr):
    # int64 from the start: b * skv_b passes 2^31 elements in large caches (B 64 x 16384 rows x 8 x 128 is 2^30 per K)
    pid = tl.program_id(0).to(tl.int64)  # b * KVH + kv head
    split = tl.program_id(1)
    m_block = tl.program_id(2)  # query rows beyond one tile (T * G > BLOCK_M: long verify chunks, wide groups)
    b = pid // KVH
    kvh = pid % KVH
    pdl_wait(PDL)  # before the early exit below: the lengths, q and this call's KV rows come from earlier kernels
    # An idle slot's length may be a sentinel (negative): it reads as 0, as rope_kv_write's
    # row does, so every query row still sees its own row and the combine stays finite.
    length = tl.maximum(tl.load(len_ptr + b), 0)
    n_valid = tl.minimum(length + T, s_rows)  # rows written, this call's included
    per = tl.cdiv(tl.cdiv(n_valid, BLOCK_N), SPLITS) * BLOCK_N  # rows per split, whole tiles
    start = split * per
    if start >= n_valid:  # a split past this sequence's rows: nothing to read, nothing to write
        return
    end = tl.minimum(start + per, n_valid)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows ordered (t, g)
    t_m = offs_m // G
    head = kvh * G + offs_m % G
    m_ok = offs_m < T * G
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + t_m[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :],
                mask=m_ok[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    last = length + t_m  # [BLOCK_M] the last row each query row sees (causal within the chunk)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_base = kv_ptr + b * skv_b + kvh * skv_h
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)  # row * skv_s passes 2^31 at a million rows
        n_ok = offs_n < end
        # Rows past the valid ones are never loaded: a poisoned tail cannot reach the sum.
        k = tl.load(k_base + offs_n[:, None] * skv_s + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2  # [BLOCK_M, BLOCK_N], log2 units
        s = tl.where((offs_n[None, :] <= last[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(k_base + skv_2 + offs_n[:, None] * skv_s + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if DOT_F32:
            p = p.to(tl.bfloat16)  # the rounding the GPU's bf16 dot applies to p
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    seen = l_i > 0  # a query row can see nothing in a later split (its own rows come after)
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SPLITS == 1:
        dst = out_ptr + b * so_b + t_m[:, None] * so_t + head[:, None] * so_h + offs_d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
    else:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        row = ((b * T + t_m) * (KVH * G) + head) * SPLITS + split  # mid [B, T, H, SPLITS]
        tl.store(mid_lse_ptr + row, lse, mask=m_ok)
        tl.store(mid_o_ptr + row[:, None] * D + offs_d[None, :], o, mask=m_ok[:, None])


@triton.jit
def _combine(mid_o_ptr, mid_lse_ptr, len_ptr, out_ptr, so_b, so_t, so_h, s_rows, T, H,
             D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # (b * T + t) * H + head; int64: pid * SPLITS * D and b * so_b grow large
    b = pid // (T * H)
    t = (pid // H) % T
    head = pid % H
    pdl_wait(PDL)  # the partials are the attention's output
    length = tl.maximum(tl.load(len_ptr + b), 0)  # an idle slot's sentinel reads as 0, as in the attention
    n_valid = tl.minimum(length + T, s_rows)
    per_tiles = tl.cdiv(tl.cdiv(n_valid, BLOCK_N), SPLITS)
    active = tl.cdiv(tl.cdiv(n_valid, BLOCK_N), per_tiles)  # splits that ran (the rest wrote nothing)
    offs_s = tl.arange(0, SPLITS)
    s_ok = offs_s < active
    lse = tl.load(mid_lse_ptr + pid * SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 always holds row 0, so the max is finite
    offs_d = tl.arange(0, D)
    o = tl.load(mid_o_ptr + (pid * SPLITS + offs_s)[:, None] * D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    y = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * so_b + t * so_t + head * so_h + offs_d, y.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_splits(batch: int, kv_heads: int, rows: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU, no more than the rows' tiles.

    A power of two; depends only on shapes and the device, so a captured grid stays valid.
    """
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4  # the interpreter: any small count
    want = -(-PROGRAMS_PER_SM * sms // (batch * kv_heads))
    cap = 1 << max(0, (-(-rows // BLOCK_N)).bit_length() - 1)  # largest power of two <= the tiles
    return max(1, min(MAX_SPLITS, cap, 1 << max(0, (want - 1).bit_length())))


def decode_attention(q: torch.Tensor, kv: torch.Tensor, length: torch.Tensor, out: torch.Tensor | None = None,
                     splits: int | None = None, pdl: bool = False, combine: bool = True):
    """Attention of T new tokens per sequence over its valid KV rows (split-KV, GQA-aware).

    Parameters
    ----------
    q : [B, T, H, D] float32 or bfloat16, last dim contiguous (a view of the qkv GEMM's output is fine)
    kv : [2, Bc, S, KVH, D] q's dtype, contiguous, Bc >= B; rows ``length[b] + [0, T)`` already hold
        the new tokens' K and V
    length : [B] int32, valid rows before the new tokens; a negative one (an idle slot) reads as 0
    out : [B, T, H, D] q's dtype, optional (last dim contiguous); allocated when absent
    splits : int, optional
        Programs per (sequence, KV head), a power of two <= ``MAX_SPLITS``; default
        :func:`default_splits`. 1 writes ``out`` directly, with no combine launch.
    pdl : bool
        Programmatic dependent launch of both kernels (``decode/launch.py``; off under the interpreter).
    combine : bool
        False: with more than one split, launch no combine and return the splits' partial outputs as an
        :class:`~graphburst.models.decode.partial.AttentionSplits` for a consumer that combines them itself.

    Returns
    -------
    out : [B, T, H, D], or AttentionSplits (``combine=False``, splits > 1)

    grid ``(B * KVH, splits, cdiv(T * G, BLOCK_M))`` for the attention, ``(B * T * H,)`` for the combine; 4 warps each.
    """
    b, t, h, d = q.shape
    kvh, s_rows = kv.shape[3], kv.shape[2]
    g = h // kvh
    assert h == kvh * g and kv.shape[4] == d and q.stride(3) == 1 and kv.is_contiguous(), "shapes checked by the model"
    if out is None:
        out = torch.empty((b, t, h, d), dtype=q.dtype, device=q.device)
    if splits is None:
        splits = default_splits(b, kvh, s_rows, q.device)
    assert splits & (splits - 1) == 0 and 1 <= splits <= MAX_SPLITS
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(t * g)))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32: no TF32 rounding of q.k
    scale_log2 = (1.0 / math.sqrt(d)) * math.log2(math.e)
    if splits == 1:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty((b, t, h, splits, d), dtype=torch.float32, device=q.device)  # partial outputs
        mid_lse = torch.empty((b, t, h, splits), dtype=torch.float32, device=q.device)  # their log2-sum-exp
    pdl = pdl_on(pdl)
    grid = (b * kvh, splits, triton.cdiv(t * g, block_m))
    _split_attention[grid](q, kv, length, out, mid_o, mid_lse,
                           q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), kv.stride(2),
                           kv.stride(3), out.stride(0), out.stride(1), out.stride(2), scale_log2, s_rows, t,
                           G=g, KVH=kvh, D=d, BLOCK_M=block_m, BLOCK_N=BLOCK_N, SPLITS=splits, PREC=prec,
                           DOT_F32=INTERPRETED and q.dtype != torch.float32, PDL=pdl, num_warps=4,
                           **launch_options(pdl))
    if splits > 1 and not combine:
        return AttentionSplits(mid_o, mid_lse, length, s_rows, BLOCK_N, q.dtype)
    if splits > 1:
        grid = (b * t * h,)
        _combine[grid](mid_o, mid_lse, length, out, out.stride(0), out.stride(1), out.stride(2), s_rows, t, h,
                       D=d, BLOCK_N=BLOCK_N, SPLITS=splits, PDL=pdl, num_warps=4, **launch_options(pdl))
    return out

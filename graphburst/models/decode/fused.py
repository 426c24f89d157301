"""The non-GEMM work of a decode layer in three Triton kernels.

A Llama layer outside its GEMMs was 17-18 kernels (norms, RoPE's multiply and sum, the
mask, the KV ``index_copy_``, residual adds, SiLU, the multiply). At batch 1 each is a
few microseconds of launch-bound work, so they are fused:

* :func:`add_rmsnorm`: the residual add and the next RMSNorm (and the final norm);
* :func:`rope_kv_write`: RoPE of q and k and the K/V write into the static cache at row
  ``length[b] + t``, positions and lengths read on the device;
* :func:`silu_mul`: ``silu(gate) * up`` of the fused gate/up GEMM's output.

Math is fp32 inside; each output is rounded once to the activations' dtype (the
residual sum too, as torch's add rounds it). Row offsets are int64 (a row index times a
stride can pass 2^31 elements). ``decode_reference.py`` holds the plain-torch
references the tests hold these to. ``pdl=True`` launches with programmatic dependent
launch (``decode/launch.py``: each kernel waits before it reads what an earlier one wrote);
the norm weight is the only load allowed ahead of the wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_options, pdl_on, pdl_wait


@triton.jit
def _add_rmsnorm(x_ptr, r_ptr, w_ptr, out_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
                 PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row * N may pass 2^31 elements
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)  # a weight (no kernel writes it): may precede the wait
    pdl_wait(PDL)  # x and the residual are the previous kernels' outputs; x is written in place
    x = tl.load(x_ptr + row * N + offs, mask=ok, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * N + offs, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(x_ptr + row * N + offs, x, mask=ok)  # the residual stream, in place
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    tl.store(out_ptr + row * N + offs, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """``x += residual`` (in place, rounded to x's dtype), then ``rmsnorm(x) * weight``.

    Parameters
    ----------
    x : [R, N] float32 or bfloat16, contiguous; updated in place when ``residual`` is given
    residual : [R, N] x's dtype, contiguous, or None (norm only)
    weight : [N] x's dtype
    eps : float
    out : [R, N] x's dtype, optional
    pdl : bool
        Programmatic dependent launch (``decode/launch.py``; off under the interpreter).

    Returns
    -------
    out : [R, N]

    grid ``(R,)``, one row per program, the whole row in one block.
    """
    r, n = x.shape
    assert x.is_contiguous() and (residual is None or residual.is_contiguous()), "the decode path passes rows"
    if out is None:
        out = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    pdl = pdl_on(pdl)
    grid = (r,)
    _add_rmsnorm[grid](x, x if residual is None else residual, weight, out, eps, N=n, BLOCK=block,
                       HAS_RES=residual is not None, PDL=pdl, num_warps=8 if block >= 4096 else 4,
                       **launch_options(pdl))
    return out


@triton.jit
def _rope_kv_write(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, len_ptr, kv_ptr,
                   skv_2, skv_b, skv_s, skv_h, s_rows, n_pos, T,
                   H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)  # b * T + t; int64: b * skv_b passes 2^31 elements in large caches
    b = tok // T
    t = tok % T
    # Positions and lengths may be written by a kernel earlier in the stream (the burst's counters), qkv by
    # the GEMM; and the stores (q in place, the KV rows) must not land while an earlier kernel still runs.
    pdl_wait(PDL)
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + b).to(tl.int32) + t, 0), n_pos - 1)
    row = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0) + t, s_rows - 1)  # a corrupt length still writes in bounds
    HALF: tl.constexpr = D // 2
    NH: tl.constexpr = H + 2 * KVH
    hd = tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF)
    h_ok = (hd < NH)[:, None]
    src = qkv_ptr + tok * (NH * D) + hd[:, None] * D + j[None, :]
    x1 = tl.load(src, mask=h_ok, other=0.0)
    x2 = tl.load(src + HALF, mask=h_ok, other=0.0)
    # rotated q in place: attention reads it from the qkv buffer
    rope_place(x1, x2, src, kv_ptr, cos_ptr, sin_ptr, pos, row, b, hd, j, h_ok, skv_2, skv_b, skv_s, skv_h, H, KVH, D)


@triton.jit
def rope_place(x1, x2, q_dst, kv_ptr, cos_ptr, sin_ptr, pos, row, b, hd, j, h_ok, skv_2, skv_b, skv_s, skv_h,
               H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr):
    """One token's RoPE and placement: ``x1``, ``x2`` the two halves [BLOCK_H, D / 2] of its q, k and v heads
    (``hd`` the head index, ``j`` the offset in a half); q and k heads are rotated at position ``pos``, q is
    stored at ``q_dst`` (same layout as the halves), k and v at cache row ``row`` of sequence ``b``."""
    HALF: tl.constexpr = D // 2
    # HF casts cos/sin to the activations' dtype before rotating.
    c = tl.load(cos_ptr + pos * D + j).to(x1.dtype).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * D + j).to(x1.dtype).to(tl.float32)[None, :]
    a, bb = x1.to(tl.float32), x2.to(tl.float32)
    rot = (hd < H + KVH)[:, None]  # q and k heads rotate; v heads pass through
    o1 = tl.where(rot, a * c - bb * s, a).to(x1.dtype)
    o2 = tl.where(rot, bb * c + a * s, bb).to(x1.dtype)
    is_q = (hd < H)[:, None]
    tl.store(q_dst, o1, mask=is_q)
    tl.store(q_dst + HALF, o2, mask=is_q)
    is_v = hd >= H + KVH
    kvh = tl.where(is_v, hd - H - KVH, hd - H)
    dst = kv_ptr + tl.where(is_v, skv_2, 0) + b * skv_b + row * skv_s + kvh * skv_h
    kv_ok = h_ok & ~is_q
    tl.store(dst[:, None] + j[None, :], o1, mask=kv_ok)
    tl.store(dst[:, None] + HALF + j[None, :], o2, mask=kv_ok)


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: torch.Tensor,
                  length: torch.Tensor, kv: torch.Tensor, n_heads: int, pdl: bool = False) -> None:
    """Rotate q (in place) and k, write k and v into the cache at row ``length[b] + t``.

    Parameters
    ----------
    qkv : [B, T, H + 2 KVH, D] float32 or bfloat16, contiguous (the qkv GEMM's output);
        q heads are rotated in place, k and v heads are left as they were
    cos, sin : [P, D] float32 tables (both halves hold the same frequencies)
    start_pos : [B] int32 or int64, position of token 0 (clamped into the table)
    length : [B] int32, valid KV rows before the call (the write row is clamped to S - 1)
    kv : [2, Bc, S, KVH, D] qkv's dtype, contiguous, Bc >= B
    n_heads : int
        H, the query heads.
    pdl : bool
        Programmatic dependent launch (``decode/launch.py``; off under the interpreter).

    grid ``(B * T,)``: one program rotates and places every head of one token.
    """
    b, t, nh, d = qkv.shape
    kvh = kv.shape[3]
    assert qkv.is_contiguous() and kv.is_contiguous() and nh == n_heads + 2 * kvh and kv.shape[4] == d
    pdl = pdl_on(pdl)
    grid = (b * t,)
    _rope_kv_write[grid](qkv, cos, sin, start_pos, length, kv, kv.stride(0), kv.stride(1), kv.stride(2),
                         kv.stride(3), kv.shape[2], cos.shape[0], t, H=n_heads, KVH=kvh, D=d,
                         BLOCK_H=triton.next_power_of_2(nh), PDL=pdl, num_warps=4, **launch_options(pdl))


@triton.jit
def _silu_mul(gu_ptr, out_ptr, F: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row * 2F may pass 2^31 elements
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < F
    pdl_wait(PDL)  # gate_up is the GEMM's output
    gate = tl.load(gu_ptr + row * 2 * F + offs, mask=ok, other=0.0)
    up = tl.load(gu_ptr + row * 2 * F + F + offs, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu rounds to the dtype before the multiply
    tl.store(out_ptr + row * F + offs, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


#: columns per silu_mul program
SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up = [gate | up]`` along the last dim.

    Parameters
    ----------
    gate_up : [R, 2F] float32 or bfloat16, contiguous
    out : [R, F] gate_up's dtype, optional
    pdl : bool
        Programmatic dependent launch (``decode/launch.py``; off under the interpreter).

    Returns
    -------
    out : [R, F]

    grid ``(R, cdiv(F, SILU_BLOCK))``.
    """
    r, f2 = gate_up.shape
    f = f2 // 2
    assert gate_up.is_contiguous()
    if out is None:
        out = torch.empty((r, f), dtype=gate_up.dtype, device=gate_up.device)
    pdl = pdl_on(pdl)
    grid = (r, triton.cdiv(f, SILU_BLOCK))
    _silu_mul[grid](gate_up, out, F=f, BLOCK=SILU_BLOCK, PDL=pdl, num_warps=4, **launch_options(pdl))
    return out

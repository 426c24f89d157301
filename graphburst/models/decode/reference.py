"""Plain-torch references of the decode kernels (``decode.attention``, ``decode.fused``, ``decode.gemv``,
``decode.folded``).

Same signatures and semantics as the Triton launchers (``pdl``, how a kernel is launched, is
accepted and ignored), written as the obvious dense torch math (fp32 inside) so they run
anywhere: the tests hold the kernels to these on awkward sizes (on the CPU through Triton's
interpreter, on the GPU natively), and the model's fused decode path can run on them on a CPU.
"""

from __future__ import annotations

import math

import torch

from .partial import Partial, dense


def decode_attention_ref(q: torch.Tensor, kv: torch.Tensor, length: torch.Tensor, out: torch.Tensor | None = None,
                         splits: int | None = None, pdl: bool = False, combine: bool = True) -> torch.Tensor:
    """:func:`graphburst.models.decode.attention.decode_attention` in dense fp32 torch.

    Parameters
    ----------
    q : [B, T, H, D]; kv : [2, Bc, S, KVH, D]; length : [B] int32; out : [B, T, H, D], optional
    splits, pdl, combine : ignored (the kernel's work split and launch; the function is the same, and a
        reference has no splits to hand on)

    Returns
    -------
    out : [B, T, H, D] q's dtype; token t of row b attends to KV rows ``<= length[b] + t``
    """
    b, t, h, d = q.shape
    s_rows, kvh = kv.shape[2], kv.shape[3]
    g = h // kvh
    n_valid = (length.long().clamp(min=0) + t).clamp(max=s_rows)  # [B] rows written
    rows = torch.arange(s_rows, device=q.device)
    last = length.long().clamp(min=0).unsqueeze(1) + torch.arange(t, device=q.device)  # [B, T]
    seen = (rows <= last.unsqueeze(-1)) & (rows < n_valid.view(b, 1, 1))  # [B, T, S]
    # Rows never written are zeroed before the matmul, so a poisoned tail (inf, NaN) cannot leak.
    readable = (rows < n_valid.unsqueeze(1)).view(b, s_rows, 1, 1)  # [B, S, 1, 1]
    k = torch.where(readable, kv[0, :b].float(), 0.0).repeat_interleave(g, dim=2)  # [B, S, H, D]
    v = torch.where(readable, kv[1, :b].float(), 0.0).repeat_interleave(g, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k) / math.sqrt(d)  # [B, H, T, S]
    scores = scores.masked_fill(~seen.unsqueeze(1), float("-inf"))
    y = torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), v)
    if out is None:
        return y.to(q.dtype).contiguous()  # [B, T, H, D] row-major, as the kernel writes it
    out.copy_(y)
    return out


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """:func:`graphburst.models.decode.fused.add_rmsnorm`: ``x += residual`` in place, then the norm."""
    if residual is not None:
        x.copy_((x.float() + residual.float()).to(x.dtype))
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def rope_kv_write_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: torch.Tensor,
                      length: torch.Tensor, kv: torch.Tensor, n_heads: int, pdl: bool = False) -> None:
    """:func:`graphburst.models.decode.fused.rope_kv_write`: q rotated in place, k and v into the cache."""
    b, t, nh, d = qkv.shape
    kvh, s_rows, half = kv.shape[3], kv.shape[2], d // 2
    steps = torch.arange(t, device=qkv.device)
    pos = (start_pos.long().unsqueeze(1) + steps).clamp(0, cos.shape[0] - 1)  # [B, T]
    row = (length.long().clamp(min=0).unsqueeze(1) + steps).clamp(max=s_rows - 1)  # [B, T]
    c = cos[pos, :half].to(qkv.dtype).float().unsqueeze(2)  # [B, T, 1, D/2], cast as HF casts
    s = sin[pos, :half].to(qkv.dtype).float().unsqueeze(2)
    x = qkv[:, :, : n_heads + kvh].float()
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(qkv.dtype)  # [B, T, H + KVH, D]
    batch = torch.arange(b, device=qkv.device).unsqueeze(1).expand(b, t)
    kv[0, batch, row] = rot[:, :, n_heads:]
    kv[1, batch, row] = qkv[:, :, n_heads + kvh:]
    qkv[:, :, :n_heads] = rot[:, :, :n_heads]


def silu_mul_ref(gate_up: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """:func:`graphburst.models.decode.fused.silu_mul`: ``silu(gate) * up``, silu rounded to the dtype first."""
    gate, up = gate_up.chunk(2, dim=-1)
    y = (torch.nn.functional.silu(gate.float()).to(gate.dtype).float() * up.float()).to(gate.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, config=None, fma: bool | None = None,
               pdl: bool = False) -> torch.Tensor:
    """:func:`graphburst.models.decode.gemv.gemv`: ``x @ weight.T + bias`` in fp32, rounded once to x's dtype.

    Parameters
    ----------
    x : [M, K]; weight : [N, K]; bias : [N], optional; out : [M, N], optional
    config, fma, pdl : ignored (the kernel's tiling and launch; the function is the same)

    Returns
    -------
    out : [M, N] x's dtype
    """
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


# ---------------------------------------------------------------------- the folded kernels (decode/folded.py)


def folded_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config=None,
                      fma: bool | None = None, pdl: bool = False) -> Partial:
    """:func:`graphburst.models.decode.folded.linear`: the output whole (a reference has no partials)."""
    return Partial.whole(linear_ref(x, weight, bias))


def norm_linear_ref(x: torch.Tensor, delta: Partial | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None, config=None, fma: bool | None = None,
                    pdl: bool = False) -> tuple[Partial, torch.Tensor]:
    """:func:`graphburst.models.decode.folded.norm_linear`: (the projection of the normalised residual, the
    residual), x left as it was."""
    h = x if delta is None else x.clone()
    hn = add_rmsnorm_ref(h, None if delta is None else dense(delta), norm_weight, eps)
    return Partial.whole(linear_ref(hn, weight, bias)), h


def silu_linear_ref(gate_up: Partial, weight: torch.Tensor, bias: torch.Tensor | None = None, config=None,
                    fma: bool | None = None, pdl: bool = False) -> Partial:
    """:func:`graphburst.models.decode.folded.silu_linear`: ``silu(gate) * up`` projected."""
    return Partial.whole(linear_ref(silu_mul_ref(dense(gate_up)), weight, bias))


def materialize_ref(p: Partial, pdl: bool = False) -> torch.Tensor:
    """:func:`graphburst.models.decode.folded.materialize`."""
    return dense(p)


def folded_rope_kv_write_ref(qkv: Partial, cos: torch.Tensor, sin: torch.Tensor, start_pos: torch.Tensor,
                             length: torch.Tensor, kv: torch.Tensor, n_heads: int, tokens: int,
                             pdl: bool = False) -> torch.Tensor:
    """:func:`graphburst.models.decode.folded.rope_kv_write`: returns the rotated q [B, T, H, D]."""
    r, width = qkv.shape
    d = kv.shape[4]
    full = dense(qkv).view(r // tokens, tokens, width // d, d).clone()
    rope_kv_write_ref(full, cos, sin, start_pos, length, kv, n_heads)
    return full[:, :, :n_heads].contiguous()

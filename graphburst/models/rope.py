"""Rotary position embeddings in HF's rotate-half layout, with the ``llama3`` frequency scaling.

:func:`apply_rope` is HF's formula (the reference); :func:`rope_rotation` and
:func:`rotate` compute the same values for q, k and v heads together in two ops (see
their docstrings for why that is bit-identical in fp32).
"""

from __future__ import annotations

import math

import torch

from .llama_config import LLAMA3_KEYS, LlamaConfig

def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """``[head_dim / 2] float32`` inverse frequencies, with the llama3 scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_scaling is None:
        return inv
    s = cfg.rope_scaling
    factor, low, high, old = (float(s[k]) for k in LLAMA3_KEYS)
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, blended, scaled)


def rope_tables(cfg: LlamaConfig, n_pos: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[n_pos, head_dim] float32`` for positions 0..n_pos-1."""
    freqs = torch.outer(torch.arange(n_pos, dtype=torch.float32), rope_inv_freq(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, H, D]`` by ``cos, sin [B, T, D]`` (the rotate-half layout of HF weights).

    The plain formula, kept as the reference :func:`rope_rotation` is tested against.
    """
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_rotation(cos: torch.Tensor, sin: torch.Tensor, n_rot: int, n_pass: int) -> torch.Tensor:
    """The per-head 2x2 rotations that :func:`rotate` applies.

    With ``x = [h0, h1]`` (the two halves of a head), HF's rotate-half RoPE is
    ``out[j] = sum_i h_i * m[i, j]`` with ``m = [[c, s], [-s, c]]``, where ``c, s`` are
    the first halves of ``cos, sin`` (both halves hold the same frequencies).

    Parameters
    ----------
    cos, sin : [R, T, head_dim], in the activations' dtype
    n_rot, n_pass : int
        Heads to rotate (q and k), then heads to pass through (v: the identity).

    Returns
    -------
    [R, T, n_rot + n_pass, 2, 2, head_dim / 2], contiguous
    """
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]  # [R, T, D/2]
    rot = torch.stack((c, s, -s, c), dim=2).unsqueeze(2)  # [R, T, 1, 4, D/2]
    one, zero = torch.ones_like(c), torch.zeros_like(c)
    keep = torch.stack((one, zero, zero, one), dim=2).unsqueeze(2)  # [R, T, 1, 4, D/2]
    r, t = c.shape[:2]
    m = torch.cat((rot.expand(r, t, n_rot, 4, half), keep.expand(r, t, n_pass, 4, half)), dim=2)
    return m.view(r, t, n_rot + n_pass, 2, 2, half)


def rotate(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x [R, T, NH, D]`` (last dim contiguous) rotated by ``m`` from :func:`rope_rotation`; two kernels.

    The multiply rounds each product as HF's does; the sum adds the two products of one
    output element (a sum of two is exact-order: a + b), so fp32 results are bit-identical
    to :func:`apply_rope`.

    Returns
    -------
    [R, T, NH, D] contiguous
    """
    r, t, nh, d = x.shape
    prod = x.view(r, t, nh, 2, 1, d // 2) * m  # [R, T, NH, 2 (in half), 2 (out half), D/2]
    return prod.sum(dim=3).view(r, t, nh, d)

"""Causal attention over prompts packed end to end (a packed fresh prefill).

A fresh prefill of several prompts padded to the longest spends its GEMMs on padding: on
the 8b shape, 11 prompts of lognormal lengths (1402 tokens) ran as 2816 padded tokens
(docs/serving.md). Packed, the prompts are one row of ``T`` tokens, and each token attends
causally to the tokens of its own prompt only: ``cu`` marks where each prompt starts.

On a CUDA device (Ampere on) with fp16/bf16 this is torch's variable-length flash attention
(``torch.nn.attention.varlen.varlen_attn``: no mask, any number of segments, empty ones
included, and it captures in a CUDA graph). Elsewhere (the CPU, fp32) it is
:func:`varlen_reference`: SDPA under a block-diagonal causal mask, the reference the GPU
path is tested against.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

try:  # torch >= 2.9; the H200 image has 2.11, CI 2.13
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch: the reference serves
    _varlen_attn = None

_PARAMS = inspect.signature(_varlen_attn).parameters if _varlen_attn is not None else {}
#: varlen_attn's causal switch: ``window_size=(-1, 0)`` from torch 2.11, ``is_causal=True`` in 2.9 and 2.10
CAUSAL_WINDOW = (-1, 0)
_CAUSAL = {"window_size": CAUSAL_WINDOW} if "window_size" in _PARAMS else \
    {"is_causal": True} if "is_causal" in _PARAMS else None
#: torch 2.13 asks for ``enable_gqa=True`` when K/V have fewer heads than Q; 2.11 has no such
#: argument (its flash kernel takes grouped heads as they are)
_GQA_ARG = "enable_gqa" in _PARAMS
#: dtypes the flash kernel takes
FLASH_DTYPES = (torch.float16, torch.bfloat16)
#: the flash kernel's oldest GPUs (Ampere)
FLASH_MIN_CAPABILITY = (8, 0)


@functools.lru_cache(maxsize=None)  # asked once per layer call: the answer is fixed per (dtype, device)
def flash_varlen_available(dtype: torch.dtype, device) -> bool:
    """Whether torch's variable-length flash kernel serves ``dtype`` on ``device`` (a torch device):
    a torch that has it with a causal switch, a CUDA device from Ampere on, fp16 or bf16."""
    device = torch.device(device)
    return (_varlen_attn is not None and _CAUSAL is not None and device.type == "cuda" and dtype in FLASH_DTYPES
            and torch.cuda.get_device_capability(device) >= FLASH_MIN_CAPABILITY)


def flash_varlen_ok(q: torch.Tensor) -> bool:
    """Whether :func:`causal_varlen` runs torch's flash kernel for ``q`` (else the reference)."""
    return flash_varlen_available(q.dtype, q.device)


def causal_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int) -> torch.Tensor:
    """Causal attention of each packed segment over its own tokens.

    Parameters
    ----------
    q : [T, H, D]
    k, v : [T, KV, D], ``H`` a multiple of ``KV`` (grouped-query attention)
    cu : [N + 1] int32
        Segment offsets: segment i is tokens ``[cu[i], cu[i + 1])``; ``cu[0] = 0``,
        ``cu[N] = T``, non-decreasing (empty segments allowed).
    max_len : int
        An upper bound on a segment's length (a host int: it sizes the kernel's grid).

    Returns
    -------
    [T, H, D], q's dtype
    """
    if not flash_varlen_ok(q):
        return varlen_reference(q, k, v, cu)
    kw = {"enable_gqa": True} if _GQA_ARG and k.shape[1] != q.shape[1] else {}
    return _varlen_attn(q, k, v, cu, cu, max_len, max_len, **_CAUSAL, **kw)


def segment_ids(cu: torch.Tensor, t: int) -> torch.Tensor:
    """``[T] int64``: the segment of each of ``t`` packed tokens (``cu`` as for :func:`causal_varlen`)."""
    # the last offset <= token i; empty segments share an offset, and right=True skips past them
    return torch.searchsorted(cu[1:].contiguous(), torch.arange(t, device=cu.device, dtype=cu.dtype), right=True)


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """:func:`causal_varlen` as one SDPA call under a ``[T, T]`` block-diagonal causal mask.

    O(T^2) memory: the CPU path and a check of the flash kernel, not a serving path on long prompts.
    """
    t = q.shape[0]
    seg = segment_ids(cu.to(torch.int64), t)  # [T]
    pos = torch.arange(t, device=q.device)
    mask = (seg.unsqueeze(1) == seg.unsqueeze(0)) & (pos.unsqueeze(0) <= pos.unsqueeze(1))  # [T, T] bool
    y = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), attn_mask=mask,
                                       enable_gqa=k.shape[1] != q.shape[1])
    return y[0].transpose(0, 1)  # [T, H, D]

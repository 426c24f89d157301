"""Llama's decode / verify forward on fused kernels (T <= MAX_K + 1 tokens per sequence, all B rows).

The burst calls the model with T = 1 (draft steps) and T = k + 1 (verify) against the
static cache. The SDPA path in ``llama.py`` streams every slot's whole capacity through
an additive mask and spends ~17 kernels per layer outside the GEMMs; here a layer is

    add+RMSNorm -> qkv GEMM -> RoPE+KV write -> attention (split-KV, + combine) -> o GEMM
    -> add+RMSNorm -> gate/up GEMM -> SiLU*up -> down GEMM

with each layer's residual add folded into the next norm (the last one into the final
norm), the attention reading only rows ``< length + T`` (``kernels/attention_triton.py``),
and positions and lengths read on the device, so the forward is graph-capturable: fixed
grids, no host reads, temporaries from torch's allocator (the graph's pool in a capture).
The GEMMs stay the modules' own ``nn.Linear`` calls (cuBLAS), so forward hooks on them
(tensor parallelism's all-reduce) still run.

:data:`TRITON` runs the Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``);
:data:`REFERENCE` runs their plain-torch references (``kernels/decode_ref.py``), which is
how CI checks this forward's wiring against the SDPA path without Triton.
"""

from __future__ import annotations

import importlib.util
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F


class DecodeOps(NamedTuple):
    """The four kernels a fused decode layer runs (same signatures in both namespaces)."""

    attention: Callable
    add_rmsnorm: Callable
    rope_kv_write: Callable
    silu_mul: Callable


def triton_ops() -> DecodeOps:
    from ..kernels.attention_triton import decode_attention
    from ..kernels.fused_triton import add_rmsnorm, rope_kv_write, silu_mul
    return DecodeOps(decode_attention, add_rmsnorm, rope_kv_write, silu_mul)


def reference_ops() -> DecodeOps:
    from ..kernels.decode_ref import add_rmsnorm_ref, decode_attention_ref, rope_kv_write_ref, silu_mul_ref
    return DecodeOps(decode_attention_ref, add_rmsnorm_ref, rope_kv_write_ref, silu_mul_ref)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def unsupported(model) -> str | None:
    """Why ``model`` cannot take the fused path (None: it can). Checked once, at construction.

    A sliding window needs no check here: LlamaConfig has no such field, and a checkpoint
    config with one is refused at load (``llama_config.check_window``).
    """
    cfg = model.cfg
    hd = cfg.head_dim
    if hd < 16 or hd & (hd - 1):
        return f"head_dim {hd} is not a power of two >= 16 (the kernels tile whole heads)"
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        return "query heads are not a multiple of KV heads"
    for block in model.layers:
        attn = block.self_attn
        if attn.backends is not None:
            return "deterministic_attention pins SDPA kernels"
    return None


def fused_forward(model, tokens: torch.Tensor, start_pos: torch.Tensor, lengths, ops: DecodeOps) -> torch.Tensor:
    """:meth:`Llama.forward` for all B rows, no ``logits_at``; same contract, same outputs up to rounding.

    Parameters
    ----------
    model : Llama
    tokens : [B, T] int64
    start_pos : [B] int32 or int64
    lengths : sequence of [B] int32, one per layer (valid KV rows before the call; not moved)
    ops : DecodeOps

    Returns
    -------
    [B, T, vocab] float32
    """
    r, t = tokens.shape
    cfg = model.cfg
    h, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = model.embed_tokens(tokens).view(r * t, -1)  # [R*T, hidden], the residual stream (updated in place)
    delta = None  # the last sublayer's output, added to x by the next norm
    for layer, kv, length in zip(model.layers, model.kv, lengths):
        attn, mlp = layer.self_attn, layer.mlp
        hn = ops.add_rmsnorm(x, delta, layer.input_layernorm.weight, layer.input_layernorm.eps)
        qkv = attn.qkv_proj(hn).view(r, t, h + 2 * kvh, hd)  # [R, T, H + 2 KV, D]
        if attn.qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE, as the SDPA path does
            q, k, v = qkv.split((h, kvh, kvh), dim=2)
            qkv = torch.cat((attn.q_norm(q), attn.k_norm(k), v), dim=2)
        ops.rope_kv_write(qkv, model.rope_cos, model.rope_sin, start_pos, length, kv, h)
        y = ops.attention(qkv[:, :, :h], kv, length)  # [R, T, H, D]
        delta = attn.o_proj(y.view(r * t, h * hd))
        hn = ops.add_rmsnorm(x, delta, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        delta = mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(hn)))
    hn = ops.add_rmsnorm(x, delta, model.norm.weight, model.norm.eps)
    return F.linear(hn, model.head_weight()).float().view(r, t, -1)

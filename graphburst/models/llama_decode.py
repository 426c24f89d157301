"""Llama's decode / verify forward on fused kernels (T <= MAX_K + 1 tokens per sequence, all B rows).

The burst calls the model with T = 1 (draft steps) and T = k + 1 (verify) against the
static cache. The SDPA path in ``llama.py`` streams every slot's whole capacity through
an additive mask and spends ~17 kernels per layer outside the GEMMs; here a layer is

    add+RMSNorm -> qkv GEMM -> RoPE+KV write -> attention (split-KV, + combine) -> o GEMM
    -> add+RMSNorm -> gate/up GEMM -> SiLU*up -> down GEMM

with each layer's residual add folded into the next norm (the last one into the final
norm), the attention reading only rows ``< length + T`` (``models/decode/attention.py``),
and positions and lengths read on the device, so the forward is graph-capturable: fixed
grids, no host reads, temporaries from torch's allocator (the graph's pool in a capture).
At M = B * T <= ``DecodeOps.gemv_max_m`` rows the projections and the head run on a
weight-streaming GEMV (``models/decode/gemv.py``: cuBLAS streams weights well below
the HBM rate at such M); past it, and for a projection with forward hooks (tensor
parallelism's all-reduce on o_proj and down_proj), the module's own ``nn.Linear`` call
(cuBLAS) runs, so the hooks still run.

:func:`triton_ops` runs the Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``);
:func:`reference_ops` runs their plain-torch references (``models/decode/reference.py``), which is
how CI checks this forward's wiring against the SDPA path without Triton. ``DecodeOps.pdl``
launches every Triton kernel with programmatic dependent launch (``models/decode/launch.py``:
each kernel starts while the previous one finishes and waits before it reads its outputs;
the GEMV loads its first weight tile before that wait). A projection that falls back to
``nn.Linear`` (cuBLAS) breaks the overlap there but not the order: the kernel after it
waits for it as for any other.
"""

from __future__ import annotations

import importlib.util
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .decode.partial import AttentionSplits, Partial

#: ``decode_kernels="auto"`` on CUDA: forwards of M = B * T <= GEMV_MAX_M rows run their
#: projections and head on the weight-streaming GEMV instead of cuBLAS (cuBLAS's GEMMs and
#: head took 776 µs for the 1b at B = 1 on the H200, 1.5x the 518 µs bytes floor). Set from
#: the H200 sweep (``tools/gemv_bench.py``): the largest M at which the GEMV still wins on
#: every shape; 0 keeps cuBLAS. At most ``gemv.MAX_M`` (one row tile).
#: Measured on the H200 (2026-12-01, docs/results/gemv_1b_h200.json): it never wins on every
#: shape. The 1b's small projections are latency-bound single kernels (qkv 6.5 µs under cuBLAS,
#: 9.2 µs as the GEMV at M = 1; o 6.1 vs 7.7), only the head gains (4% at M >= 5), and the whole
#: B = 1 forward is 1187 µs with cuBLAS against 1197 µs with the GEMV. So cuBLAS it stays.
GEMV_MAX_M = 0
#: ``decode_kernels="reference"`` (and :func:`triton_ops`' default): the GEMV's reference up to
#: its whole row tile (``gemv.MAX_M``) whatever GEMV_MAX_M says, so the forced paths keep it
#: tested. (``"gemv"``, ``"pdl"`` and ``"folded"`` take ``gemv.MAX_M`` itself.)
FORCED_GEMV_MAX_M = 16


class DecodeOps(NamedTuple):
    """The kernels a fused decode layer runs (same signatures in both namespaces).

    ``linear(x, weight, bias)`` serves projections of M <= ``gemv_max_m`` rows. Every op
    is called with ``pdl=pdl`` (the references ignore it).
    """

    attention: Callable
    add_rmsnorm: Callable
    rope_kv_write: Callable
    silu_mul: Callable
    linear: Callable
    gemv_max_m: int
    pdl: bool = False  # programmatic dependent launch of every Triton kernel (off under the interpreter)


def triton_ops(gemv_max_m: int = FORCED_GEMV_MAX_M, pdl: bool = False) -> DecodeOps:
    from .decode.attention import decode_attention
    from .decode.fused import add_rmsnorm, rope_kv_write, silu_mul
    from .decode.gemv import MAX_M, gemv
    if not 0 <= gemv_max_m <= MAX_M:
        raise ValueError(f"gemv_max_m must be in [0, {MAX_M}] (the GEMV is one row tile), got {gemv_max_m}")
    return DecodeOps(decode_attention, add_rmsnorm, rope_kv_write, silu_mul, gemv, gemv_max_m, bool(pdl))


def gemv_ops(pdl: bool = False) -> DecodeOps:
    """``decode_kernels="gemv"`` (and ``"pdl"``, with ``pdl``): the Triton kernels, every projection and the
    head of M <= ``gemv.MAX_M`` rows on the GEMV."""
    from .decode.gemv import MAX_M
    return triton_ops(MAX_M, pdl)


def reference_ops(gemv_max_m: int = FORCED_GEMV_MAX_M) -> DecodeOps:
    from .decode.reference import add_rmsnorm_ref, decode_attention_ref, linear_ref, rope_kv_write_ref, silu_mul_ref
    return DecodeOps(decode_attention_ref, add_rmsnorm_ref, rope_kv_write_ref, silu_mul_ref, linear_ref, gemv_max_m)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA with Triton installed, or the CPU under
    Triton's interpreter (``TRITON_INTERPRET=1``, read when the kernels were first imported)."""
    if not triton_available():
        return False
    if device.type == "cuda":
        return True
    from .decode.launch import INTERPRETED
    return INTERPRETED


#: compute capability from which the GPU has programmatic dependent launch (Hopper)
PDL_MIN_CAPABILITY = (9, 0)


def pdl_unsupported(device: torch.device) -> str | None:
    """Why the Triton kernels cannot launch with PDL on ``device`` (None: they can). Off the GPU the
    kernels run under Triton's interpreter, which launches them without it (the same function)."""
    if device.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(device)
    if cap < PDL_MIN_CAPABILITY:
        return f"programmatic dependent launch needs compute capability >= {PDL_MIN_CAPABILITY}, the GPU has {cap}"
    return None


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


def _hooked(module: nn.Module) -> bool:
    """A hook waits on the module's own call (tensor parallelism's all-reduce): a projection with one keeps
    its ``nn.Linear`` call."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def project(module: nn.Linear, x: torch.Tensor, ops: DecodeOps) -> torch.Tensor:
    """``module(x)`` for x [M, in]: on ``ops.linear`` when M <= ``ops.gemv_max_m`` and no hook waits on the call."""
    if x.shape[0] <= ops.gemv_max_m and not _hooked(module):
        return ops.linear(x, module.weight, module.bias, pdl=ops.pdl)
    return module(x)


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
    pdl = ops.pdl
    for layer, kv, length in zip(model.layers, model.kv, lengths):
        attn, mlp = layer.self_attn, layer.mlp
        hn = ops.add_rmsnorm(x, delta, layer.input_layernorm.weight, layer.input_layernorm.eps, pdl=pdl)
        qkv = project(attn.qkv_proj, hn, ops).view(r, t, h + 2 * kvh, hd)  # [R, T, H + 2 KV, D]
        if attn.qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE, as the SDPA path does
            q, k, v = qkv.split((h, kvh, kvh), dim=2)
            qkv = torch.cat((attn.q_norm(q), attn.k_norm(k), v), dim=2)
        ops.rope_kv_write(qkv, model.rope_cos, model.rope_sin, start_pos, length, kv, h, pdl=pdl)
        y = ops.attention(qkv[:, :, :h], kv, length, pdl=pdl)  # [R, T, H, D]
        delta = project(attn.o_proj, y.view(r * t, h * hd), ops)
        hn = ops.add_rmsnorm(x, delta, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                             pdl=pdl)
        delta = project(mlp.down_proj, ops.silu_mul(project(mlp.gate_up_proj, hn, ops), pdl=pdl), ops)
    hn = ops.add_rmsnorm(x, delta, model.norm.weight, model.norm.eps, pdl=pdl)
    head = ops.linear(hn, model.head_weight(), pdl=pdl) if r * t <= ops.gemv_max_m \
        else F.linear(hn, model.head_weight())
    return head.float().view(r, t, -1)


# ---------------------------------------------------------------------- the folded layer (decode/folded.py)


class FoldedOps(NamedTuple):
    """The kernels of the folded decode layer (``decode/folded.py``), or their references.

    The norms, SiLU x up and the split-K sums run inside the projections' kernels at M <= ``max_m``
    rows; past it, and around a projection with forward hooks, ``add_rmsnorm`` and ``silu_mul`` run
    on their own before the module's ``nn.Linear`` call. Every op is called with ``pdl=pdl``.
    """

    attention: Callable
    norm_linear: Callable  # (x, delta, norm weight, eps, weight, bias) -> (Partial, residual)
    linear: Callable  # (x, weight, bias) -> Partial
    silu_linear: Callable  # (gate_up Partial, weight, bias) -> Partial
    rope_kv_write: Callable  # (qkv Partial, cos, sin, start_pos, length, kv, H, T) -> q [B, T, H, D]
    materialize: Callable  # Partial -> [M, N]
    add_rmsnorm: Callable
    silu_mul: Callable
    max_m: int
    combine_max_m: int  # rows up to which o_proj combines the attention's splits itself (``folded.COMBINE_MAX_M``)
    pdl: bool = False


def folded_ops(pdl: bool = True, max_m: int | None = None) -> FoldedOps:
    """``decode_kernels="folded"``: the folded Triton kernels, with programmatic dependent launch (off
    under the interpreter). Every projection and the head of M <= ``max_m`` rows is folded; the
    default is ``folded.FOLD_MAX_M`` (one row), and more rows run the unfolded kernels around cuBLAS.
    ``max_m`` up to ``gemv.MAX_M`` folds more (the ``tl.dot`` prologues: what their tests run)."""
    from .decode import folded
    from .decode.attention import decode_attention
    from .decode.fused import add_rmsnorm, silu_mul
    from .decode.gemv import MAX_M
    max_m = folded.FOLD_MAX_M if max_m is None else max_m
    if not 0 <= max_m <= MAX_M:
        raise ValueError(f"max_m must be in [0, {MAX_M}] (the folded GEMV is one row tile), got {max_m}")
    return FoldedOps(decode_attention, folded.norm_linear, folded.linear, folded.silu_linear, folded.rope_kv_write,
                     folded.materialize, add_rmsnorm, silu_mul, max_m, folded.COMBINE_MAX_M, bool(pdl))


def folded_reference_ops(max_m: int = FORCED_GEMV_MAX_M, combine_max_m: int = 1) -> FoldedOps:
    """The folded layer on the kernels' plain-torch references (how a CPU without Triton checks its wiring; the
    reference attention has no splits, so it always hands o_proj its whole output)."""
    from .decode import reference as ref
    return FoldedOps(ref.decode_attention_ref, ref.norm_linear_ref, ref.folded_linear_ref, ref.silu_linear_ref,
                     ref.folded_rope_kv_write_ref, ref.materialize_ref, ref.add_rmsnorm_ref, ref.silu_mul_ref, max_m,
                     combine_max_m)


def _norm_project(weight, bias, module, x, delta, norm_weight, eps, fold: bool, ops: FoldedOps):
    """(the projection of ``rmsnorm(x + delta)`` as a Partial, the residual x + delta). ``module``: the
    projection (None for the head, ``F.linear`` over ``weight``)."""
    if fold and (module is None or not _hooked(module)):
        return ops.norm_linear(x, delta, norm_weight, eps, weight, bias, pdl=ops.pdl)
    d = None if delta is None else ops.materialize(delta, pdl=ops.pdl)
    hn = ops.add_rmsnorm(x, d, norm_weight, eps, pdl=ops.pdl)  # x += d in place: the forward owns x
    return Partial.whole(F.linear(hn, weight) if module is None else module(hn)), x


def folded_forward(model, tokens: torch.Tensor, start_pos: torch.Tensor, lengths, ops: FoldedOps) -> torch.Tensor:
    """:func:`fused_forward` on the folded layer: the same contract, the same outputs up to rounding.

    Per layer at M = B * T <= ``ops.max_m``: norm + qkv, RoPE + KV write, attention (+ combine),
    o_proj, norm + gate/up, SiLU + down; then norm + head. A projection's split-K partials go to its
    consumer whole (``decode/partial.py``), so no sum pass runs between them; at M <=
    ``ops.combine_max_m`` neither does the attention's combine (o_proj combines the splits).
    """
    r, t = tokens.shape
    m = r * t
    cfg = model.cfg
    h, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pdl = ops.pdl
    fold = m <= ops.max_m
    x = model.embed_tokens(tokens).view(m, -1)  # [M, hidden], the residual stream
    delta = None  # Partial of [M, hidden]: the last sublayer's output, added by the next norm
    for layer, kv, length in zip(model.layers, model.kv, lengths):
        attn, mlp = layer.self_attn, layer.mlp
        ln = layer.input_layernorm
        qkv, x = _norm_project(attn.qkv_proj.weight, attn.qkv_proj.bias, attn.qkv_proj, x, delta, ln.weight, ln.eps,
                               fold, ops)
        if attn.qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE, on the whole qkv
            q, k, v = ops.materialize(qkv, pdl=pdl).view(r, t, h + 2 * kvh, hd).split((h, kvh, kvh), dim=2)
            qkv = Partial.whole(torch.cat((attn.q_norm(q), attn.k_norm(k), v), dim=2).view(m, -1))
        q = ops.rope_kv_write(qkv, model.rope_cos, model.rope_sin, start_pos, length, kv, h, t, pdl=pdl)
        o = attn.o_proj
        o_folds = fold and not _hooked(o)
        y = ops.attention(q, kv, length, pdl=pdl, combine=not (o_folds and m <= ops.combine_max_m))
        y = y if isinstance(y, AttentionSplits) else y.view(m, h * hd)  # [M, H * D], or its splits
        delta = ops.linear(y, o.weight, o.bias, pdl=pdl) if o_folds else Partial.whole(o(y))
        ln = layer.post_attention_layernorm
        gate_up, x = _norm_project(mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.gate_up_proj, x, delta,
                                   ln.weight, ln.eps, fold, ops)
        down = mlp.down_proj
        if fold and not _hooked(down):
            delta = ops.silu_linear(gate_up, down.weight, down.bias, pdl=pdl)
        else:
            delta = Partial.whole(down(ops.silu_mul(ops.materialize(gate_up, pdl=pdl), pdl=pdl)))
    head, _ = _norm_project(model.head_weight(), None, None, x, delta, model.norm.weight, model.norm.eps, fold, ops)
    return ops.materialize(head, pdl=pdl).float().view(r, t, -1)

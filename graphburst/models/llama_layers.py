"""The layers of a :class:`~graphburst.models.llama.Llama`: RMSNorm, fused projections,
attention over a static per-layer KV tensor, the SwiGLU MLP and the decoder block.

Apart from the model (``llama.py``: the layer stack, its KV storage and RoPE tables, and
the forward / greedy entry points) because a layer is what the rest of graphburst works
on one at a time: a pipeline stage runs its slice of ``Block``s with the model's
``layer_inputs``, tensor parallelism hooks ``o_proj`` and ``down_proj``, checkpoint
loading names the parts of a :class:`FusedLinear`. The families graphburst loads differ
here only by config switches (q/k/v biases, o_proj and MLP biases, per-head q/k RMSNorm).

Every launch is a graph node and at batch 1 a layer's non-GEMM work is launch-bound, so
a layer is written to issue few kernels (``tests/models/test_llama_ops.py`` bounds the count):

* **Fused projections.** ``qkv_proj`` holds HF's ``q_proj``, ``k_proj``, ``v_proj`` rows
  stacked, ``gate_up_proj`` holds ``gate_proj`` then ``up_proj``: one GEMM each, split by
  views. :meth:`Llama.hf_tensors` names the HF parts as views of the fused parameters
  (checkpoint loading, tensor-parallel sharding and the transformers twin use it).
* **RoPE in two kernels, over q, k and v at once.** One broadcast multiply by a 2x2
  rotation per frequency, built once per forward, and one sum over the input half
  (:func:`rope_rotation`); v heads get the identity, so the output holds rotated q, k
  and v side by side and one ``index_copy_`` writes K and V. Each output element is
  the sum of the same two rounded products HF's ``x*cos + rotate_half(x)*sin`` adds, so
  it is bit-identical in fp32 (and rounds as HF does in bf16).
* **One norm kernel.** ``F.rms_norm`` with the weight (fp32 math inside the fused CUDA
  kernel) instead of upcast, normalise, downcast and multiply.
* **An additive mask built once per forward** (:func:`kv_index`) in the activations'
  dtype: SDPA would turn a boolean mask into the same ``0 / -inf`` tensor on every call.
* **A fresh prefill attends to its own tokens.** When every row starts at position 0
  (``LayerIndex.fresh``: whole prompts, first chunks) the keys are the call's own K and V,
  causal, with no mask, no gather of each slot's whole KV capacity, and no cuDNN
  (:data:`PREFILL_SDPA`): eager prefill is host-bound, and cuDNN's attention builds a plan
  per new shape.
* **A packed prefill pads nothing between prompts** (:class:`Packed`): the prompts of a
  fresh admission sit end to end in one row, each token carries its own position and slot,
  and attention is causal within each prompt (:mod:`~graphburst.models.varlen`).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .llama_config import LlamaConfig
from .rope import rope_rotation, rotate
from .varlen import causal_varlen


#: SDPA kernels for ``deterministic_attention``: torch's memory-efficient kernel (its forward
#: has no atomics; run over folded query groups, as it has no GQA path), math where it
#: cannot run (the CPU). cuDNN's attention, torch's default for bf16 on the H200, is not in
#: torch's deterministic set, and a replicated bf16 draft using it diverged across two GPUs.
DETERMINISTIC_SDPA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
#: SDPA kernels for a fresh prefill (causal over its own tokens, no mask): flash, with
#: memory-efficient and math where it cannot run. Not cuDNN: on the H200 its attention cost
#: the host 4.9 ms per layer call to plan each new prompt shape (torch.profiler, 1b shape),
#: and eager prefill runs while the GPU may wait on the host.
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class LayerIndex(NamedTuple):
    """What a layer's attention needs besides its input (:meth:`Llama.layer_inputs`).

    flat : [R*T] int64, rows of the new tokens in the flat KV view (:func:`kv_index`)
    mask : additive mask [R, 1, T, S] ([R, 1, T*G, S] folded), or [R, 1, T(*G), T] when
        ``fresh``, or None for a fresh unfolded call (causal, no mask)
    rot : the RoPE rotation (:func:`rope_rotation`)
    fresh : every row starts at position 0, so the keys are the call's own tokens
    backends : SDPA backends to pin, or None for torch's choice
    cu, max_len : a packed call's segment offsets and longest segment bound
        (:class:`Packed`), or None and 0
    """

    flat: torch.Tensor
    mask: torch.Tensor | None
    rot: torch.Tensor
    fresh: bool = False
    backends: list | None = None
    cu: torch.Tensor | None = None
    max_len: int = 0


class Packed(NamedTuple):
    """Fresh prompts packed end to end into one row of ``T`` tokens (``tokens [1, T]``).

    pos : [T] int64, each token's position in its prompt
    slot : [T] int64, each token's batch row (its KV goes to row ``slot * S + pos``)
    cu : [N + 1] int32, segment offsets (:func:`~graphburst.models.varlen.causal_varlen`);
        tokens past the prompts (a bucket's padding) form segments of their own
    max_len : int, a bound on a segment's length
    last : [R] int64, the token whose logits each prompt's head reads

    Padding tokens take position ``S`` and slot 0: their KV write clamps to row ``S - 1``
    of slot 0, which no attention reads (``prefill_graphs``'s padding rows do the same).
    """

    pos: torch.Tensor
    slot: torch.Tensor
    cu: torch.Tensor
    max_len: int
    last: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **factory):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's weight * x * rsqrt(mean(x^2) + eps), normalised in fp32: one fused kernel on
        # CUDA (fp32 math inside, so bf16 input needs no cast kernels). In fp32 it is the
        # same products as HF's; in bf16 the fused kernel rounds once where HF rounds twice.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class FusedLinear(nn.Linear):
    """Several projections of one input as one GEMM: output rows are ``parts`` in order.

    Parameters
    ----------
    d_in : int
    parts : dict
        HF projection name -> its output rows (``{"q_proj": H*D, "k_proj": ..., ...}``).
    """

    def __init__(self, d_in: int, parts: dict[str, int], bias: bool, **factory):
        super().__init__(d_in, sum(parts.values()), bias=bias, **factory)
        self.parts = dict(parts)

    def split(self, t: torch.Tensor, dim: int = 0) -> dict[str, torch.Tensor]:
        """``t`` (the weight, the bias, or an output along ``dim=-1``) cut into its named parts (views)."""
        return dict(zip(self.parts, t.split(list(self.parts.values()), dim=dim)))


class Attention(nn.Module):
    """Grouped-query attention over a static per-layer KV tensor.

    ``fold_gqa``: run it as attention over the KV heads with each group's query heads
    folded into the query length (q ``[R, KV, T*G, D]`` against K/V ``[R, KV, S, D]``,
    the mask repeated per head of a group), so no backend needs a GQA path or a KV
    repeat. Free of copies at T = 1; at T > 1, q and the output are each copied once.
    """

    def __init__(self, cfg: LlamaConfig, fold_gqa: bool = False, deterministic: bool = False, **factory):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.fold = (bool(fold_gqa) or bool(deterministic)) and self.n_kv != self.n_heads
        self.backends = DETERMINISTIC_SDPA if deterministic else None  # None: torch's choice
        d, bias, hd = cfg.hidden_size, cfg.attention_bias, cfg.head_dim
        self.qkv_proj = FusedLinear(d, {"q_proj": self.n_heads * hd, "k_proj": self.n_kv * hd,
                                        "v_proj": self.n_kv * hd}, bias or cfg.qkv_bias, **factory)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=bias, **factory)
        self.qk_norm = cfg.qk_norm
        if self.qk_norm:  # Qwen3: HF names self_attn.q_norm / k_norm, one [head_dim] weight each
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, **factory)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, **factory)

    def forward(self, x, cos, sin, kv, length, rows, index=None):
        """
        Parameters
        ----------
        x : [R, T, hidden]
        cos, sin : [R, T, head_dim] float32 (or x's dtype); unused when ``index`` is given
        kv : [2, B, S, n_kv, head_dim], written at rows ``length + [0, T)``
        length : [R] int32, valid rows before this call
        rows : [R] int64 batch rows of x (the prefilled slots in prefill), or None: all B in
            order (a burst), whose KV the attention then reads without a gather
        index : LayerIndex, optional
            :func:`kv_index` of ``length`` in x's dtype (through :func:`fold_mask` when
            ``self.fold``) and :func:`rope_rotation` of ``cos, sin`` (``Llama.layer_inputs``
            builds them once per forward); built here when absent.
        """
        r, t, _ = x.shape
        h, kvh, hd = self.n_heads, self.n_kv, self.head_dim
        if index is None:
            flat, mask = kv_index(length, torch.arange(r, device=x.device) if rows is None else rows, t,
                                  kv.shape[2], x.dtype)
            index = LayerIndex(flat, fold_mask(mask, h // kvh) if self.fold else mask,
                               rope_rotation(cos.to(x.dtype), sin.to(x.dtype), h + kvh, kvh), False, self.backends)
        flat, mask, rot, fresh, backends = index[:5]
        # One GEMM for q, k, v; one rotation for all three (v by the identity): [R, T, H + 2 KV, D].
        qkv = self.qkv_proj(x).view(r, t, h + 2 * kvh, hd)
        if self.qk_norm:  # per head, before RoPE (HF Qwen3); v is not normalised
            q, k, v = qkv.split((h, kvh, kvh), dim=2)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=2)
        qkv = rotate(qkv, rot)
        # K and V sit side by side: one index_copy_ of the [2, R*T, KV, D] view into the flat cache.
        kv.view(2, -1, kvh, hd).index_copy_(1, flat, qkv[:, :, h:].reshape(r * t, 2, kvh, hd).transpose(0, 1))
        if index.cu is not None:  # packed prompts (R = 1): each token attends within its own prompt
            y = causal_varlen(qkv[0, :, :h], qkv[0, :, h: h + kvh], qkv[0, :, h + kvh:], index.cu, index.max_len)
            return self.o_proj(y.reshape(r, t, h * hd))
        if fresh:  # every row starts at position 0: its keys are its own new tokens
            keys, vals = qkv[:, :, h: h + kvh], qkv[:, :, h + kvh:]  # [R, T, n_kv, D]
        else:
            # Given rows are gathered even when R == B: a bucket's rows need not be 0..B-1 in order
            keys, vals = (kv[0], kv[1]) if rows is None else (kv[0, rows], kv[1, rows])  # [R, S, n_kv, D]
        q = qkv[:, :, :h]  # [R, T, H, D]
        # sdpa_kernel sets torch's process-wide backend flags; entered and left on the thread
        # that runs the model, and a captured graph keeps the kernel it chose.
        with contextlib.nullcontext() if backends is None else sdpa_kernel(backends):
            y = self._attend(q, keys, vals, mask, r, t)
        return self.o_proj(y.reshape(r, t, h * hd))

    def _attend(self, q, keys, vals, mask, r: int, t: int):
        """``[R, T, H, D]`` attention output of ``q [R, T, H, D]`` over ``keys``/``vals [R, S, KV, D]``
        (causal over ``S == T`` keys when ``mask`` is None)."""
        h, kvh, hd = self.n_heads, self.n_kv, self.head_dim
        if self.fold:  # query head kv*G + g reads KV head kv (HF's repeat_kv order); rows ordered (t, g)
            g = h // kvh
            q = q.reshape(r, t, kvh, g, hd).transpose(1, 2).reshape(r, kvh, t * g, hd)  # [R, KV, T*G, D]
            y = F.scaled_dot_product_attention(q, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask)
            y = y.view(r, kvh, t, g, hd).transpose(1, 2)  # [R, T, KV, G, D]
        else:
            gqa = kvh != h
            if gqa and q.is_cuda and q.dtype == torch.float32 and 2 * t >= hd:
                # float32 GQA on a GPU: torch's only GQA kernel there is math, which materialises the
                # [R, H, T, S] scores and their softmax (2 GiB for one 8192-token prompt of 4 heads).
                # With each KV head repeated for its query group (HF's repeat_kv order) the
                # memory-efficient kernel runs instead, holding [R, S, H, D]: the smaller whenever
                # 2T >= D, so a decode step (T = k + 1) keeps the math kernel's small scores.
                keys, vals = keys.repeat_interleave(h // kvh, dim=2), vals.repeat_interleave(h // kvh, dim=2)
                gqa = False
            y = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                                               attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=gqa).transpose(1, 2)  # [R, T, H, D]
        return y


def kv_index(length: torch.Tensor, rows: torch.Tensor, t: int, s: int,
             dtype: torch.dtype = torch.float32, width: int | None = None,
             with_mask: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where T new tokens go in a ``[2, B, S, ...]`` KV tensor, and what each may attend to.

    Parameters
    ----------
    length : [R] int32, valid rows before the call
    rows : [R] int64 batch rows
    t, s : int
        New tokens per row; rows per sequence in the KV tensor.
    dtype : torch.dtype
        Of the mask: the attention's query dtype.
    width : int, optional
        KV rows the mask covers (default ``s``; ``t`` for a fresh call's own tokens).
    with_mask : bool
        False: no mask (None), for a call that attends causally without one; it would
        cost ``R x T x width`` elements, quadratic in a fresh prompt's length.

    Returns
    -------
    flat : [R*T] int64
        Row of each new token in the flat ``[2, B*S, ...]`` view; clamped so a corrupt
        length still writes in bounds.
    mask : [R, 1, T, width] ``dtype``
        0 where token t of row r sees KV row s (``s <= length[r] + t``, rows already
        written), -inf elsewhere: the additive mask SDPA makes of a boolean one.
    """
    at = length.long().unsqueeze(1) + torch.arange(t, device=length.device)  # [R, T] row of each new token
    flat = (rows.unsqueeze(1) * s + at.clamp(max=s - 1)).reshape(-1)  # [R*T]
    if not with_mask:
        return flat, None
    hidden = torch.arange(s if width is None else width, device=length.device) > at.unsqueeze(-1)  # [R, T, width]
    mask = torch.zeros(hidden.shape, dtype=dtype, device=length.device).masked_fill_(hidden, float("-inf"))
    return flat, mask.unsqueeze(1)


def fold_mask(mask: torch.Tensor, g: int) -> torch.Tensor:
    """``[R, 1, T, S]`` -> ``[R, 1, T*g, S]``: each token's row once per query head of a group, rows (t, g)."""
    r, _, t, s = mask.shape
    return mask.unsqueeze(3).expand(r, 1, t, g, s).reshape(r, 1, t * g, s)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up as one GEMM."""

    def __init__(self, cfg: LlamaConfig, **factory):
        super().__init__()
        d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_up_proj = FusedLinear(d, {"gate_proj": f, "up_proj": f}, bias, **factory)
        self.down_proj = nn.Linear(f, d, bias=bias, **factory)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, fold_gqa: bool = False, deterministic: bool = False, **factory):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.self_attn = Attention(cfg, fold_gqa, deterministic, **factory)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.mlp = MLP(cfg, **factory)

    def forward(self, x, cos, sin, kv, length, rows, index=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, length, rows, index)
        return x + self.mlp(self.post_attention_layernorm(x))

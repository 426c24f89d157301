"""A Llama-architecture decoder in PyTorch, written to run inside a burst graph.

One module for every family graphburst loads (Llama, Mistral, Qwen2/2.5, Qwen3; the
table is in ``llama_config.py``): they differ by config switches read in the layers
below (q/k/v biases, o_proj and MLP biases, per-head q/k RMSNorm), never by a copy of
this file. ``DecoderLM`` is the family-neutral name of :class:`Llama`.

Read top to bottom: RMSNorm, attention with a static KV cache, the SwiGLU MLP, the
decoder block, the model (the config is in ``llama_config.py``, RoPE with the ``llama3``
scaling in ``rope.py``; both re-exported here). It computes what
``transformers.LlamaForCausalLM`` computes (the tests check logits and greedy tokens
against it), with three differences that a captured burst needs:

* **Static shapes.** Every layer owns one preallocated KV tensor
  ``[2, batch, capacity + kv_slack, n_kv_heads, head_dim]``. The slack rows take the
  writes of a verify or draft chain that starts near the end of the cache (a slot whose
  budget ran out keeps rewriting the same rows), so no write is ever out of bounds.
* **Per-sequence lengths.** ``forward`` takes each layer's length ``[B] int32`` (owned by
  graphburst's ``KVCache``, rolled back by its kernel). Token t of sequence b is written
  at row ``length[b] + t`` with one ``index_copy_`` and attends to rows ``<= length[b] + t``
  through a boolean mask built with tensor ops, once per forward for all layers that share
  a length tensor. The caller advances the lengths.
* **Per-sequence positions.** RoPE reads ``start_pos[b] + t`` (graphburst's ``pos_ctr``),
  so a ragged batch needs no padding.

Every launch is a graph node and at batch 1 a layer's non-GEMM work is launch-bound, so
a layer is written to issue few kernels (``tests/test_llama_ops.py`` bounds the count):

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
* **An additive mask built once per forward** in the activations' dtype: SDPA would turn
  a boolean mask into the same ``0 / -inf`` tensor on every call.

Nothing in ``forward`` reads a tensor's value on the host, so it can be captured.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..constants import MAX_K
from . import llama_decode
from .llama_config import LLAMA3_KEYS, ROPE_TYPES, CheckpointError, LlamaConfig  # noqa: F401 (re-exported)
from .rope import apply_rope, rope_inv_freq, rope_rotation, rope_tables, rotate  # noqa: F401 (re-exported)

#: rows past ``capacity`` in every KV tensor: a chain of up to MAX_K drafts plus the
#: draft's extra append, started at the last valid row, stays in bounds.
DEFAULT_KV_SLACK = MAX_K + 2
#: KV rows per sequence are a multiple of this: SDPA's fused kernels then need no mask padding per call.
KV_ROW_MULTIPLE = 16
#: SDPA kernels for ``deterministic_attention``: torch's memory-efficient kernel (its forward
#: has no atomics; run over folded query groups, as it has no GQA path), math where it
#: cannot run (the CPU). cuDNN's attention, torch's default for bf16 on the H200, is not in
#: torch's deterministic set, and a replicated bf16 draft using it diverged across two GPUs.
DETERMINISTIC_SDPA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
#: ``Llama(decode_kernels=...)``: ``auto`` runs decode/verify forwards (T <= MAX_K + 1, all
#: rows) on the fused Triton kernels on CUDA and on SDPA elsewhere; ``triton`` and
#: ``reference`` force the fused path (the latter on its plain-torch references); ``off``
#: keeps SDPA everywhere. Prefill always runs SDPA. The fused path's projections run on the
#: weight-streaming GEMV at M = B * T <= ``llama_decode.GEMV_MAX_M`` rows under ``auto``
#: (``FORCED_GEMV_MAX_M`` under ``triton`` and ``reference``), on cuBLAS past it.
DECODE_KERNELS = ("auto", "triton", "reference", "off")


# ---------------------------------------------------------------------- layers

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
        rows : [R] int64 batch rows of x (all B in a burst, the prefilled slots in prefill)
        index : (flat [R*T] int64, mask [R, 1, T, S] or [R, 1, T*G, S] when folded, rotation), optional
            :func:`kv_index` of ``length`` in x's dtype (through :func:`fold_mask` when
            ``self.fold``) and :func:`rope_rotation` of ``cos, sin`` (``Llama.forward``
            builds them once per forward); built here when absent.
        """
        r, t, _ = x.shape
        h, kvh, hd = self.n_heads, self.n_kv, self.head_dim
        if index is None:
            flat, mask = kv_index(length, rows, t, kv.shape[2], x.dtype)
            index = (flat, fold_mask(mask, h // kvh) if self.fold else mask,
                     rope_rotation(cos.to(x.dtype), sin.to(x.dtype), h + kvh, kvh))
        flat, mask, rot = index
        # One GEMM for q, k, v; one rotation for all three (v by the identity): [R, T, H + 2 KV, D].
        qkv = self.qkv_proj(x).view(r, t, h + 2 * kvh, hd)
        if self.qk_norm:  # per head, before RoPE (HF Qwen3); v is not normalised
            q, k, v = qkv.split((h, kvh, kvh), dim=2)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=2)
        qkv = rotate(qkv, rot)
        # K and V sit side by side: one index_copy_ of the [2, R*T, KV, D] view into the flat cache.
        kv.view(2, -1, kvh, hd).index_copy_(1, flat, qkv[:, :, h:].reshape(r * t, 2, kvh, hd).transpose(0, 1))
        keys, vals = (kv[0], kv[1]) if r == kv.shape[1] else (kv[0, rows], kv[1, rows])  # [R, S, n_kv, D]
        q = qkv[:, :, :h]  # [R, T, H, D]
        # sdpa_kernel sets torch's process-wide backend flags; entered and left on the thread
        # that runs the model, and a captured graph keeps the kernel it chose.
        with contextlib.nullcontext() if self.backends is None else sdpa_kernel(self.backends):
            y = self._attend(q, keys, vals, mask, r, t)
        return self.o_proj(y.reshape(r, t, h * hd))

    def _attend(self, q, keys, vals, mask, r: int, t: int):
        """``[R, T, H, D]`` attention output of ``q [R, T, H, D]`` over ``keys``/``vals [R, S, KV, D]``."""
        h, kvh, hd = self.n_heads, self.n_kv, self.head_dim
        if self.fold:  # query head kv*G + g reads KV head kv (HF's repeat_kv order); rows ordered (t, g)
            g = h // kvh
            q = q.reshape(r, t, kvh, g, hd).transpose(1, 2).reshape(r, kvh, t * g, hd)  # [R, KV, T*G, D]
            y = F.scaled_dot_product_attention(q, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask)
            y = y.view(r, kvh, t, g, hd).transpose(1, 2)  # [R, T, KV, G, D]
        else:
            y = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                                               attn_mask=mask, enable_gqa=kvh != h).transpose(1, 2)  # [R, T, H, D]
        return y


def kv_index(length: torch.Tensor, rows: torch.Tensor, t: int, s: int,
             dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Where T new tokens go in a ``[2, B, S, ...]`` KV tensor, and what each may attend to.

    Parameters
    ----------
    length : [R] int32, valid rows before the call
    rows : [R] int64 batch rows
    t, s : int
        New tokens per row; rows per sequence in the KV tensor.
    dtype : torch.dtype
        Of the mask: the attention's query dtype.

    Returns
    -------
    flat : [R*T] int64
        Row of each new token in the flat ``[2, B*S, ...]`` view; clamped so a corrupt
        length still writes in bounds.
    mask : [R, 1, T, S] ``dtype``
        0 where token t of row r sees KV row s (``s <= length[r] + t``, rows already
        written), -inf elsewhere: the additive mask SDPA makes of a boolean one.
    """
    at = length.long().unsqueeze(1) + torch.arange(t, device=length.device)  # [R, T] row of each new token
    flat = (rows.unsqueeze(1) * s + at.clamp(max=s - 1)).reshape(-1)  # [R*T]
    hidden = torch.arange(s, device=length.device) > at.unsqueeze(-1)  # [R, T, S]
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


# ---------------------------------------------------------------------- the model

class Llama(nn.Module):
    """A Llama model with a static KV cache for ``batch`` sequences of ``capacity`` tokens.

    Parameters are created uninitialised (load a checkpoint, or call :meth:`init_random_`).
    Submodule names are HF's without the ``model.`` prefix.

    Parameters
    ----------
    cfg : LlamaConfig
    batch, capacity : int
        Sequences and KV entries per sequence that graphburst may use.
    dtype : torch.dtype
        Weights, activations and KV (fp32 or bf16); RoPE and norms compute in fp32.
    device : torch.device or str
    kv_slack : int
        Extra KV rows past ``capacity`` (see the module docstring), at least k + 2;
        rounded up so the row count is a multiple of ``KV_ROW_MULTIPLE``.
    fold_gqa : bool
        Attention over KV heads with the query groups folded into the query length
        (see :class:`Attention`); the same function, other SDPA shapes.
    deterministic_attention : bool
        Attention only through kernels that give the same bits on every run and GPU
        (``DETERMINISTIC_SDPA``, over folded groups): for a model that several ranks
        compute each on its own and must agree on (a replicated draft). Slower on the
        H200 than the default (cuDNN) kernel: ~21 vs ~9 µs per layer at T = 1.
    decode_kernels : str
        One of :data:`DECODE_KERNELS`: how forwards of T <= MAX_K + 1 tokens over all
        rows run (``models/llama_decode.py``: attention over each sequence's valid KV
        rows only, and a layer's non-GEMM work in a few fused kernels).
    """

    def __init__(self, cfg: LlamaConfig, *, batch: int, capacity: int, dtype=torch.float32, device="cpu",
                 kv_slack: int = DEFAULT_KV_SLACK, fold_gqa: bool = False, deterministic_attention: bool = False,
                 decode_kernels: str = "auto"):
        super().__init__()
        if decode_kernels not in DECODE_KERNELS:
            raise ValueError(f"decode_kernels must be one of {DECODE_KERNELS}, got {decode_kernels!r}")
        self.cfg, self.batch, self.capacity = cfg, batch, capacity
        self.vocab = cfg.vocab_size
        meta = {"device": "meta", "dtype": dtype}  # no init work; to_empty() places the storage
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **meta)
        self.layers = nn.ModuleList(Block(cfg, fold_gqa, deterministic_attention, **meta)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **meta)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                      **meta)
        self.to_empty(device=device)
        # Rounded up so SDPA's fused kernels need not pad the mask on every call.
        rows = -(-(capacity + kv_slack) // KV_ROW_MULTIPLE) * KV_ROW_MULTIPLE
        self.kv_slack = rows - capacity
        cos, sin = rope_tables(cfg, rows, device)
        self.register_buffer("rope_cos", cos, persistent=False)  # [capacity + slack, head_dim] float32
        self.register_buffer("rope_sin", sin, persistent=False)
        shape = (2, batch, rows, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]  # per layer, K then V
        self.decode_ops = self._decode_ops(decode_kernels, torch.device(device))  # None: SDPA only

    def _decode_ops(self, choice: str, device: torch.device):
        """The fused decode kernels this model runs (``decode_kernels``), or None for SDPA."""
        if choice == "off" or (choice == "auto" and (device.type != "cuda" or not llama_decode.triton_available())):
            return None
        why = llama_decode.unsupported(self)
        if why is not None:
            if choice == "auto":
                return None
            raise ValueError(f"decode_kernels={choice!r}: {why}")
        if choice == "reference":
            return llama_decode.reference_ops()
        return llama_decode.triton_ops(llama_decode.GEMV_MAX_M if choice == "auto" else llama_decode.FORCED_GEMV_MAX_M)

    def kv_layers(self) -> list[torch.Tensor | None]:
        """Each layer's KV storage (graphburst pairs each with a length it owns)."""
        return list(self.kv)

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor under its HF name (without ``model.``), fused projections cut into their parts.

        The values are detached views of this model's parameters (copying into one writes
        the parameter), in module order with a fused projection's parts in its row order
        (``q_proj``, ``k_proj``, ``v_proj``; each weight, then bias).
        """
        out = {}
        for prefix, mod in self.named_modules():
            own = {kind: p.detach() for kind, p in mod.named_parameters(recurse=False)}  # weight, then bias
            if isinstance(mod, FusedLinear):
                owner = prefix.rpartition(".")[0]
                cut = {kind: mod.split(p) for kind, p in own.items()}
                out.update({f"{owner}.{part}.{kind}": cut[kind][part] for part in mod.parts for kind in cut})
            else:
                out.update({f"{prefix}.{kind}" if prefix else kind: p for kind, p in own.items()})
        return out

    @torch.no_grad()
    def init_random_(self, seed: int = 0, std: float = 0.02) -> Llama:
        """Fill every weight from a seeded normal (norm weights 1), for tests and demos.

        Drawn per HF tensor, so the weights do not depend on which projections are fused.
        """
        gen = torch.Generator().manual_seed(seed)
        for name, t in self.hf_tensors().items():
            host = torch.ones(t.shape) if name.endswith("norm.weight") \
                else torch.randn(t.shape, generator=gen) * std
            t.copy_(host)
        return self

    def layer_inputs(self, start_pos: torch.Tensor, lengths, rows: torch.Tensor, t: int, dtype) -> list[tuple]:
        """What every layer's attention needs, built once per forward instead of once per layer.

        RoPE rotations depend only on the positions; KV write rows and masks only on a
        layer's length tensor, so layers sharing one (graphburst's adapter gives every
        layer the same) share them. A layer stack outside :meth:`forward` (a pipeline
        stage) passes these as each ``Block``'s ``index``.

        Parameters
        ----------
        start_pos : [R] int32 or int64
        lengths : sequence of [R] int32, one per layer of this model
        rows : [R] int64
        t : int
        dtype : torch.dtype
            The activations'.

        Returns
        -------
        list of (flat, mask, rotation), one per layer (see :class:`Attention`)
        """
        if not len(self.layers):
            return []
        attn = self.layers[0].self_attn
        pos = (start_pos.long().unsqueeze(1) + torch.arange(t, device=start_pos.device)).clamp(
            0, self.rope_cos.shape[0] - 1)  # [R, T]
        # Cast once per forward, as HF casts cos/sin to the activations' dtype.
        cos, sin = self.rope_cos[pos].to(dtype), self.rope_sin[pos].to(dtype)  # [R, T, head_dim]
        rot = rope_rotation(cos, sin, attn.n_heads + attn.n_kv, attn.n_kv)
        s = self.kv[0].shape[2]
        shared, out = {}, []
        for length in lengths:
            if id(length) not in shared:
                flat, mask = kv_index(length, rows, t, s, dtype)
                shared[id(length)] = (flat, fold_mask(mask, attn.n_heads // attn.n_kv) if attn.fold else mask, rot)
            out.append(shared[id(length)])
        return out

    #: forward takes ``logits_at``: prefill then computes the head at one position per row only.
    accepts_logits_at = True
    #: forward takes ``head=False``: a prompt's non-final chunk then writes KV and skips norm and head.
    accepts_head = True

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, lengths, rows: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, head: bool = True):
        """Logits after each token; writes the tokens' KV, never moves a length.

        Parameters
        ----------
        tokens : [R, T] int64, valid ids
        start_pos : [R] int32 or int64, position of ``tokens[:, 0]``
        lengths : sequence of [R] int32, one per layer: valid KV rows before the call
        rows : [R] int64 batch rows, or None for all B (R = B; the captured case)
        logits_at : [R] int64, optional
            Only the logits after token ``logits_at[r]`` of each row (a long prompt's
            ``[R, T, vocab]`` would be large).
        head : bool
            False: only write the KV (a prompt chunk whose logits nobody reads) and return None.

        Returns
        -------
        [R, T, vocab] float32, or [R, 1, vocab] with ``logits_at``, or None without ``head``
        """
        r, t = tokens.shape
        if self.decode_ops is not None and rows is None and logits_at is None and head and t <= MAX_K + 1:
            return llama_decode.fused_forward(self, tokens, start_pos, lengths, self.decode_ops)
        if rows is None:
            rows = torch.arange(r, device=tokens.device)
        x = self.embed_tokens(tokens)
        for layer, kv, length, index in zip(self.layers, self.kv, lengths,
                                            self.layer_inputs(start_pos, lengths, rows, t, x.dtype)):
            x = layer(x, None, None, kv, length, rows, index)
        if not head:
            return None
        if logits_at is not None:
            x = x[torch.arange(r, device=x.device), logits_at].unsqueeze(1)  # [R, 1, hidden]
        return F.linear(self.norm(x), self.head_weight()).float()

    @torch.no_grad()
    def greedy(self, prompt, n: int, row: int = 0) -> list[int]:
        """The greedy continuation of ``prompt``, re-running the whole prefix for every token.

        A reference that shares no incremental state with the burst: no KV reuse, no
        speculation. It overwrites the KV entries of batch row ``row``, so call it only
        while that slot holds nothing you still need (after decoding, in tests and the demo).
        """
        device = self.rope_cos.device
        seq = [int(t) for t in prompt]
        rows = torch.tensor([row], device=device)
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        for _ in range(n):
            tokens = torch.tensor([seq], device=device)
            last = torch.tensor([len(seq) - 1], device=device)
            logits = self(tokens, zero, [zero] * len(self.layers), rows, logits_at=last)
            seq.append(int(logits[0, -1].argmax()))
        return seq[len(prompt):]


#: the family-neutral name: the same class computes every architecture of ``llama_config.ARCHITECTURES``
DecoderLM = Llama

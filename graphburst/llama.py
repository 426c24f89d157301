"""A Llama-architecture model in PyTorch, written to run inside a burst graph.

Read top to bottom: the config, RoPE (with the ``llama3`` scaling), RMSNorm, attention
with a static KV cache, the SwiGLU MLP, the decoder block, the model. It computes what
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

Nothing in ``forward`` reads a tensor's value on the host, so it can be captured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from .constants import MAX_K

#: rows past ``capacity`` in every KV tensor: a chain of up to MAX_K drafts plus the
#: draft's extra append, started at the last valid row, stays in bounds.
DEFAULT_KV_SLACK = MAX_K + 2
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class LlamaConfig:
    """The Hugging Face ``LlamaConfig`` fields this model uses (same names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None)  # {"rope_type": "llama3", *LLAMA3_KEYS} or None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        """Read a ``config.json`` dict (transformers 4 ``rope_theta``/``rope_scaling`` or 5 ``rope_parameters``).

        Raises
        ------
        ValueError
            Naming the key that is missing or holds an unsupported value.
        """
        if cfg.get("model_type", "llama") != "llama":
            raise ValueError(f"config.json: model_type must be 'llama', got {cfg.get('model_type')!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act must be 'silu', got {cfg.get('hidden_act')!r}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        for key in required:
            if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool) or cfg[key] < 1:
                raise ValueError(f"config.json: {key} must be a positive int, got {cfg.get(key)!r}")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"config.json: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = rope or cfg.get("rope_scaling")
        if scaling:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                raise ValueError(f"config.json: rope type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
            if rope_type == "default":
                scaling = None
            else:
                missing = [k for k in LLAMA3_KEYS if k not in scaling]
                if missing:
                    raise ValueError(f"config.json: llama3 rope scaling lacks {missing[0]!r}")
                scaling = {"rope_type": "llama3", **{k: scaling[k] for k in LLAMA3_KEYS}}
        return cls(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                   intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)))

    def replace(self, **changes) -> LlamaConfig:
        return LlamaConfig(**{f.name: changes.get(f.name, getattr(self, f.name)) for f in fields(self)})


# ---------------------------------------------------------------------- RoPE

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

    ``forward`` passes ``cos, sin`` already in ``x``'s dtype (cast once per forward, as HF
    does), so the casts here are no-ops and launch nothing.
    """
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ---------------------------------------------------------------------- layers

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **factory):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, as HF does, then cast back. F.rms_norm is HF's
        # x * rsqrt(mean(x^2) + eps) in one call (one fused kernel on recent CUDA builds
        # instead of four, which matters at B=1 where every launch is a graph node).
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention over a static per-layer KV tensor."""

    def __init__(self, cfg: LlamaConfig, **factory):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=bias, **factory)

    def forward(self, x, cos, sin, kv, length, rows, index=None):
        """
        Parameters
        ----------
        x : [R, T, hidden]
        cos, sin : [R, T, head_dim] float32 (or x's dtype)
        kv : [2, B, S, n_kv, head_dim], written at rows ``length + [0, T)``
        length : [R] int32, valid rows before this call
        rows : [R] int64 batch rows of x (all B in a burst, the prefilled slots in prefill)
        index : (flat [R*T] int64, mask [R, 1, T, S] bool), optional
            :func:`kv_index` of ``length`` (``Llama.forward`` builds it once for every
            layer that shares a length tensor); built here when absent.
        """
        r, t, _ = x.shape
        q = self.q_proj(x).view(r, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(r, t, self.n_kv, self.head_dim)
        # One rotation for q and k together (elementwise, so bit-identical to two): fewer launches.
        qk = apply_rope(torch.cat((q, k), dim=2), cos, sin)  # [R, T, n_heads + n_kv, head_dim]
        q, k = qk[:, :, : self.n_heads], qk[:, :, self.n_heads:]
        v = self.v_proj(x).view(r, t, self.n_kv, self.head_dim)
        flat, mask = kv_index(length, rows, t, kv.shape[2]) if index is None else index
        # One index_copy_ into the flat [2, B*S, ...] view.
        kv.view(2, -1, self.n_kv, self.head_dim).index_copy_(1, flat, torch.stack((k, v)).view(2, r * t, self.n_kv,
                                                                                               self.head_dim))
        keys, vals = (kv[0], kv[1]) if r == kv.shape[1] else (kv[0, rows], kv[1, rows])  # [R, S, n_kv, D]
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                                           attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(r, t, self.n_heads * self.head_dim))


def kv_index(length: torch.Tensor, rows: torch.Tensor, t: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where T new tokens go in a ``[2, B, S, ...]`` KV tensor, and what each may attend to.

    Parameters
    ----------
    length : [R] int32, valid rows before the call
    rows : [R] int64 batch rows
    t, s : int
        New tokens per row; rows per sequence in the KV tensor.

    Returns
    -------
    flat : [R*T] int64
        Row of each new token in the flat ``[2, B*S, ...]`` view; clamped so a corrupt
        length still writes in bounds.
    mask : [R, 1, T, S] bool
        Token t of row r sees KV rows ``<= length[r] + t`` (those already written).
    """
    at = length.long().unsqueeze(1) + torch.arange(t, device=length.device)  # [R, T] row of each new token
    flat = (rows.unsqueeze(1) * s + at.clamp(max=s - 1)).reshape(-1)  # [R*T]
    mask = torch.arange(s, device=length.device) <= at.unsqueeze(-1)  # [R, T, S]
    return flat, mask.unsqueeze(1)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig, **factory):
        super().__init__()
        d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=bias, **factory)
        self.up_proj = nn.Linear(d, f, bias=bias, **factory)
        self.down_proj = nn.Linear(f, d, bias=bias, **factory)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, **factory):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.self_attn = Attention(cfg, **factory)
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
        rounded up so the row count is a multiple of 16.
    """

    def __init__(self, cfg: LlamaConfig, *, batch: int, capacity: int, dtype=torch.float32, device="cpu",
                 kv_slack: int = DEFAULT_KV_SLACK):
        super().__init__()
        self.cfg, self.batch, self.capacity = cfg, batch, capacity
        self.vocab = cfg.vocab_size
        meta = {"device": "meta", "dtype": dtype}  # no init work; to_empty() places the storage
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **meta)
        self.layers = nn.ModuleList(Block(cfg, **meta) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **meta)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                      **meta)
        self.to_empty(device=device)
        # Rounded up to a multiple of 16 so SDPA's fused kernels need not pad the mask on every call.
        rows = -(-(capacity + kv_slack) // 16) * 16
        self.kv_slack = rows - capacity
        cos, sin = rope_tables(cfg, rows, device)
        self.register_buffer("rope_cos", cos, persistent=False)  # [capacity + slack, head_dim] float32
        self.register_buffer("rope_sin", sin, persistent=False)
        shape = (2, batch, rows, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]  # per layer, K then V

    def kv_layers(self) -> list[torch.Tensor | None]:
        """Each layer's KV storage (graphburst pairs each with a length it owns)."""
        return list(self.kv)

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def init_random_(self, seed: int = 0, std: float = 0.02) -> Llama:
        """Fill every weight from a seeded normal (norm weights 1), for tests and demos."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            host = torch.ones(p.shape) if name.endswith("layernorm.weight") or name == "norm.weight" \
                else torch.randn(p.shape, generator=gen) * std
            p.copy_(host)
        return self

    #: forward takes ``logits_at``: prefill then computes the head at one position per row only.
    accepts_logits_at = True

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, lengths, rows: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None):
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

        Returns
        -------
        [R, T, vocab] float32, or [R, 1, vocab] with ``logits_at``
        """
        r, t = tokens.shape
        if rows is None:
            rows = torch.arange(r, device=tokens.device)
        pos = (start_pos.long().unsqueeze(1) + torch.arange(t, device=tokens.device)).clamp(
            0, self.rope_cos.shape[0] - 1)  # [R, T]
        x = self.embed_tokens(tokens)
        # Cast once per forward (HF casts cos/sin to the activations' dtype too), not per layer.
        cos, sin = self.rope_cos[pos].to(x.dtype), self.rope_sin[pos].to(x.dtype)  # [R, T, head_dim]
        # KV write rows and attention masks depend only on a layer's length tensor: build
        # them once per distinct tensor (graphburst's adapter gives every layer the same one).
        s = self.kv[0].shape[2] if self.kv else 0
        index = {}
        for layer, kv, length in zip(self.layers, self.kv, lengths):
            if id(length) not in index:
                index[id(length)] = kv_index(length, rows, t, s)
            x = layer(x, cos, sin, kv, length, rows, index[id(length)])
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

"""The Llama config graphburst's model reads: HF's ``config.json`` field names, every key checked.

:meth:`LlamaConfig.from_hf` reads transformers 4 (``rope_theta``/``rope_scaling``) and 5
(``rope_parameters``) files and raises ``ValueError`` naming the key and the value for
anything malformed, before a tensor is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    """A finite JSON number (``true`` is not one)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
            if not _is_int(cfg.get(key)) or cfg[key] < 1:
                raise ValueError(f"config.json: {key} must be a positive int, got {cfg.get(key)!r}")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads")
        if kv_heads is None:
            kv_heads = heads  # HF's default: multi-head attention
        elif not _is_int(kv_heads) or kv_heads < 1:
            raise ValueError(f"config.json: num_key_value_heads must be a positive int, got {kv_heads!r}")
        if heads % kv_heads:
            raise ValueError(f"config.json: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            if cfg["hidden_size"] % heads:
                raise ValueError(f"config.json: hidden_size {cfg['hidden_size']} is not a multiple of "
                                 f"num_attention_heads {heads} (and head_dim is absent)")
            head_dim = cfg["hidden_size"] // heads
        elif not _is_int(head_dim) or head_dim < 2 or head_dim % 2:
            raise ValueError(f"config.json: head_dim must be a positive even int (RoPE rotates half-heads), "
                             f"got {head_dim!r}")
        if head_dim % 2:
            raise ValueError(f"config.json: head_dim hidden_size / num_attention_heads = {head_dim} is odd "
                             f"(RoPE rotates half-heads)")
        eps = cfg.get("rms_norm_eps", 1e-6)
        if not _is_real(eps) or not 0 < eps < 1:
            raise ValueError(f"config.json: rms_norm_eps must be a number in (0, 1), got {eps!r}")
        rope = cfg.get("rope_parameters")  # transformers >= 5
        if rope is not None and not isinstance(rope, dict):
            raise ValueError(f"config.json: rope_parameters must be an object, got {rope!r}")
        rope = dict(rope or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        if not _is_real(theta) or not theta > 0:
            raise ValueError(f"config.json: rope_theta must be a positive number, got {theta!r}")
        scaling = rope or cfg.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ValueError(f"config.json: rope_scaling must be an object or null, got {scaling!r}")
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
                for k in LLAMA3_KEYS:
                    if not _is_real(scaling[k]) or not scaling[k] > 0:
                        raise ValueError(f"config.json: llama3 rope scaling {k} must be a positive number, "
                                         f"got {scaling[k]!r}")
                if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
                    raise ValueError(f"config.json: llama3 rope scaling high_freq_factor {scaling['high_freq_factor']!r} "
                                     f"must exceed low_freq_factor {scaling['low_freq_factor']!r}")
                scaling = {"rope_type": "llama3", **{k: scaling[k] for k in LLAMA3_KEYS}}
        for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            if not isinstance(cfg.get(key, False), bool):
                raise ValueError(f"config.json: {key} must be true or false, got {cfg[key]!r}")
        return cls(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                   intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                   rms_norm_eps=float(eps), rope_theta=float(theta), rope_scaling=scaling,
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)))

    def replace(self, **changes) -> LlamaConfig:
        return LlamaConfig(**{f.name: changes.get(f.name, getattr(self, f.name)) for f in fields(self)})

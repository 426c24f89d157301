"""The config graphburst's decoder reads: HF's ``config.json`` field names, every key checked.

One model module (``llama.py``) computes four Hugging Face architectures; what differs
between them is a few switches of :class:`LlamaConfig`, set here from the checkpoint:

=====================  ==========  ==================================================
``architectures``      model_type  switches
=====================  ==========  ==================================================
LlamaForCausalLM       llama       ``attention_bias`` (q, k, v, o), ``mlp_bias``
MistralForCausalLM     mistral     none (Llama's function); ``sliding_window`` must be null
Qwen2ForCausalLM       qwen2       ``qkv_bias`` always (o_proj none); no sliding window
Qwen3ForCausalLM       qwen3       ``qk_norm`` (RMSNorm over each q and k head before
                                   RoPE), ``attention_bias``; no sliding window
=====================  ==========  ==================================================

:meth:`LlamaConfig.from_hf` reads transformers 4 (``rope_theta``/``rope_scaling``) and 5
(``rope_parameters``) files. The architecture comes from ``architectures`` and
``model_type`` (they must agree; a file with neither is read as Llama). Anything it
cannot compute exactly (another architecture, a sliding window, logit soft-capping, a
partial rotary, a key transformers ignores for that family but which would change the
function elsewhere) raises :class:`CheckpointError` naming the key and the value,
before a tensor is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
#: HF architecture name -> its model_type: the families this module computes
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
#: bias keys that transformers reads, per family (the others hard-code their biases: a
#: ``true`` there would describe tensors transformers never loads)
BIAS_KEYS = {"llama": ("attention_bias", "mlp_bias"), "mistral": (), "qwen2": (), "qwen3": ("attention_bias",)}
#: keys of other architectures that change the function, with the value that leaves it
#: unchanged; any other value is refused (a mislabelled or unsupported checkpoint)
NEUTRAL = {"attn_logit_softcapping": None, "final_logit_softcapping": None, "partial_rotary_factor": 1.0,
           "use_qk_norm": False, "attention_chunk_size": None, "query_pre_attn_scalar": None,
           "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0,
           "attention_multiplier": None, "no_rope_layers": None}
FULL_ATTENTION = "full_attention"  # the one entry of ``layer_types`` supported


class CheckpointError(ValueError):
    """A checkpoint graphburst cannot load; the message is one line naming the file and the key.

    The commands print it as one line and exit 2 (no traceback).
    """


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    """A finite JSON number (``true`` is not one)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_family(cfg: dict, source: str = "config.json") -> str:
    """The model_type of a config dict, from ``architectures`` and ``model_type`` (checked to agree).

    Raises
    ------
    CheckpointError
        For an unsupported architecture or model_type (naming the supported ones), or a
        disagreement between the two keys.
    """
    supported = ", ".join(ARCHITECTURES)
    archs, model_type = cfg.get("architectures"), cfg.get("model_type")
    if archs is not None:
        if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
            raise CheckpointError(f"{source}: architectures must be a list of one name, got {archs!r}")
        if archs[0] not in ARCHITECTURES:
            raise CheckpointError(f"{source}: architectures {archs[0]!r} is not supported (supported: {supported})")
        family = ARCHITECTURES[archs[0]]
        if model_type is not None and model_type != family:
            raise CheckpointError(f"{source}: model_type {model_type!r} does not match architectures {archs[0]!r} "
                                  f"(expected {family!r})")
        return family
    if model_type is None:
        return "llama"  # a hand-written config with neither key: graphburst's historical default
    if model_type not in BIAS_KEYS:
        raise CheckpointError(f"{source}: model_type {model_type!r} is not supported (supported: "
                              f"{', '.join(BIAS_KEYS)}; architectures {supported})")
    return model_type


def check_window(cfg: dict, family: str, source: str = "config.json") -> None:
    """Refuse a sliding window or any layer that is not full attention (not implemented here)."""
    if family in ("qwen2", "qwen3"):
        # Qwen configs carry a window size even when it is off; use_sliding_window decides.
        if cfg.get("use_sliding_window", False) is not False:
            raise CheckpointError(f"{source}: use_sliding_window {cfg['use_sliding_window']!r} is not supported "
                                  f"(sliding-window attention is not implemented; only false)")
    elif cfg.get("sliding_window") is not None or cfg.get("use_sliding_window", False) is not False:
        key = "sliding_window" if cfg.get("sliding_window") is not None else "use_sliding_window"
        raise CheckpointError(f"{source}: {key} {cfg[key]!r} is not supported (sliding-window attention is not "
                              f"implemented; only null)")
    types = cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or any(t != FULL_ATTENTION for t in types)):
        bad = types if not isinstance(types, list) else next(t for t in types if t != FULL_ATTENTION)
        raise CheckpointError(f"{source}: layer_types entry {bad!r} is not supported (only {FULL_ATTENTION!r})")


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
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2); attention_bias puts them on o_proj too
    qk_norm: bool = False  # RMSNorm over each q and k head (weights [head_dim]) before RoPE (Qwen3)
    model_type: str = "llama"  # the HF family it was read from (messages, the bench's transformers twin; no layer reads it)
    max_position_embeddings: int | None = None  # trained positions (None: not stated); caps auto KV sizing

    def kv_bytes_per_row(self, dtype_bytes: int) -> int:
        """KV bytes one sequence's cache takes per token row: layers x (K and V) x KV heads x head_dim x dtype.

        The head size is ``head_dim``, which Qwen3 states apart from ``hidden_size / heads``.
        """
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * int(dtype_bytes)

    def activation_bytes_per_token(self, dtype_bytes: int) -> int:
        """An upper estimate of one forward's live activations per token, in bytes (for KV sizing).

        Counted in elements of the activations' dtype: the residual stream, its norm, the
        attention output and the o_proj output (4 x hidden); the MLP's gate/up GEMM output,
        SiLU(gate) and its product with up (4 x intermediate, one spare); q, k, v, the
        RoPE product that :func:`~graphburst.models.rope.rotate` sums (twice their size),
        the rotated copy, the per-forward rotation matrices and, for Qwen3, the q/k-norm
        copy (8 x (heads + 2 KV heads) x head_dim). Attention peaks and MLP peaks do not
        coexist; adding them is the margin. Scores are not counted: SDPA's fused kernels
        and the Triton decode kernels never materialise them on the GPU.
        """
        qkv = (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
        return int(dtype_bytes) * (4 * self.hidden_size + 4 * self.intermediate_size + 8 * qkv)

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> LlamaConfig:
        """Read a ``config.json`` dict (transformers 4 ``rope_theta``/``rope_scaling`` or 5 ``rope_parameters``).

        Raises
        ------
        CheckpointError (a ValueError)
            Naming ``source`` and the key that is missing or holds an unsupported value.
        """
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source}: must hold a JSON object, got {type(cfg).__name__}")
        family = read_family(cfg, source)
        check_window(cfg, family, source)
        for key, neutral in NEUTRAL.items():
            if cfg.get(key, neutral) != neutral:
                raise CheckpointError(f"{source}: {key} {cfg[key]!r} is not supported (graphburst computes "
                                      f"{', '.join(ARCHITECTURES)}; only {neutral!r})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: hidden_act must be 'silu', got {cfg.get('hidden_act')!r}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        for key in required:
            if not _is_int(cfg.get(key)) or cfg[key] < 1:
                raise CheckpointError(f"{source}: {key} must be a positive int, got {cfg.get(key)!r}")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads")
        if kv_heads is None and family != "llama":
            # transformers reads a missing key as its class default (8 for Mistral, 32 for Qwen2 and
            # Qwen3), not as multi-head attention: refuse rather than guess which the weights have.
            raise CheckpointError(f"{source}: num_key_value_heads is missing; a {family} config must give it")
        if kv_heads is None:
            kv_heads = heads  # LlamaConfig's default: multi-head attention
        elif not _is_int(kv_heads) or kv_heads < 1:
            raise CheckpointError(f"{source}: num_key_value_heads must be a positive int, got {kv_heads!r}")
        if heads % kv_heads:
            raise CheckpointError(f"{source}: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        head_dim = cfg.get("head_dim")
        if head_dim is None and family == "qwen3":
            # transformers' Qwen3Config defaults it to 128, not hidden / heads: say so rather than guess.
            raise CheckpointError(f"{source}: head_dim is missing (Qwen3 configs state it; transformers would assume "
                                  f"128)")
        if head_dim is None:
            if cfg["hidden_size"] % heads:
                raise CheckpointError(f"{source}: hidden_size {cfg['hidden_size']} is not a multiple of "
                                 f"num_attention_heads {heads} (and head_dim is absent)")
            head_dim = cfg["hidden_size"] // heads
        elif not _is_int(head_dim) or head_dim < 2 or head_dim % 2:
            raise CheckpointError(f"{source}: head_dim must be a positive even int (RoPE rotates half-heads), "
                             f"got {head_dim!r}")
        if head_dim % 2:
            raise CheckpointError(f"{source}: head_dim hidden_size / num_attention_heads = {head_dim} is odd "
                             f"(RoPE rotates half-heads)")
        eps = cfg.get("rms_norm_eps", 1e-6)
        if not _is_real(eps) or not 0 < eps < 1:
            raise CheckpointError(f"{source}: rms_norm_eps must be a number in (0, 1), got {eps!r}")
        rope = cfg.get("rope_parameters")  # transformers >= 5
        if rope is not None and not isinstance(rope, dict):
            raise CheckpointError(f"{source}: rope_parameters must be an object, got {rope!r}")
        rope = dict(rope or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        if not _is_real(theta) or not theta > 0:
            raise CheckpointError(f"{source}: rope_theta must be a positive number, got {theta!r}")
        scaling = rope or cfg.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise CheckpointError(f"{source}: rope_scaling must be an object or null, got {scaling!r}")
        if scaling:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
            if rope_type == "default":
                scaling = None
            else:
                missing = [k for k in LLAMA3_KEYS if k not in scaling]
                if missing:
                    raise CheckpointError(f"{source}: llama3 rope scaling lacks {missing[0]!r}")
                for k in LLAMA3_KEYS:
                    if not _is_real(scaling[k]) or not scaling[k] > 0:
                        raise CheckpointError(f"{source}: llama3 rope scaling {k} must be a positive number, "
                                         f"got {scaling[k]!r}")
                if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
                    raise CheckpointError(f"{source}: llama3 rope scaling high_freq_factor {scaling['high_freq_factor']!r} "
                                     f"must exceed low_freq_factor {scaling['low_freq_factor']!r}")
                scaling = {"rope_type": "llama3", **{k: scaling[k] for k in LLAMA3_KEYS}}
        for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            if not isinstance(cfg.get(key, False), bool):
                raise CheckpointError(f"{source}: {key} must be true or false, got {cfg[key]!r}")
            if key != "tie_word_embeddings" and cfg.get(key) and key not in BIAS_KEYS[family]:
                raise CheckpointError(f"{source}: {key} true is not supported for model_type {family!r} "
                                      f"(transformers ignores it there; its biases are fixed)")
        max_pos = cfg.get("max_position_embeddings")
        if max_pos is not None and (not _is_int(max_pos) or max_pos < 1):
            raise CheckpointError(f"{source}: max_position_embeddings must be a positive int, got {max_pos!r}")
        return cls(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                   intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                   rms_norm_eps=float(eps), rope_theta=float(theta), rope_scaling=scaling,
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
                   qkv_bias=family == "qwen2", qk_norm=family == "qwen3", model_type=family,
                   max_position_embeddings=max_pos)

    def replace(self, **changes) -> LlamaConfig:
        return LlamaConfig(**{f.name: changes.get(f.name, getattr(self, f.name)) for f in fields(self)})

"""The models of ``graphburst bench real``: random Llama and Qwen3 targets, their early-exit
drafts, the ε knob that sets acceptance, and transformers twins built from the same tensors.

* **Target**: a :class:`~graphburst.models.llama.Llama` with random weights made on the device
  (normal, std 0.02; norm weights 1). Nothing is downloaded.
* **Draft**: the target's first ``draft_layers`` blocks plus its embeddings, final norm
  and head: the *same* parameter tensors (no copy), with its own KV cache.
* **ε**: the target's blocks past the draft's have their residual-branch output
  projections (``o_proj``, ``down_proj``) set to ε x their initial values. ε = 0 makes
  the target compute the draft's function (acceptance near 1); larger ε makes them
  disagree more. :class:`Epsilon` rewrites the weights in place, so captured graphs stay
  valid across a sweep.
* **Instances**: every engine needs its own KV cache, so :func:`instance` builds a
  ``Llama`` whose modules are the shared ones and whose ``kv`` is new.
* **A draft of another shape** (``ModelSpec.draft_cfg``: a Qwen3-0.6B-shaped draft for a
  Qwen3-8B-shaped target): :func:`subspace_draft`. Independent random models would never
  agree, so the target holds the draft's embeddings and head in its first columns (zeros
  elsewhere) and the draft's blocks write nothing to its residual stream: at ε = 0 both
  compute the same bigram function (target logits = sqrt(d_target / d_draft) x the
  draft's), and ε moves the target away as before (every target block is scaled). Every
  layer of both runs at full size, so the timing is the shapes'.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..models.llama import Llama
from ..models.llama_config import LlamaConfig

INIT_STD = 0.02
LLAMA32_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


# Llama-3.2-1B's shape.
LLAMA_1B = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                       rope_theta=500000.0, rope_scaling=LLAMA32_ROPE, tie_word_embeddings=True)
# SmolLM2-135M's shape: 9 query heads over 3 KV heads (GQA 3:1, a group that is not a power of two), hidden
# 576 (not a multiple of the GEMV's 256-wide K tiles), a tied 49152-token head.
SMOLLM2_135M = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                           rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192)
QWEN3 = dict(rope_theta=1e6, qk_norm=True, model_type="qwen3", rms_norm_eps=1e-6)
QWEN3_TINY = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True, **QWEN3)
QWEN3_06B = LlamaConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, **QWEN3)
QWEN3_8B = LlamaConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, **QWEN3)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: the target's config and the draft's depth."""

    name: str
    cfg: LlamaConfig
    draft_layers: int  # the self-draft's depth; 0 with draft_cfg (then every target block is scaled by ε)
    note: str
    draft_cfg: LlamaConfig | None = None  # a draft of its own shape (subspace_draft)


MODELS = {
    # CI/smoke size: every code path, seconds on a CPU.
    "tiny": ModelSpec("tiny", LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                      2, "4 layers, d=64, 4 q / 2 KV heads, FFN 128, vocab 512, untied head"),
    # Launch- and sync-bound regime. 4 KV heads (GQA 3:1, as Llama-family models use).
    "small": ModelSpec("small", LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=3072,
                                            num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                                            head_dim=64, rms_norm_eps=1e-5),
                       2, "12 layers, d=768, 12 q / 4 KV heads, FFN 3072, vocab 32000, untied head"),
    # A small real model's shape: its 270 MB of weights take 56 µs at 4.8 TB/s, so at B = 1 the launches and
    # ramp-ups of ~10 kernels in each of 30 layers are a large part of the forward.
    "smollm2": ModelSpec("smollm2", SMOLLM2_135M,
                         2, "SmolLM2-135M shape: 30 layers, d=576, 9 q / 3 KV heads of 64, FFN 1536, vocab 49152, "
                            "tied embeddings"),
    "1b": ModelSpec("1b", LLAMA_1B,
                    2, "Llama-3.2-1B shape: 16 layers, d=2048, 32 q / 8 KV heads, FFN 8192, vocab 128256, "
                       "tied embeddings, llama3 rope"),
    # Llama-3.1-8B's shape with a Llama-3.2-1B-shaped draft (subspace_draft): the 8b/1b pair.
    "8b": ModelSpec("8b", LLAMA_1B.replace(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                           head_dim=128, tie_word_embeddings=False,
                                           rope_scaling=LLAMA32_ROPE | {"factor": 8.0}),  # Llama-3.1's
                    0, "Llama-3.1-8B shape: 32 layers, d=4096, 32 q / 8 KV heads of 128, FFN 14336, vocab 128256, "
                       "untied, llama3 rope; Llama-3.2-1B-shaped draft", draft_cfg=LLAMA_1B),
    # CI/smoke size of the Qwen3 path: q/k norms, head_dim 24 != 64 / 4, tied head.
    "qwen3-tiny": ModelSpec("qwen3-tiny", QWEN3_TINY, 2, "Qwen3 switches at CI size: 4 layers, d=64, 4 q / 2 KV "
                                                         "heads of 24, q/k norms, FFN 128, vocab 512, tied"),
    # Qwen3-0.6B's shape (head_dim 128 with hidden 1024: 16 x 128 = 2048 != 1024).
    "qwen3-0.6b": ModelSpec("qwen3-0.6b", QWEN3_06B, 2, "Qwen3-0.6B shape: 28 layers, d=1024, 16 q / 8 KV heads "
                                                        "of 128, q/k norms, FFN 3072, vocab 151936, tied"),
    # Qwen3-8B's shape with a Qwen3-0.6B-shaped draft (subspace_draft).
    "qwen3-8b": ModelSpec("qwen3-8b", QWEN3_8B, 0, "Qwen3-8B shape: 36 layers, d=4096, 32 q / 8 KV heads of 128, "
                                                   "q/k norms, FFN 12288, vocab 151936, untied; Qwen3-0.6B-shaped draft",
                          draft_cfg=QWEN3_06B),
    # CI size of the same construction: a 2-layer d=32 draft under the 4-layer d=64 qwen3-tiny.
    "qwen3-tiny-pair": ModelSpec("qwen3-tiny-pair", QWEN3_TINY.replace(tie_word_embeddings=False), 0,
                                 "qwen3-tiny target (untied) with a 2-layer d=32 draft of its own shape",
                                 draft_cfg=QWEN3_TINY.replace(hidden_size=32, num_hidden_layers=2)),
}


def run_bytes(spec: ModelSpec, *, batch: int, capacity: int, k: int, prompt_len: int, item: int, engines: int) -> int:
    """Memory a benchmark run of ``spec`` at ``batch`` takes, beyond the weights.

    Every engine holds a target and a draft KV cache (``[2, batch, capacity + slack,
    kv_heads, head_dim]`` per layer, ``item`` bytes an entry) and float32 logits of the
    ``k + 1`` verified positions; the prompt pool holds ``batch x prompt_len`` int64.
    """
    cfg = spec.cfg
    kv_row = (capacity + k + 2) * (cfg.num_hidden_layers + spec.draft_layers) * 2 * cfg.num_key_value_heads \
        * cfg.head_dim * item
    return engines * batch * (kv_row + (k + 1) * cfg.vocab_size * 4) + batch * prompt_len * 8


@torch.no_grad()
def random_target(spec: ModelSpec, *, batch: int, capacity: int, kv_slack: int, dtype, device, seed: int = 0,
                  fold_gqa: bool = False, cfg: LlamaConfig | None = None, decode_kernels: str = "auto") -> Llama:
    """The target with seeded random weights drawn on ``device`` (fast even for 1B); ``fold_gqa`` and
    ``decode_kernels`` as in :class:`Llama`.

    ``cfg``: another config than ``spec.cfg`` (the draft of :func:`subspace_draft`).
    """
    model = Llama(cfg or spec.cfg, batch=batch, capacity=capacity, dtype=dtype, device=device, kv_slack=kv_slack,
                  fold_gqa=fold_gqa, decode_kernels=decode_kernels)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.hf_tensors().items():  # per HF tensor: the same draws as before q/k/v and gate/up fused
        if name.endswith("norm.weight"):  # every RMSNorm: layer norms, final norm, Qwen3's q/k norms
            p.fill_(1.0)
        else:
            p.normal_(0.0, INIT_STD, generator=gen)
    return model


@torch.no_grad()
def subspace_draft(target: Llama, spec: ModelSpec, *, seed: int = 0, decode_kernels: str = "auto") -> Llama:
    """A random draft of shape ``spec.draft_cfg`` that ``target`` computes exactly at ε = 0 (module docstring),
    on ``decode_kernels`` (:class:`Llama`'s).

    Rewrites ``target``'s embeddings and head: columns ``[0, d_draft)`` become the draft's
    (its tied embedding table when it ties), the rest zeros; zeroes the draft blocks'
    residual outputs (``o_proj``, ``down_proj``). Call :class:`Epsilon` (with
    ``draft_layers`` 0) afterwards.

    Returns
    -------
    Llama
        With ``target``'s batch, capacity, KV slack, dtype and device.
    """
    cfg, dc = target.cfg, spec.draft_cfg
    if dc.vocab_size != cfg.vocab_size or dc.hidden_size > cfg.hidden_size:
        raise ValueError(f"{spec.name}: a subspace draft needs the target's vocab and a hidden size <= its own")
    if cfg.tie_word_embeddings and not dc.tie_word_embeddings:
        raise ValueError(f"{spec.name}: a tied target needs a tied draft (its head is its embedding table)")
    w = target.embed_tokens.weight
    draft = random_target(spec, batch=target.batch, capacity=target.capacity, kv_slack=target.kv_slack, dtype=w.dtype,
                          device=w.device, seed=seed + 1, cfg=dc, decode_kernels=decode_kernels)
    for block in draft.layers:
        block.self_attn.o_proj.weight.zero_()
        block.mlp.down_proj.weight.zero_()
    d = dc.hidden_size
    w[:, d:] = 0
    w[:, :d] = draft.embed_tokens.weight
    if target.lm_head is not None:
        target.lm_head.weight[:, d:] = 0
        target.lm_head.weight[:, :d] = draft.head_weight()
    return draft


def draft_instance(src: Llama, draft: int | Llama, *, batch: int | None = None) -> Llama:
    """The draft an engine runs: ``src``'s first ``draft`` blocks (an int), or ``draft`` itself (a
    :func:`subspace_draft`), over the shared tensors with its own KV cache."""
    if isinstance(draft, Llama):
        return instance(draft, batch=batch)
    return instance(src, layers=draft, batch=batch)


def instance(src: Llama, *, layers: int | None = None, batch: int | None = None) -> Llama:
    """A Llama over ``src``'s parameter tensors (its first ``layers`` blocks) with its own KV
    cache for ``batch`` sequences (default ``src.batch``) of ``src.capacity`` tokens.

    The new model's own parameters are allocated and dropped at once (``Llama`` has no
    constructor that skips them); only ``kv`` and the RoPE tables stay its own. It runs ``src``'s
    decode kernels (``decode_ops``).
    """
    n = src.cfg.num_hidden_layers if layers is None else layers
    p = next(src.parameters())
    model = Llama(src.cfg.replace(num_hidden_layers=n), batch=src.batch if batch is None else batch,
                  capacity=src.capacity, dtype=p.dtype, device=p.device, kv_slack=src.kv_slack)
    model.embed_tokens, model.norm, model.lm_head = src.embed_tokens, src.norm, src.lm_head
    model.layers = nn.ModuleList(src.layers[:n])
    model.decode_ops = src.decode_ops
    assert model.kv_slack == src.kv_slack and model.kv[0].shape[2:] == src.kv[0].shape[2:]
    return model


def shares_weights(a: Llama, b: Llama) -> bool:
    """True when every parameter of ``b`` is stored at the address of ``a``'s parameter of that name."""
    own = {n: p.data_ptr() for n, p in a.named_parameters()}
    return all(own.get(n) == p.data_ptr() for n, p in b.named_parameters())


def weight_bytes(model: Llama) -> int:
    """Bytes one forward streams from memory: every block, the final norm and the head.

    The embedding table is counted once, as the head, when tied; an untied embedding
    table is only gathered (B*T rows), so it is left out.
    """
    skip = {id(model.embed_tokens.weight)} if model.lm_head is not None else set()
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in skip or id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


class Epsilon:
    """Sets the target's residual-branch output projections past the draft to ε x their initial values.

    Parameters
    ----------
    target : Llama
    draft_layers : int
        Blocks ``[draft_layers, n)`` are scaled; the draft's blocks never are.
    """

    def __init__(self, target: Llama, draft_layers: int):
        self.weights = [w for block in target.layers[draft_layers:]
                        for w in (block.self_attn.o_proj.weight, block.mlp.down_proj.weight)]
        self.initial = [w.detach().clone() for w in self.weights]  # bf16 copies; rescaling never compounds
        self.value = 1.0

    @torch.no_grad()
    def set(self, eps: float) -> None:
        for w, w0 in zip(self.weights, self.initial):
            torch.mul(w0, eps, out=w)
        self.value = float(eps)
        if self.weights and self.weights[0].is_cuda:
            # Engines run on other (non-blocking) streams: the new weights must be in place first.
            torch.cuda.synchronize(self.weights[0].device)


@torch.no_grad()
def argmax_margins(model: Llama, prompts: torch.Tensor) -> dict:
    """Top-1 minus top-2 logit over every prompt position (writes KV rows ``[0, P)`` of every slot).

    A random model with flat logits would make greedy decoding a coin toss between
    near-equal tokens; this reports how far from that the benchmark's models are.

    Returns
    -------
    dict with ``median``, ``p10``, ``ties`` (fraction with margin 0) and ``top_median``
    """
    b, p = prompts.shape
    zero = torch.zeros(b, dtype=torch.int32, device=prompts.device)
    logits = model(prompts, zero, [zero] * len(model.layers), None)  # rows None: every slot in order, no KV gather
    top = logits.float().topk(2, dim=-1).values.reshape(-1, 2)  # [B*P, 2]
    gap = (top[:, 0] - top[:, 1]).cpu()
    return dict(median=float(gap.median()), p10=float(gap.quantile(0.1)), ties=float((gap == 0).float().mean()),
                top_median=float(top[:, 0].median().cpu()))


# ---------------------------------------------------------------------- transformers twins

#: model_type -> transformers (config class, model class) names
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
              "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def hf_config(cfg: LlamaConfig, layers: int):
    """The transformers config of ``cfg``'s family with ``layers`` layers (no sliding window, never stops early)."""
    import transformers

    extra = {} if cfg.rope_scaling is None else {"rope_scaling": dict(cfg.rope_scaling)}
    if cfg.model_type == "llama":
        extra.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
    elif cfg.model_type == "qwen3":
        extra.update(attention_bias=cfg.attention_bias, use_sliding_window=False)
    elif cfg.model_type == "qwen2":
        extra.update(use_sliding_window=False)
    else:
        extra.update(sliding_window=None)
    HFConfig = getattr(transformers, HF_CLASSES[cfg.model_type][0])  # noqa: N806 - a class
    return HFConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                    num_hidden_layers=layers, num_attention_heads=cfg.num_attention_heads,
                    num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                    rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
                    max_position_embeddings=131072, eos_token_id=None, bos_token_id=None, pad_token_id=None, **extra)


def hf_draft_twin(src: Llama, draft: int | Llama):
    """:func:`hf_twin` of the draft :func:`draft_instance` runs."""
    return hf_twin(draft) if isinstance(draft, Llama) else hf_twin(src, layers=draft)


def hf_twin(src: Llama, *, layers: int | None = None):
    """A transformers model of ``src``'s family whose parameters ARE ``src``'s (first ``layers`` blocks).

    Built on the meta device, then every parameter is assigned ``src``'s tensor (HF's
    separate q/k/v and gate/up are views into ``src``'s fused ones, from
    :meth:`Llama.hf_tensors`), and the rotary embedding (a computed buffer, fp32 as in
    ``from_pretrained``) is rebuilt on ``src``'s device.

    Raises
    ------
    AssertionError
        If any parameter was copied rather than shared, or anything stayed on meta.
    """
    import transformers

    n = src.cfg.num_hidden_layers if layers is None else layers
    cfg = hf_config(src.cfg, n)
    with torch.device("meta"):
        hf = getattr(transformers, HF_CLASSES[src.cfg.model_type][1])(cfg)
    ours = {("lm_head." + name[len("lm_head."):] if name.startswith("lm_head.") else "model." + name): p
            for name, p in src.hf_tensors().items() if not name.startswith("layers.") or int(name.split(".")[1]) < n}
    if cfg.tie_word_embeddings:
        ours.pop("lm_head.weight", None)
    hf.load_state_dict(ours, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    device = next(src.parameters()).device
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg).to(device)  # fp32 buffers, built off meta
    hf.eval()
    for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
        assert not t.is_meta, f"HF twin: {name} was not set"
    mine = {t.data_ptr() for t in src.hf_tensors().values()}  # parameters and the views into fused ones
    assert all(p.data_ptr() in mine for p in hf.parameters()), "HF twin copied a parameter instead of sharing it"
    gc = hf.generation_config
    gc.eos_token_id = gc.bos_token_id = gc.pad_token_id = None  # never stop early on a random model
    return hf


def set_assistant(hf_draft, k: int) -> None:
    """Constant k drafts per round and no confidence early stop (HF's default threshold is 0.4)."""
    gc = hf_draft.generation_config
    gc.num_assistant_tokens = k
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0

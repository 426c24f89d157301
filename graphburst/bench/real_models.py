"""The models of ``graphburst bench real``: random Llama targets, their early-exit drafts,
the ε knob that sets acceptance, and transformers twins built from the same tensors.

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
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..models.llama import Llama, LlamaConfig

INIT_STD = 0.02
LLAMA32_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: the target's config and the draft's depth."""

    name: str
    cfg: LlamaConfig
    draft_layers: int
    note: str


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
    # Llama-3.2-1B's shape.
    "1b": ModelSpec("1b", LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                                      rope_theta=500000.0, rope_scaling=LLAMA32_ROPE, tie_word_embeddings=True),
                    2, "Llama-3.2-1B shape: 16 layers, d=2048, 32 q / 8 KV heads, FFN 8192, vocab 128256, "
                       "tied embeddings, llama3 rope"),
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
                  fold_gqa: bool = False) -> Llama:
    """The target with seeded random weights drawn on ``device`` (fast even for 1B); ``fold_gqa`` as in :class:`Llama`."""
    model = Llama(spec.cfg, batch=batch, capacity=capacity, dtype=dtype, device=device, kv_slack=kv_slack,
                  fold_gqa=fold_gqa)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.hf_tensors().items():  # per HF tensor: the same draws as before q/k/v and gate/up fused
        if name.endswith("layernorm.weight") or name == "norm.weight":
            p.fill_(1.0)
        else:
            p.normal_(0.0, INIT_STD, generator=gen)
    return model


def instance(src: Llama, *, layers: int | None = None, batch: int | None = None) -> Llama:
    """A Llama over ``src``'s parameter tensors (its first ``layers`` blocks) with its own KV
    cache for ``batch`` sequences (default ``src.batch``) of ``src.capacity`` tokens.

    The new model's own parameters are allocated and dropped at once (``Llama`` has no
    constructor that skips them); only ``kv`` and the RoPE tables stay its own.
    """
    n = src.cfg.num_hidden_layers if layers is None else layers
    p = next(src.parameters())
    model = Llama(src.cfg.replace(num_hidden_layers=n), batch=src.batch if batch is None else batch,
                  capacity=src.capacity, dtype=p.dtype, device=p.device, kv_slack=src.kv_slack)
    model.embed_tokens, model.norm, model.lm_head = src.embed_tokens, src.norm, src.lm_head
    model.layers = nn.ModuleList(src.layers[:n])
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
    logits = model(prompts, zero, [zero] * len(model.layers), torch.arange(b, device=prompts.device))
    top = logits.float().topk(2, dim=-1).values.reshape(-1, 2)  # [B*P, 2]
    gap = (top[:, 0] - top[:, 1]).cpu()
    return dict(median=float(gap.median()), p10=float(gap.quantile(0.1)), ties=float((gap == 0).float().mean()),
                top_median=float(top[:, 0].median().cpu()))


# ---------------------------------------------------------------------- transformers twins

def hf_config(cfg: LlamaConfig, layers: int):
    from transformers import LlamaConfig as HFConfig

    extra = {} if cfg.rope_scaling is None else {"rope_scaling": dict(cfg.rope_scaling)}
    return HFConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                    num_hidden_layers=layers, num_attention_heads=cfg.num_attention_heads,
                    num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                    rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
                    max_position_embeddings=131072, eos_token_id=None, bos_token_id=None, pad_token_id=None, **extra)


def hf_twin(src: Llama, *, layers: int | None = None):
    """A ``transformers.LlamaForCausalLM`` whose parameters ARE ``src``'s (first ``layers`` blocks).

    Built on the meta device, then every parameter is assigned ``src``'s tensor (HF's
    separate q/k/v and gate/up are views into ``src``'s fused ones, from
    :meth:`Llama.hf_tensors`), and the rotary embedding (a computed buffer, fp32 as in
    ``from_pretrained``) is rebuilt on ``src``'s device.

    Raises
    ------
    AssertionError
        If any parameter was copied rather than shared, or anything stayed on meta.
    """
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    n = src.cfg.num_hidden_layers if layers is None else layers
    cfg = hf_config(src.cfg, n)
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg)
    ours = {("lm_head." + name[len("lm_head."):] if name.startswith("lm_head.") else "model." + name): p
            for name, p in src.hf_tensors().items() if not name.startswith("layers.") or int(name.split(".")[1]) < n}
    if cfg.tie_word_embeddings:
        ours.pop("lm_head.weight", None)
    hf.load_state_dict(ours, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    device = next(src.parameters()).device
    hf.model.rotary_emb = LlamaRotaryEmbedding(config=cfg).to(device)  # fp32 buffers, built off meta
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

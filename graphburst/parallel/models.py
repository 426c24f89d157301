"""Whole random Llama pairs for parallel runs: built where they run, identical on every rank.

Weights are drawn per parameter from a generator seeded by (seed, parameter index) on
the model's own device (``torch.randn`` on the GPU for the 8B bench: no CPU init), so
every rank, and the one-GPU reference, builds the same model. The draft is the
target's first ``draft_layers`` layers with its embeddings, norm and head (a self-draft),
and the later layers' residual outputs (``o_proj``, ``down_proj``) are scaled by
``residual_scale`` so the draft agrees often.
"""

from __future__ import annotations

import torch

from ..models.llama import Llama
from ..models.llama_config import LlamaConfig

#: the small model of ``--model tiny-random`` (TP 2 and PP 2 divide it)
TINY = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
#: the 8B shape of the benchmark (Llama-3-8B's dimensions)
LLAMA_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0)


@torch.no_grad()
def random_llama(cfg: LlamaConfig, *, batch: int, capacity: int, device="cpu", dtype=torch.float32, seed: int = 0,
                 std: float = 0.02, residual_scale: float = 1.0, keep_layers: int = 0) -> Llama:
    """A Llama with seeded normal weights (norms 1); layers from ``keep_layers`` on get scaled residual outputs."""
    model = Llama(cfg, batch=batch, capacity=capacity, dtype=dtype, device=device)
    dev = torch.device(device)
    # Per HF tensor (fused projections in their parts), so the weights do not depend on the fusing.
    for i, (name, p) in enumerate(model.hf_tensors().items()):
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        gen = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + i)
        p.normal_(0.0, std, generator=gen)
        if name.endswith(("o_proj.weight", "down_proj.weight")) and int(name.split(".")[1]) >= keep_layers:
            p.mul_(residual_scale)
    return model


@torch.no_grad()
def self_draft(target: Llama, draft_layers: int, *, batch: int, capacity: int, dtype=None,
               deterministic_attention: bool = False) -> Llama:
    """The target's first ``draft_layers`` layers, embeddings, norm and head as a model of its own
    (a copy with its own KV; ``draft_layers = all`` clones a model); ``deterministic_attention``
    as in :class:`Llama`."""
    w = target.embed_tokens.weight
    draft = Llama(target.cfg.replace(num_hidden_layers=draft_layers), batch=batch, capacity=capacity,
                  dtype=dtype or w.dtype, device=w.device, deterministic_attention=deterministic_attention)
    own = dict(target.named_parameters())
    for name, p in draft.named_parameters():
        p.copy_(own[name])
    return draft


def random_pair(cfg: LlamaConfig, *, draft_layers: int = 1, batch: int, capacity: int, device="cpu",
                dtype=torch.float32, seed: int = 0, residual_scale: float = 0.25) -> tuple[Llama, Llama]:
    """(target, self-draft), both whole."""
    target = random_llama(cfg, batch=batch, capacity=capacity, device=device, dtype=dtype, seed=seed,
                          residual_scale=residual_scale, keep_layers=draft_layers)
    return target, self_draft(target, draft_layers, batch=batch, capacity=capacity)

"""A Llama sharded over a tensor-parallel group (Megatron layout).

Per layer, rank r of ``world`` holds

* ``q_proj``/``k_proj``/``v_proj``: rows of query heads ``[r*H/w, (r+1)*H/w)`` and KV heads
  ``[r*KV/w, ...)`` (column-parallel; a query head's KV group stays on its rank),
* ``gate_proj``/``up_proj``: rows ``[r*F/w, (r+1)*F/w)`` (column-parallel),
* each cut per HF component, then stacked into the rank's fused ``qkv_proj`` and
  ``gate_up_proj`` (:meth:`Llama.hf_tensors` names the parts of both models), so a
  rank's fused GEMM is ``[q_r; k_r; v_r]``, not a slice of the full fused weight,
* ``o_proj``/``down_proj``: the matching input columns (row-parallel), each followed by
  one all-reduce (a forward hook: ``graphburst.models.llama`` itself is unchanged),
* the KV cache of its own KV heads only.

Embeddings and norms are replicated. The head is vocab-parallel: each rank computes the
logits of its ``ceil(V/w)`` rows and one all-gather rebuilds ``[R, T, V]``, identical on
every rank, so the adapters' argmax, softmax and every bookkeeping kernel run replicated
and agree. The local module is a plain :class:`~graphburst.models.llama.Llama` built from a
config with the local head and FFN counts (``head_dim`` is explicit, so nothing in it
assumes ``hidden = heads * head_dim``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.llama import Llama
from ..models.llama_config import LlamaConfig
from .dist import Context, Layout, check_layout


def local_config(cfg: LlamaConfig, world: int) -> LlamaConfig:
    """The per-rank config: heads, KV heads and FFN width divided by ``world``."""
    check_layout(cfg, Layout(tp=world))
    return cfg.replace(num_attention_heads=cfg.num_attention_heads // world,
                       num_key_value_heads=cfg.num_key_value_heads // world,
                       intermediate_size=cfg.intermediate_size // world)


def _rows(t: torch.Tensor, r: int, w: int) -> torch.Tensor:
    n = t.shape[0] // w
    return t[r * n:(r + 1) * n]


def _cols(t: torch.Tensor, r: int, w: int) -> torch.Tensor:
    n = t.shape[1] // w
    return t[:, r * n:(r + 1) * n]


class TPLlama(nn.Module):
    """Rank ``ctx.rank``'s shard of ``full``, with the model-protocol surface of :class:`Llama`.

    Parameters
    ----------
    full : Llama
        The whole model (any device); only read here. Free it afterwards.
    ctx : Context
    batch, capacity : int
    dtype : torch.dtype, optional
        Defaults to ``full``'s.
    """

    accepts_logits_at = True

    def __init__(self, full: Llama, ctx: Context, *, batch: int, capacity: int, dtype=None):
        super().__init__()
        cfg, r, w = full.cfg, ctx.rank, ctx.world
        dtype = dtype or full.embed_tokens.weight.dtype
        self.ctx, self.cfg, self.vocab = ctx, cfg, cfg.vocab_size
        self.inner = Llama(local_config(cfg, w), batch=batch, capacity=capacity, dtype=dtype, device=ctx.device)
        self.batch, self.capacity, self.kv_slack = batch, capacity, self.inner.kv_slack
        self.v_local = -(-cfg.vocab_size // w)  # head rows per rank; the last rank's tail is zero padding
        self.inner.lm_head = nn.Linear(cfg.hidden_size, self.v_local, bias=False, device=ctx.device, dtype=dtype)
        src = full.hf_tensors()
        with torch.no_grad():
            for name, part in self.inner.hf_tensors().items():  # views into the fused local parameters
                part.copy_(self._shard(name, src, full, r, w))
        for block in self.inner.layers:  # row-parallel outputs: one all-reduce each
            block.self_attn.o_proj.register_forward_hook(self._reduce)
            block.mlp.down_proj.register_forward_hook(self._reduce)

    def _shard(self, name: str, src: dict, full: Llama, r: int, w: int) -> torch.Tensor:
        if name == "lm_head.weight":
            head = full.head_weight()
            out = torch.zeros((self.v_local, head.shape[1]), dtype=head.dtype, device=head.device)
            lo, hi = r * self.v_local, min((r + 1) * self.v_local, head.shape[0])
            out[: max(0, hi - lo)] = head[lo:hi]
            return out
        t = src[name]
        leaf = name.split(".")[-2] if "." in name else name
        if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            return _rows(t, r, w)  # weight [out, in] and bias [out] alike
        if leaf in ("o_proj", "down_proj"):
            if name.endswith("bias"):  # added once after the sum, not once per rank
                return t if r == 0 else torch.zeros_like(t)
            return _cols(t, r, w)
        return t  # embeddings, norms: replicated

    def _reduce(self, module, inputs, out):
        self.ctx.all_reduce_(out)
        return out

    def kv_layers(self):
        return self.inner.kv_layers()

    def forward(self, tokens, start_pos, lengths, rows=None, logits_at=None):
        """:meth:`Llama.forward` with full-vocabulary logits, identical on every rank."""
        part = self.inner(tokens, start_pos, lengths, rows, logits_at=logits_at)  # [R, T, V/w] float32
        gathered = torch.empty((self.ctx.world, *part.shape), dtype=part.dtype, device=part.device)
        self.ctx.all_gather_into(gathered, part)  # [w, R, T, V/w]
        r, t = part.shape[:2]
        return gathered.permute(1, 2, 0, 3).reshape(r, t, -1)[..., : self.vocab]

    @torch.no_grad()
    def greedy(self, prompt, n: int, row: int = 0) -> list[int]:
        """:meth:`Llama.greedy` through the sharded forward (every rank must call it)."""
        return Llama.greedy(self, prompt, n, row)

    @property
    def rope_cos(self):  # read by Llama.greedy for the device
        return self.inner.rope_cos

    @property
    def layers(self):  # read by Llama.greedy for the layer count
        return self.inner.layers

"""A Llama-architecture decoder in PyTorch, written to run inside a burst graph.

One module for every family graphburst loads (Llama, Mistral, Qwen2/2.5, Qwen3; the
table is in ``llama_config.py``): they differ by config switches read in the layers
(``llama_layers.py``: q/k/v biases, o_proj and MLP biases, per-head q/k RMSNorm), never
by a copy of this file. ``DecoderLM`` is the family-neutral name of :class:`Llama`.

This module holds the model: the layer stack, its KV storage and RoPE tables, the
inputs every layer shares per forward, and the forward / greedy entry points. The layers
(RMSNorm, fused projections, attention, the SwiGLU MLP, the decoder block) and why each
issues few kernels are in ``llama_layers.py``, the config in ``llama_config.py``, RoPE
with the ``llama3`` scaling in ``rope.py``. It computes what
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

import torch
import torch.nn.functional as F
from torch import nn

from ..constants import DECODE_KERNELS, MAX_K, TRITON_DECODE_KERNELS
from . import llama_decode
from .llama_config import LlamaConfig
from .llama_layers import PREFILL_SDPA, Block, FusedLinear, LayerIndex, Packed, RMSNorm, fold_mask, kv_index
from .rope import rope_rotation, rope_tables

#: rows past ``capacity`` in every KV tensor: a chain of up to MAX_K drafts plus the
#: draft's extra append, started at the last valid row, stays in bounds.
DEFAULT_KV_SLACK = MAX_K + 2
#: KV rows per sequence are a multiple of this: SDPA's fused kernels then need no mask padding per call.
KV_ROW_MULTIPLE = 16
# ``Llama(decode_kernels=...)``: ``auto`` runs decode/verify forwards (T <= MAX_K + 1, all
# rows) on the fused Triton kernels on CUDA and on SDPA elsewhere; ``reference`` forces the
# fused path on its plain-torch references; ``off`` keeps SDPA everywhere. Prefill always
# runs SDPA. The fused path's projections run on the weight-streaming GEMV at M = B * T <=
# ``llama_decode.GEMV_MAX_M`` rows under ``auto`` (``FORCED_GEMV_MAX_M`` under
# ``reference``), on cuBLAS past it.
# ``gemv`` is the fused path with every projection and the head on the GEMV up to its whole
# row tile (``gemv.MAX_M`` rows), no PDL; ``pdl`` is ``gemv`` with every Triton kernel
# launched with programmatic dependent launch (``models/decode/launch.py``; Hopper or later,
# checked at construction; the CPU's interpreter runs it without). They are the two paths
# measured against ``auto``'s cuBLAS (``graphburst bench real --profile forward --kernels
# auto,gemv,pdl``); ``auto`` stays as it is until the H200 says otherwise. Under both, a
# projection with forward hooks (tensor parallelism's all-reduce) or of M > ``gemv.MAX_M``
# rows still runs ``nn.Linear`` (cuBLAS): the PDL overlap stops there, the order does not.
# ``folded`` is ``pdl`` with the norms, SiLU x up and the GEMV's split-K sums folded into the
# projections' kernels at one row (``models/decode/folded.py``: 6 kernels a layer instead of ~14);
# more rows (a verify, a batch) run ``pdl``'s kernels around cuBLAS (``folded.FOLD_MAX_M``).
# ``gemv``, ``pdl`` and ``folded`` are refused where Triton cannot run them (the CPU outside
# Triton's interpreter). The tuple is ``constants.DECODE_KERNELS``.


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
        if choice in TRITON_DECODE_KERNELS:
            if not llama_decode.triton_runs_on(device):
                raise ValueError(f"decode_kernels={choice!r} runs Triton kernels, which need a CUDA device (the CPU "
                                 f"runs them only under TRITON_INTERPRET=1); this model is on {device}")
            why = llama_decode.pdl_unsupported(device) if choice != "gemv" else None
            if why is not None:
                raise ValueError(f"decode_kernels={choice!r}: {why}")
            if choice == "folded":
                return llama_decode.folded_ops(pdl=True)
            return llama_decode.gemv_ops(pdl=choice == "pdl")
        return llama_decode.triton_ops(llama_decode.GEMV_MAX_M)  # auto

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

    def layer_inputs(self, start_pos: torch.Tensor, lengths, rows: torch.Tensor, t: int, dtype,
                     fresh: bool = False) -> list[LayerIndex]:
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
        fresh : bool
            Every row starts at position 0 with nothing cached (``start_pos`` and ``lengths``
            all 0): attention runs over the call's own tokens (:class:`LayerIndex`).

        Returns
        -------
        list of :class:`LayerIndex`, one per layer
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
        backends = attn.backends if attn.backends is not None or not fresh else PREFILL_SDPA
        shared, out = {}, []
        for length in lengths:
            if id(length) not in shared:
                # a fresh unfolded call is causal over its own tokens: SDPA needs no mask, so none is built
                flat, mask = kv_index(length, rows, t, s, dtype, width=t if fresh else None,
                                      with_mask=attn.fold or not fresh)
                if attn.fold:
                    mask = fold_mask(mask, attn.n_heads // attn.n_kv)
                shared[id(length)] = LayerIndex(flat, mask, rot, fresh, backends)
            out.append(shared[id(length)])
        return out

    def packed_index(self, packed: Packed, dtype) -> LayerIndex:
        """The :class:`LayerIndex` every layer of a packed forward shares (:class:`Packed`):
        RoPE at each token's own position, KV rows ``slot * S + pos`` (clamped into the slot's
        storage), no mask.

        A call of one prompt (``packed.last`` of one row, so at most one real segment, then
        padding) attends as a fresh prefill does, by causal SDPA over the whole row: the
        prompt's tokens come first, so none of them sees a padding token. On the H200 a
        512-token prompt of the 8b ran 7% slower packed (variable-length kernel) than padded
        (SDPA), 2.6% by this route (docs/serving.md, "Packed prefill")."""
        attn = self.layers[0].self_attn
        pos = packed.pos.clamp(0, self.rope_cos.shape[0] - 1)  # [T]
        cos, sin = self.rope_cos[pos].to(dtype).unsqueeze(0), self.rope_sin[pos].to(dtype).unsqueeze(0)  # [1, T, D]
        rot = rope_rotation(cos, sin, attn.n_heads + attn.n_kv, attn.n_kv)
        s = self.kv[0].shape[2]
        flat = packed.slot * s + packed.pos.clamp(max=s - 1)  # [T]
        if packed.last.numel() == 1 and not attn.fold:  # one prompt: the fresh path (causal, no mask)
            return LayerIndex(flat, None, rot, True, PREFILL_SDPA)
        return LayerIndex(flat, None, rot, True, None, packed.cu, packed.max_len)

    @property
    def accepts_packed(self) -> bool:
        """forward takes ``packed=``: fresh prompts end to end in one row (:class:`Packed`).
        Not with ``deterministic_attention``: torch's flash kernels are not in its set."""
        return bool(len(self.layers)) and self.layers[0].self_attn.backends is None

    #: forward takes ``logits_at``: prefill then computes the head at one position per row only.
    accepts_logits_at = True
    #: forward takes ``head=False``: a prompt's non-final chunk then writes KV and skips norm and head.
    accepts_head = True
    #: forward takes ``fresh=True``: every row starts at position 0 (attention over its own tokens).
    accepts_fresh = True

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, lengths, rows: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, head: bool = True, fresh: bool = False,
                packed: Packed | None = None):
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
        fresh : bool
            The caller's promise that ``start_pos`` and every length are 0 (whole prompts,
            first chunks): attention then reads only the new tokens, causal.
        packed : Packed, optional
            ``tokens [1, T]`` are fresh prompts end to end (:class:`Packed`; only where
            :attr:`accepts_packed`): ``start_pos``, ``lengths`` (but for which layers hold
            KV), ``rows``, ``logits_at`` and ``fresh`` are not read, and the logits are
            those after each prompt's ``packed.last`` token.

        Returns
        -------
        [R, T, vocab] float32, or [R, 1, vocab] with ``logits_at`` or ``packed``, or None without ``head``
        """
        if packed is not None:
            return self._packed_forward(tokens, lengths, packed, head)
        r, t = tokens.shape
        if self.decode_ops is not None and rows is None and logits_at is None and head and t <= MAX_K + 1:
            forward = llama_decode.folded_forward if isinstance(self.decode_ops, llama_decode.FoldedOps) \
                else llama_decode.fused_forward
            return forward(self, tokens, start_pos, lengths, self.decode_ops)
        every = torch.arange(r, device=tokens.device) if rows is None else rows  # [R] int64
        x = self.embed_tokens(tokens)
        for layer, kv, length, index in zip(self.layers, self.kv, lengths,
                                            self.layer_inputs(start_pos, lengths, every, t, x.dtype, fresh)):
            x = layer(x, None, None, kv, length, rows, index)  # rows None: the whole batch, no KV gather
        if not head:
            return None
        if logits_at is not None:
            x = x[torch.arange(r, device=x.device), logits_at].unsqueeze(1)  # [R, 1, hidden]
        return F.linear(self.norm(x), self.head_weight()).float()

    def _packed_forward(self, tokens, lengths, packed: Packed, head: bool):
        x = self.embed_tokens(tokens)  # [1, T, hidden]
        index = self.packed_index(packed, x.dtype)
        for layer, kv, length in zip(self.layers, self.kv, lengths):
            x = layer(x, None, None, kv, length, None, index)
        if not head:
            return None
        return F.linear(self.norm(x[0, packed.last].unsqueeze(1)), self.head_weight()).float()  # [R, 1, vocab]

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


HF_PREFIX = "model."  # HF nests everything but lm_head under <Family>ForCausalLM.model


def hf_name(name: str) -> str:
    """HF checkpoint name of one of :meth:`Llama.hf_tensors` (``layers.0.mlp.up_proj.weight`` ->
    ``model.layers.0...``)."""
    return name if name.startswith("lm_head.") else HF_PREFIX + name


#: the family-neutral name: the same class computes every architecture of ``llama_config.ARCHITECTURES``
DecoderLM = Llama

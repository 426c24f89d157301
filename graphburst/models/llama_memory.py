"""What a :class:`~graphburst.models.llama.Llama` will take on the GPU, from its config, before it is built.

:func:`memory_spec` describes one model for the generic KV sizing
(:func:`graphburst.models.capacity.auto_capacity`):

* **KV** (per slot, per storage row): :meth:`LlamaConfig.kv_bytes_per_row`; the storage
  holds ``DEFAULT_KV_SLACK`` rows past the capacity, rounded to ``KV_ROW_MULTIPLE``, as
  :class:`Llama` allocates it.
* **Per storage row, shared by the slots**: the RoPE tables (cos and sin, fp32), and the
  additive attention masks ``[R, 1, T, S]`` in the activations' dtype with the booleans
  they are built from (``llama.kv_index``): one prefill's (``R x T = prefill_tokens``),
  and one decode forward's (``batch x decode_tokens``; the SDPA path builds it, the
  fused Triton decode path does not, so this counts the worse); and the K and V of one
  layer that a prefill of some slots gathers for them (``kv[0, rows]``, up to every slot).
* **Weights**: counted from the module itself, built on the meta device (no memory), so
  every bias and norm the config switches on is in the figure.
* **Reserve** (the estimate): :meth:`LlamaConfig.activation_bytes_per_token` for a
  prefill of ``prefill_tokens`` tokens (run eagerly, in torch's ordinary pool), again for
  the prefill graphs' private pool (``models.prefill_graphs``: it keeps its largest
  bucket's peak, at most ``DEFAULT_MAX_TOKENS`` tokens, for as long as the graphs live;
  with a warm-up of ``warm_rows``, the largest bucket it makes, and with a head the
  outputs every warmed bucket keeps, ``[R_b, 1, V]`` float32: ``prefill_buckets.warm_sizes``, or
  ``packed_prefill.packed_warm_sizes`` where that keeps more),
  plus one decode forward of ``batch x decode_tokens`` (the captured burst's private pool
  holds its peak for as long as the graph lives), plus the head's outputs: logits in the dtype,
  their fp32 copy, and softmax or argmax outputs (16 bytes per vocabulary entry at most),
  for ``batch x (decode_tokens + 1)`` rows (the +1: the prefill's logits at one position).
  With chunked prefill (``chunked``) the graphs' pool also keeps a later chunk's one-row
  bucket: its mask over every storage row and one slot's K and V (per storage row), and a
  warm-up with a head the continued buckets' outputs (``prefill_buckets.continued_warm_lengths``).
* **Cap**: ``max_position_embeddings``, and the largest capacity whose per-layer K stays
  inside the Triton decode kernels' int32 offsets (:data:`MAX_KV_HALF_ELEMENTS`).
"""

from __future__ import annotations

import torch

from .capacity import MemorySpec
from .llama import DEFAULT_KV_SLACK, KV_ROW_MULTIPLE, Llama
from .llama_config import LlamaConfig
from .packed_prefill import packed_warm_sizes
from .prefill_buckets import DEFAULT_MAX_TOKENS, continued_warm_lengths, warm_output_bytes, warm_sizes

#: Tokens one prefill forward is sized for when the caller does not say (a chunked
#: prefill's chunk bounds it; admitting more prompt tokens at once than this may not fit).
DEFAULT_PREFILL_TOKENS = 8192
#: The Triton decode kernels (``models/decode/attention.py``) offset a slot's KV by
#: ``b * stride`` with int32 arguments, so one layer's K (or V), batch x rows x KV heads x
#: head_dim elements, must stay below 2**31: a cap on the capacity at large batches.
MAX_KV_HALF_ELEMENTS = 2**31 - 1
#: Bytes per logit entry beyond the dtype's: the fp32 copy (4), softmax or argmax outputs (up to 12).
HEAD_EXTRA_BYTES = 16


def weight_bytes(cfg: LlamaConfig, dtype: torch.dtype) -> int:
    """The parameters' bytes of ``Llama(cfg)`` in ``dtype``, counted on the meta device."""
    model = Llama(cfg, batch=1, capacity=1, dtype=dtype, device="meta")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def memory_spec(cfg: LlamaConfig, *, name: str, dtype: torch.dtype, batch: int, decode_tokens: int,
                prefill_tokens: int = DEFAULT_PREFILL_TOKENS, warm_rows: int = 0,
                warm_head: bool = False, chunked: bool = False) -> MemorySpec:
    """One Llama's :class:`MemorySpec` (module docstring).

    Parameters
    ----------
    cfg : LlamaConfig
    name : str
        ``target`` or ``draft`` (messages).
    dtype : torch.dtype
        Weights, KV and activations.
    batch : int
    decode_tokens : int
        Tokens per row of one decode forward: k + 1 for a target's verify, 1 for a draft step.
    prefill_tokens : int
        Prompt tokens (rows x padded length) of the largest prefill forward.
    warm_rows : int
        Rows of the prefill graphs' warm-up before serving (``PrefillGraphs.warm_up``; 0: none).
    warm_head : bool
        The warm-up's buckets compute logits (a target's), so each keeps its output.
    chunked : bool
        Prompts arrive in chunks of ``prefill_tokens``: the graphs' pool also keeps a later
        chunk's one-row bucket (its mask over every storage row and one slot's gathered K and
        V), and a warm-up with a head the continued buckets' outputs.
    """
    if not isinstance(cfg, LlamaConfig):
        raise TypeError(f"cfg must be a LlamaConfig, got {type(cfg).__name__}")
    size = torch.empty((), dtype=dtype).element_size()
    # the prefill graphs' pool: its largest bucket's activations (a warm-up's largest may pass a
    # chunk, as its rows are rounded up the ladder), and the outputs the warmed buckets keep
    # (padded or packed buckets, whichever keeps more: the adapter picks per module)
    warm = warm_sizes(warm_rows, DEFAULT_MAX_TOKENS, prefill_tokens)
    packed = packed_warm_sizes(warm_rows, DEFAULT_MAX_TOKENS, prefill_tokens)
    graphed = max([min(prefill_tokens, DEFAULT_MAX_TOKENS)] + [r * p for r, p in warm] + [t for _, t in packed])
    act = cfg.activation_bytes_per_token(size) * (prefill_tokens + graphed + batch * decode_tokens)
    head = batch * (decode_tokens + 1) * cfg.vocab_size * (size + HEAD_EXTRA_BYTES)
    continued = continued_warm_lengths(prefill_tokens) if chunked else []  # a later chunk's buckets, longest first
    if warm_head:
        kept = len(continued) if warm_rows else 0  # the warmed continued buckets' [1, 1, V] outputs
        head += max(warm_output_bytes(warm_rows, cfg.vocab_size, DEFAULT_MAX_TOKENS, prefill_tokens, chunked),
                    (sum(r for r, _ in packed) + kept) * cfg.vocab_size * 4)
    rope = 2 * cfg.head_dim * 4  # rope_cos and rope_sin rows, float32
    mask = (prefill_tokens + batch * decode_tokens) * (size + 1)  # additive masks and their booleans, per KV row
    gather = batch * 2 * cfg.num_key_value_heads * cfg.head_dim * size  # one layer's K and V of the prefilled slots
    if chunked:  # a later chunk's graph keeps its own mask (a chunk's rows, its booleans) and one slot's K and V
        mask += continued[0] * (size + 1)
        gather += 2 * cfg.num_key_value_heads * cfg.head_dim * size
    rows = MAX_KV_HALF_ELEMENTS // (batch * cfg.num_key_value_heads * cfg.head_dim)
    offsets = rows // KV_ROW_MULTIPLE * KV_ROW_MULTIPLE - DEFAULT_KV_SLACK  # rows(capacity) stays <= rows
    if cfg.max_position_embeddings is not None and cfg.max_position_embeddings <= offsets:
        cap, why = cfg.max_position_embeddings, "max_position_embeddings"
    else:
        cap, why = max(offsets, 1), f"int32 KV offsets at batch {batch}"
    return MemorySpec(name, slot_row_bytes=cfg.kv_bytes_per_row(size), row_bytes=rope + mask + gather,
                      slack_rows=DEFAULT_KV_SLACK, row_multiple=KV_ROW_MULTIPLE, fixed_bytes=weight_bytes(cfg, dtype),
                      reserve_bytes=act + head, max_capacity=cap, max_capacity_why=why)

"""The draft side of plain decoding (k = 0): no model, no KV, no proposal.

A decoder built with ``draft=None`` and ``k=0`` runs the same burst as a speculative one
with this in the draft's place: each round verifies only the pending token (one
position), commits it and folds the target's prediction after it into the next pending
token. That is plain greedy (or sampled) decoding, one token a round, still M rounds a
graph replay and one host sync a burst. A served model with no draft decodes this way.
"""

from __future__ import annotations

from ..buffers import KVCache, StreamBufs
from ..protocol import DraftModel

__all__ = ["NoDraft"]


class NoDraft(DraftModel):
    """The draft of plain decoding for ``target``: its vocabulary, batch, capacity and backend, and
    an empty cache (the rollback table then holds the target's layers and the position counter)."""

    writes_verify_tokens = True  # the seed writes vtok[:, 0], the only verify position: no assemble launch
    supports_sampling = True  # no draft logits: the sampled round takes the target's token at position 0
    chunked_prefill = True  # nothing to prefill, whole or in chunks
    prefill_in_graph = True  # its prefill enqueues nothing, so admission may still be one graph

    def __init__(self, target):
        cache = target.cache
        self.vocab = target.vocab
        self.cache = KVCache([], cache.batch, cache.capacity, cache.backend)

    def __repr__(self) -> str:
        return f"NoDraft(batch={self.cache.batch}, capacity={self.cache.capacity})"

    def prefill(self, prompt, prompt_len, pos_ctr, pend, stream, *, start=None, rows=None, lengths=None) -> None:
        """Nothing: plain decoding keeps no draft state."""

    def draft_step(self, bufs: StreamBufs, step: int, stream) -> None:
        # A k = 0 round has no draft steps; a call means a decoder was built with k > 0 around it.
        raise RuntimeError(f"plain decoding has no draft steps (k = {bufs.k}, step {step})")

    def draft_append_last(self, bufs: StreamBufs, stream) -> None:
        """Sampling mode: no draft was sampled, so nothing is appended."""

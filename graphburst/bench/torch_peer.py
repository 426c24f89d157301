"""The benchmark's peer: the same burst bookkeeping written in PyTorch tensor ops.

This is how engines write it today: acceptance through a cumulative product of matches,
commit and bonus through gather and scatter, per-layer lengths updated as tensors. The
stub model kernels run on torch's stream (cupy launches on an external stream), over
the same buffers (zero-copy DLPack views), and the whole burst is captured with
``torch.cuda.graph``. It handles the benchmark workload: no EOS, no token budget.
"""

from __future__ import annotations

from ..burst_tokens import split_ring
from ..engine.decoder import SpecDecoder
from ..constants import PLACEHOLDER_TOKEN


def torch_available() -> bool:
    """True when torch imports and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class TorchPeer:
    """A burst of ``dec`` in torch ops, captured once with ``torch.cuda.graph``.

    Parameters
    ----------
    dec : SpecDecoder
        A prefilled decoder on the cupy backend; its buffers and models are reused.
    """

    def __init__(self, dec: SpecDecoder):
        import cupy
        import torch

        self.torch, self.dec = torch, dec
        self.stream = torch.cuda.Stream()
        self.cp_stream = cupy.cuda.ExternalStream(self.stream.cuda_stream)
        t = {name: torch.from_dlpack(arr) for name, arr in dec.bufs.arrays().items()}
        self.t = t
        self.lens = [torch.from_dlpack(layer.length) for cache in (dec.target.cache, dec.draft.cache)
                     for layer in cache.layers if layer is not None]
        batch, k = dec.batch, dec.k
        dev = t["vtok"].device
        self.ring_cols = dec.bufs.ring.shape[1]
        # One spare column takes the scatter writes of unaccepted slots.
        self.ring = torch.zeros((batch, self.ring_cols + 1), dtype=torch.int32, device=dev)  # [B, R + 1] int32
        self.ar_k = torch.arange(k, device=dev, dtype=torch.int32)
        self.ar_k1 = torch.arange(k + 1, device=dev, dtype=torch.int32)
        self.graph = None

    def _round(self, first: bool) -> None:
        torch, t, k, dec = self.torch, self.t, self.dec.k, self.dec
        t["vtok"][:, 0] = t["pend"]
        t["pos_start"].copy_(t["pos_ctr"])
        t["brk"][:, 0] = k
        t["brk"][:, 1] = 0
        if first:
            self.ring[:, 0] = 0
        for j in range(k):
            dec.draft.draft_step(dec.bufs, j, stream=self.cp_stream)
        keep = self.ar_k[None, :] < t["brk"][:, 0:1].clamp(0, k)
        t["vtok"][:, 1:] = torch.where(keep, t["draft_tok"], PLACEHOLDER_TOKEN)
        dec.target.verify(dec.bufs, stream=self.cp_stream)
        match = (t["vtok"][:, 1:] == t["tgt_pred"][:, :k]) & keep
        n = match.to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32)  # [B] accepted drafts
        bonus = t["tgt_pred"].gather(1, n.long()[:, None])[:, 0]
        idx = self.ring[:, 0:1] + 1 + self.ar_k1[None, :]
        idx = torch.where(self.ar_k1[None, :] <= n[:, None], idx, self.ring_cols)
        self.ring.scatter_(1, idx.long(), t["vtok"])
        self.ring[:, 0] += n + 1
        t["pend"].copy_(bonus)
        t["acc"][:, 0] += n
        t["acc"][:, 1] += 1
        new_len = t["pos_start"] + n + 1
        for length in self.lens:
            length.copy_(new_len)
        t["pos_ctr"].copy_(new_len)

    def _burst(self) -> None:
        for r in range(self.dec.m_rounds):
            self._round(first=r == 0)

    def capture(self) -> None:
        """Capture one burst with ``torch.cuda.graph``.

        Call it after at least one eager burst (``enqueue`` before capture, then the
        caller's ``drain``): that burst is the warm-up that loads every kernel and
        settles torch's allocator, so nothing is compiled or allocated in the capture.
        """
        torch = self.torch
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self._burst()

    def enqueue(self) -> None:
        """Enqueue one burst: a graph replay once captured, else the eager ops."""
        with self.torch.cuda.stream(self.stream):
            if self.graph is None:
                self._burst()
            else:
                self.graph.replay()

    def drain(self):
        """Read the burst's committed tokens (one host sync)."""
        with self.torch.cuda.stream(self.stream):
            host = self.ring[:, : self.ring_cols].cpu().numpy()
        tokens = split_ring(host)
        self.dec.host_pos += tokens.counts
        return tokens

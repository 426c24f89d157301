"""Rank agreement without an extra host sync: an in-graph checksum, compared at drain.

At the end of every burst, inside the graph, each rank folds its replicated bookkeeping
(the ring and accept counters, ``pos_ctr``, ``pend``, ``budget``) into one int64
checksum, all-gathers every rank's checksum into ``[world] int64``, and copies that
vector into pinned host memory with one small copy node. It rides along with the
burst's ring copy: the drain's single event wait covers both. A gapless graph pair
(serving keeps two bursts in flight) copies into one pinned vector per graph, so burst
n+1's copy never lands while burst n's vector is read. At drain every rank
compares the vector; any difference raises :class:`RankDivergence` on every rank,
naming the burst and the ranks that differ from rank 0.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..constants import TP_MAX_DEPTH
from ..models.torch_model import as_tensor
from .dist import Context, ParallelError

#: buffers folded into the checksum: everything the replicated epilogue writes and the host reads
CHECKED = ("pos_ctr", "pend", "budget")
_MIX = 0x9E3779B1  # odd multiplier: the weight of element i is (i + 1) * _MIX mod 2**31
MAX_GRAPHS = TP_MAX_DEPTH  # graphs a CheckedGraph captures at most, each with its own host vector


class RankDivergence(ParallelError):
    """The ranks' replicated burst state differs (a bug, or a rank fed different inputs)."""


class RankCheck:
    """The checksum, its all-gather, and the host copy, as one call in the burst program.

    Parameters
    ----------
    ctx : Context
    bufs : StreamBufs
        The decoder's buffers (views made here, outside any capture).
    backend : graphburst Backend
    """

    def __init__(self, ctx: Context, bufs, backend):
        self.ctx, self.backend = ctx, backend
        arrays = [bufs.out_block] + [getattr(bufs, n) for n in CHECKED]
        self._views = [as_tensor(a).reshape(-1) for a in arrays]  # int32 views, made once
        n = sum(v.numel() for v in self._views)
        dev = self._views[0].device
        idx = torch.arange(1, n + 1, dtype=torch.int64, device=dev)
        self._weights = (idx * _MIX) % (2**31)  # [n] int64
        self._flat = torch.zeros(n, dtype=torch.int64, device=dev)  # [n] int64 staging
        self._sum = torch.zeros(1, dtype=torch.int64, device=dev)  # [1] int64 own checksum
        self._all = torch.zeros((ctx.world, 1), dtype=torch.int64, device=dev)  # [world, 1] every rank's
        # [MAX_GRAPHS][world] int64: graph i's copy node fills hosts[i]
        self.hosts = [_pinned(backend, ctx.world) for _ in range(MAX_GRAPHS)]
        if backend.is_gpu:  # made on torch's default stream: finish before the decoder's stream reads them
            torch.cuda.synchronize(dev)
        self.bursts = 0
        self._stream = None  # torch's view of the burst stream, made on first eager use

    def __call__(self, stream, graph_index: int = 0) -> None:
        """Enqueue checksum, all-gather and the copy into ``hosts[graph_index]`` (captured into that graph)."""
        with self._on(stream):
            at = 0
            for v in self._views:
                self._flat[at:at + v.numel()].copy_(v)
                at += v.numel()
            torch.sum(self._flat * self._weights, dim=0, keepdim=True, out=self._sum)
            self.ctx.all_gather_into(self._all, self._sum)
        _copy_to_host(self.backend, self.hosts[graph_index], self._all, stream)

    def _on(self, stream):
        """torch on the burst's stream: already so inside a torch capture, not in the eager warm-up."""
        if not self.backend.is_gpu or torch.cuda.current_stream(self.ctx.device).cuda_stream == stream.ptr:
            return contextlib.nullcontext()
        if self._stream is None or self._stream.cuda_stream != stream.ptr:
            self._stream = torch.cuda.ExternalStream(stream.ptr, device=self.ctx.device)
        return torch.cuda.stream(self._stream)

    def verify(self, burst: int | None = None, graph_index: int = 0) -> None:
        """Compare graph ``graph_index``'s copied checksums (after the drain's wait); raise on divergence."""
        self.bursts += 1
        sums = self.hosts[graph_index].copy()
        bad = [r for r in range(len(sums)) if sums[r] != sums[0]]
        if bad:
            which = self.bursts if burst is None else burst
            raise RankDivergence(f"rank(s) {bad} diverged from rank 0 in burst {which} (seen by rank "
                                 f"{self.ctx.rank}): replicated burst-state checksums {sums.tolist()}")


def _pinned(backend, n: int) -> np.ndarray:
    if not backend.is_gpu:
        return np.zeros(n, np.int64)
    mem = backend.xp.cuda.alloc_pinned_memory(n * 8)
    arr = np.frombuffer(mem, np.int64, n)
    arr[...] = 0
    return arr


def _copy_to_host(backend, host: np.ndarray, src: torch.Tensor, stream) -> None:
    if backend.is_gpu:
        rt = backend.xp.cuda.runtime
        rt.memcpyAsync(host.ctypes.data, src.data_ptr(), host.nbytes, rt.memcpyDeviceToHost, stream.ptr)
    else:
        np.copyto(host, src.reshape(-1).numpy())

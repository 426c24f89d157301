"""The shared part of the torch wrappers: torch views, the KV cache and lengths, binding, prefill.

:class:`_TorchModel` is what :class:`~graphburst.models.torch_adapter.TorchTarget` and
:class:`~graphburst.models.torch_adapter.TorchDraft` have in common: zero-copy torch views
of the ``StreamBufs`` (:class:`TorchBufs`, :func:`as_tensor`) and of the one KV length
every layer shares (made once, outside capture), the ``KVCache``, binding to one live
decoder per module, the stream the ops run on, and prefill, eager or through prefill graphs.
The module contract it serves is in :mod:`graphburst.models.torch_adapter`'s docstring.
"""

from __future__ import annotations

import contextlib
import weakref

import numpy as np

from ..backend import Backend, get_backend
from ..buffers import KVCache, KVLayer, StreamBufs
from ..constants import NO_PREFILL
from ..guard import Watched
from ..validate import check_int
from .packed_prefill import prefill_graphs_for


DTYPES = ("float32", "bfloat16", "float16")  # the weight dtypes a checkpoint may be loaded in


def torch_dtype(dtype):
    """A torch dtype from a name in DTYPES or a torch dtype."""
    torch = _torch()
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return getattr(torch, dtype)


def _torch():
    try:
        import torch
    except ImportError as exc:  # graphburst itself does not need torch
        raise ImportError("graphburst's torch adapter needs PyTorch: pip install 'graphburst[torch]'") from exc
    return torch


def as_tensor(arr):
    """Zero-copy torch view of a numpy (``from_numpy``) or cupy (DLPack) array. Not inside a capture."""
    torch = _torch()
    if isinstance(arr, np.ndarray):
        return torch.from_numpy(arr)
    return torch.from_dlpack(arr)


class TorchBufs:
    """Torch views of every :class:`StreamBufs` field, same names, same memory.

    Parameters
    ----------
    bufs : StreamBufs
    """

    def __init__(self, bufs: StreamBufs):
        self.source = bufs
        for name, arr in bufs.arrays().items():  # the sampling buffers too, when there are any
            if arr.dtype != np.uint64:  # the Philox seeds: no model reads them, and DLPack uint64 is patchy
                setattr(self, name, as_tensor(arr))


class _TorchModel(Watched):
    """Shared part of both wrappers: the cache, the length views, streams and binding."""

    capture_api = "torch"  # the burst graph must be captured by torch (graphburst.engine.torch_capture)
    supports_sampling = True  # writes logits when bound to sampling StreamBufs
    chunked_prefill = True  # the module writes at the lengths it is given and attends below them
    _watched = frozenset({"cache", "module"})

    def __init__(self, module, *, batch: int, capacity: int, backend: Backend | str = "auto", vocab: int | None = None,
                 prefill_graphs: bool | None = None, packed_prefill: bool | None = None):
        torch = _torch()
        self.torch = torch
        self.module = module
        self.backend = get_backend(backend)
        self.vocab = check_int("vocab", getattr(module, "vocab", None) if vocab is None else vocab, minimum=2)
        own = getattr(module, "capacity", None)
        if own is not None and own < capacity:
            raise ValueError(f"capacity {capacity} exceeds the module's own KV capacity {own}")
        own_batch = getattr(module, "batch", None)
        if own_batch is not None and own_batch < batch:
            raise ValueError(f"batch {batch} exceeds the module's own KV batch {own_batch}")
        storages = list(module.kv_layers())
        # One [B] int32 length shared by every KV layer of the module: the adapter moves all
        # layers together (prefill, +T per forward) and rollback sets every table entry to
        # the same value, so per-layer copies would only cost one add per layer per forward
        # and stop the module from building its attention mask once per forward.
        shared = self.backend.zeros((batch,), np.int32)  # [B] int32
        layers = [None if s is None else KVLayer(s, shared) for s in storages]
        self.cache = KVCache(layers, batch, capacity, self.backend)  # validates batch, capacity, devices
        view = as_tensor(shared)  # one torch object: modules may memoise per-length work by identity
        self._lengths = [None if layer is None else view for layer in self.cache.layers]
        self._length = view if any(ln is not None for ln in self._lengths) else None
        self._streams = {}  # stream ptr -> torch ExternalStream, made once per stream
        self._bound: TorchBufs | None = None
        self.prefill_graphs = prefill_graphs_for(self.module, prefill_graphs, [ln is not None for ln in self._lengths],
                                                 gpu=self.backend.is_gpu, packed=packed_prefill)
        self._settle()

    @property
    def packed_prefill(self) -> bool:
        """Protocol: ``prefill`` takes ``lengths`` (packed prefill graphs pack fresh prompts end to end)."""
        return self.prefill_graphs is not None and self.prefill_graphs.packed

    @property
    def prefill_fresh_apart(self) -> bool:
        """Protocol attribute: with prefill graphs, fresh prompts beside a later chunk run their own
        (packed or bucketed) call instead of the later chunk's padded one over the cache."""
        return self.prefill_graphs is not None

    def prefill_groups(self, lengths: dict, fresh: bool) -> list:
        """Protocol hook: with prefill graphs, a fresh admission in calls of like length
        (:meth:`PrefillGraphs.plan`); else one call (an eager call costs the host its launches)."""
        if fresh and self.prefill_graphs is not None and len(lengths) > 1:
            return self.prefill_graphs.plan(lengths)
        return [sorted(lengths)]

    def warm_prefill(self, max_rows: int, max_length: int | None = None) -> dict:
        """Protocol hook: make the prefill graphs' buckets of up to ``max_rows`` rows before
        serving (:meth:`PrefillGraphs.warm_up`, with the head this model's fresh prefills
        use), so no admission pays a bucket's first calls. No KV row a slot reads changes.

        ``max_rows`` is capped at the batch (a call never has more rows), ``max_length``
        (a prefill chunk, None: whole prompts) at the capacity. Returns warm_up's dict, or
        {} without prefill graphs or with ``max_rows`` 0.
        """
        max_rows = check_int("max_rows", max_rows, minimum=0)
        length = self.capacity if max_length is None else min(check_int("max_length", max_length, minimum=1),
                                                               self.capacity)
        if self.prefill_graphs is None or max_rows == 0:
            return {}
        on_device = self.torch.cuda.device(self.backend.device_id) if self.backend.is_gpu else contextlib.nullcontext()
        with on_device:
            # a chunk size means later chunks: their continued buckets too
            return self.prefill_graphs.warm_up(min(max_rows, self.batch), self._prefill_head, length,
                                               continued=max_length is not None)

    def _settle(self) -> None:
        # cupy.zeros and torch's own init ran on other streams than the decoder's; finish
        # them now (outside any capture) so the decoder's stream never sees them unfinished.
        if self.backend.is_gpu:
            self.torch.cuda.synchronize(self.backend.device_id)
            with self.backend.device():
                self.backend.xp.cuda.Device().synchronize()

    @property
    def batch(self) -> int:
        return self.cache.batch

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def bind(self, bufs: StreamBufs) -> None:
        """Make the torch views of ``bufs`` (SpecDecoder calls this once, outside capture).

        Raises
        ------
        ValueError
            If the model is already bound to another decoder's buffers: two live decoders
            over one adapter would share its KV cache and lengths and corrupt each other.
        """
        if not isinstance(bufs, StreamBufs):
            raise TypeError(f"bufs must be a StreamBufs, got {type(bufs).__name__}")
        if self._bound is not None and self._bound.source is not bufs and _in_use(self._bound.source):
            raise ValueError(f"this {type(self).__name__} is already bound to another decoder's buffers; "
                             f"build one adapter (and KV cache) per decoder")
        # The KV storage lives in the module, so a second adapter over it shares it too.
        owner = _MODULE_OWNERS.get(self.module)
        held = None if owner is None else owner()
        if held is not None and held is not bufs and _in_use(held):
            raise ValueError(f"the torch module {_module_name(self.module)} already serves a live SpecDecoder "
                             f"through another adapter, and its KV storage lives in the module: build one "
                             f"module per decoder, or drop the first decoder before building a second")
        slack = getattr(self.module, "kv_slack", None)
        if slack is not None and slack < bufs.k + 2:
            raise ValueError(f"the module's kv_slack {slack} must be >= k + 2 = {bufs.k + 2}: a chain started at "
                             f"the last KV row would write past its storage")
        self._bound = TorchBufs(bufs)
        _MODULE_OWNERS[self.module] = weakref.ref(bufs)
        self._settle()

    def _views(self, bufs: StreamBufs) -> TorchBufs:
        if self._bound is None or self._bound.source is not bufs:
            # Binding here would sync, and DLPack cannot run inside a capture: the decoder binds.
            raise ValueError(f"{type(self).__name__} was called with buffers it is not bound to; "
                             f"SpecDecoder binds its models at construction")
        return self._bound

    def graph_buffers(self) -> dict:
        """The module's weights and buffers: baked into a graph, so the address guard watches them."""
        out = {f"param.{n}": p for n, p in self.module.named_parameters()}
        out.update({f"buffer.{n}": b for n, b in self.module.named_buffers()})
        return out

    def _on(self, stream):
        """Run torch ops on graphburst's stream (cupy) or in program order (numpy)."""
        torch = self.torch
        if not self.backend.is_gpu or torch.cuda.current_stream(self.backend.device_id).cuda_stream == stream.ptr:
            return contextlib.nullcontext()  # numpy, or torch already on it (a torch-driven capture)
        ts = self._streams.get(stream.ptr)
        if ts is None:
            ts = self._streams[stream.ptr] = torch.cuda.ExternalStream(stream.ptr, device=self.backend.device_id)
        return torch.cuda.stream(ts)

    def _forward(self, tokens, start_pos):
        """All-B forward at the shared length, then the length moves by T."""
        logits = self.module(tokens, start_pos, self._lengths, None)
        if self._length is not None:
            self._length.add_(tokens.shape[1])  # every layer's length (they share it)
        return logits

    def _tokens(self, t):
        return t.clamp(0, self.vocab - 1).long()  # PLACEHOLDER_TOKEN (-1) becomes a valid id

    def prefill(self, prompt, prompt_len, pos_ctr, pend, stream, *, start=None, rows=None, lengths=None) -> None:
        """Write the prompts' KV, or one chunk of each at ``start`` (protocol ``prefill``).

        Eager, on ``stream``. Given ``rows`` it never syncs with the device (the slot list
        comes from the host, host copies are non-blocking); without, it reads the slots
        from ``prompt_len`` (one sync).

        Parameters
        ----------
        prompt : [B, P_max] int32 backend array
        prompt_len : [B] int32, NO_PREFILL for a slot to leave untouched
        pos_ctr : [B] int32 (target) or None (draft), set to ``start + prompt_len``
        pend : [B] int32 or None: with it (the target's last chunk) the greedy token after
            the prompt, and in sampling mode its logits to ``tgt_logits[:, 0]``; without
            it the module runs no head at all
        start : [B] int32 backend array or None (all 0), the position of ``prompt[:, 0]``
        rows : host int array of the prefilled slots (sorted), or None
        lengths : host int array of their chunk lengths (with ``rows``), or None; a fresh call
            given them runs packed where :attr:`packed_prefill`
        """
        torch = self.torch
        with self._on(stream), torch.no_grad():
            tok_all, plen_all = as_tensor(prompt), as_tensor(prompt_len)
            idx = self._prefill_rows(plen_all, rows)  # [R] int64
            if idx is None:
                return
            plen = plen_all[idx]  # [R] int32
            at = torch.zeros_like(plen) if start is None else as_tensor(start)[idx]  # [R] int32 first position
            # start None: every row begins at position 0, so a module that can attends to the
            # prompt's own tokens only (Llama's ``fresh``)
            fresh = start is None and getattr(self.module, "accepts_fresh", False)
            if fresh and lengths is not None and self.packed_prefill:
                logits = self.prefill_graphs.run_packed(tok_all, rows, lengths, pend is not None)
            else:
                logits = self._prefill_forward(self._tokens(tok_all[idx]), at, self._cached_lengths(at), idx, plen,
                                               pend is not None, fresh)
            end = at + plen  # [R] int32
            if self._length is not None:
                self._length[idx] = end
            if pos_ctr is not None:
                as_tensor(pos_ctr)[idx] = end
            if pend is not None:
                if self._bound is not None and self._bound.source.sampling:
                    self._bound.tgt_logits[idx, 0] = logits.float()  # the decoder samples the first token
                as_tensor(pend)[idx] = logits.argmax(-1).to(torch.int32)

    def _cached_lengths(self, at):
        """Each layer's KV rows before a prefill call: its earlier chunks' (``at``), None without KV."""
        return [None if ln is None else at for ln in self._lengths]

    def _prefill_rows(self, plen_all, rows):
        """The prefilled slots as an ``[R] int64`` tensor on the model's device, or None if none."""
        torch = self.torch
        if rows is None:
            idx = torch.nonzero(plen_all != NO_PREFILL).flatten()  # reads the device: a sync
            return idx if idx.numel() else None
        host = np.asarray(rows)
        if host.ndim != 1 or (host.size and not np.issubdtype(host.dtype, np.integer)):
            raise TypeError(f"prefill rows must be a 1-D host array of slot indices, got {host.dtype} "
                            f"shape {host.shape}")
        if host.size == 0:
            return None
        idx = torch.from_numpy(np.ascontiguousarray(host, dtype=np.int64))
        if not self.backend.is_gpu:
            return idx
        # Pinned, from torch's caching host allocator (it keeps the block until the copy has
        # run), and non-blocking: the copy queues on the stream behind any burst in flight
        # and the host moves on. A pageable or blocking copy could wait for the stream.
        return idx.pin_memory().to(plen_all.device, non_blocking=True)

    def _prefill_forward(self, tokens, at, lengths, idx, plen, head: bool, fresh: bool = False):
        """The module's forward over the prompt rows: ``[R, V]`` logits after each row's last
        token when ``head``, else only the KV (as little head as the module allows) and None.
        ``fresh``: the module accepts ``fresh`` and every row starts at position 0."""
        torch, m = self.torch, self.module
        last = (plen.long() - 1).clamp(min=0)  # [R] the chunk's last token
        graphs = self.prefill_graphs
        if graphs is not None and (not fresh or not graphs.packed):  # a fresh packed call: prefill() packs
            # a later chunk (start > 0) replays a padded bucket too: chunked serving calls them often
            out = graphs.run(tokens, idx, last, head) if fresh else graphs.run_continued(tokens, idx, at, last, head)
            if out is not NotImplemented:  # else past every bucket, or a first use: eager below
                return out
        kw = {"fresh": True} if fresh else {}
        if not head and getattr(m, "accepts_head", False):
            m(tokens, at, lengths, idx, head=False, **kw)
            return None
        if getattr(m, "accepts_logits_at", False):
            logits = m(tokens, at, lengths, idx, logits_at=last, **kw)[:, 0]
        else:
            logits = m(tokens, at, lengths, idx, **kw)  # [R, P_max, V]
            logits = logits[torch.arange(idx.numel(), device=idx.device), last]
        return logits if head else None



# torch module -> weak reference to the StreamBufs its KV storage last served. Weak both
# ways: a dropped module or decoder frees its entry, so only a live decoder locks a module.
_MODULE_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _module_name(module) -> str:
    return f"{type(module).__name__} at 0x{id(module):x}"


def _in_use(bufs: StreamBufs) -> bool:
    """Whether a live decoder owns ``bufs`` (SpecDecoder sets ``bufs.decoder`` once it is built).

    Buffers of a construction that failed after binding (the other model refused), or of
    a decoder since dropped, hold nothing live: an adapter may bind anew.
    """
    owner = getattr(bufs, "decoder", None)
    return owner is not None and owner() is not None

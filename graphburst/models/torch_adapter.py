"""Turn a PyTorch module into a graphburst draft or target (the model protocol).

The module implements two things over torch tensors:

* ``kv_layers() -> list[Tensor | None]``: its preallocated KV storage, one entry per
  layer (None for a layer without KV). Storage is the module's own; graphburst only
  records its address.
* ``forward(tokens, start_pos, lengths, rows=None) -> logits``: ``tokens [R, T] int64``
  (valid ids), ``start_pos [R]`` the position of ``tokens[:, 0]``, ``lengths`` one
  ``[R] int32`` tensor (or None) per layer: the valid KV rows before the call. It writes
  the T tokens' KV at rows ``lengths + [0, T)`` of batch rows ``rows`` (``[R] int64``,
  None = all B), attends only below, returns ``[R, T, vocab]`` logits and **never moves
  a length** (the adapter advances them). ``graphburst.models.llama.Llama`` is one. A module
  with ``accepts_logits_at = True`` also takes ``logits_at [R] int64`` and returns only
  those positions' logits ``[R, 1, vocab]``; prefill then skips the rest of the head. One
  with ``accepts_head = True`` also takes ``head=False``: write the KV, return None (a
  prompt's non-final chunk, whose logits nobody reads). One with ``accepts_fresh = True``
  also takes ``fresh=True`` when every row starts at position 0 (a prefill called with
  ``start=None``), so it may attend to the call's own tokens only.

Chunked prefill (``chunked_prefill = True``): a chunk of a longer prompt runs with
``start_pos = lengths = start``, the rows its earlier chunks wrote, so the module attends
to them as it would inside one whole-prompt forward. Rows of a chunk shorter than the
longest are padded: their tokens past the chunk write KV rows past the new length (never
read, overwritten later), which may run past ``capacity`` plus slack; a module clamps
such writes into its own storage row (``Llama`` does, in ``kv_index``).

:class:`TorchTarget` and :class:`TorchDraft` do the rest: zero-copy torch views of the
``StreamBufs`` and of the KV lengths (made once, outside capture), the ``KVCache``,
placeholder clamping, argmax and confidence, the p-min break, the verify-token writes,
the draft's extra KV append and length bookkeeping. Bound to sampling StreamBufs
(``SpecDecoder(..., sampling=True)``), the target writes ``tgt_logits`` (and, at prefill,
the logits after the prompt to ``tgt_logits[:, 0]``), the draft writes ``draft_logits``
and appends its sampled last draft in ``draft_append_last``; greedy mode is unchanged.
On the cupy backend the ops run on the stream graphburst gives (a torch ``ExternalStream``
over it); on numpy they run on CPU tensors that alias the numpy buffers, which is how CI
tests this file.

Inside ``draft_step`` and ``verify`` nothing syncs or reads a value on the host; nor does
``prefill`` when the decoder hands it the slot list (``rows``).
"""

from __future__ import annotations

import contextlib
import weakref

import numpy as np

from ..backend import Backend, get_backend
from ..buffers import KVCache, KVLayer, StreamBufs
from ..constants import NO_PREFILL
from ..guard import Watched
from ..validate import check_int, check_prob
from .packed_prefill import prefill_graphs_for


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

    capture_api = "torch"  # the burst graph must be captured by torch (see the lead's capture path)
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


class TorchTarget(_TorchModel):
    """A torch module as a graphburst target.

    Parameters
    ----------
    module
        ``kv_layers()`` and ``forward(tokens, start_pos, lengths, rows)`` (module docstring).
    batch, capacity : int
        Slots, and KV entries per slot graphburst may fill (the storage needs slack rows past it).
    backend : Backend or str
        cupy: the module's tensors are on that CUDA device; numpy: on CPU.
    vocab : int, optional
        Defaults to ``module.vocab``.
    prefill_graphs : bool, optional
        Replay bucketed CUDA graphs for prefills at position 0
        (:mod:`~graphburst.models.prefill_graphs`). Default: on a GPU, when the module
        can (``accepts_fresh``, ``accepts_logits_at``, ``accepts_head``). True on numpy runs
        the same buckets eagerly.
    packed_prefill : bool, optional
        With prefill graphs: lay a fresh admission's prompts end to end in one call
        (:mod:`~graphburst.models.packed_prefill`) instead of padding each to the call's
        longest. Default: where the module ``accepts_packed`` and the flash kernel serves its
        dtype on its GPU (fp16/bf16, Ampere on), and on the CPU (``prefill_graphs_for``).
    """

    _prefill_head = True  # a fresh prefill's final chunk computes the logits after the prompt

    def verify(self, bufs: StreamBufs, stream) -> None:
        """Logits at ``pos_ctr + [0, k]`` for ``vtok``; greedy tokens into ``tgt_pred [B, k+1]``."""
        t = self._views(bufs)
        with self._on(stream), self.torch.no_grad():
            logits = self._forward(self._tokens(t.vtok), t.pos_ctr)  # [B, k+1, V]
            if bufs.sampling:
                t.tgt_logits.copy_(logits)  # float32; the burst turns them into probabilities
            else:
                t.tgt_pred.copy_(logits.argmax(-1))


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


class TorchDraft(_TorchModel):
    """A torch module as a graphburst draft (greedy proposals, softmax confidence).

    Parameters
    ----------
    module, batch, capacity, backend, vocab, prefill_graphs, packed_prefill
        As for :class:`TorchTarget`.
    p_min : float
        A proposal whose probability is below this breaks the chain (0: never).
    writes_verify_tokens : bool
        Also write usable proposals into ``vtok[:, 1 + step]`` so the burst skips its
        assemble launch.
    """

    _prefill_head = False  # a draft's prefill writes only the KV

    def __init__(self, module, *, batch: int, capacity: int, backend: Backend | str = "auto", vocab: int | None = None,
                 p_min: float = 0.0, writes_verify_tokens: bool = True, prefill_graphs: bool | None = None,
                 packed_prefill: bool | None = None):
        super().__init__(module, batch=batch, capacity=capacity, backend=backend, vocab=vocab,
                         prefill_graphs=prefill_graphs, packed_prefill=packed_prefill)
        self.p_min = check_prob("p_min", p_min)
        self.writes_verify_tokens = bool(writes_verify_tokens)

    def draft_step(self, bufs: StreamBufs, step: int, stream) -> None:
        """Propose ``draft_tok[:, step]`` from the previous token at ``pos_ctr + step``."""
        torch, t, k = self.torch, self._views(bufs), bufs.k
        with self._on(stream), torch.no_grad():
            prev = t.vtok[:, :1] if step == 0 else t.draft_tok[:, step - 1: step]  # [B, 1] int32
            logits = self._forward(self._tokens(prev), t.pos_ctr + step)[:, -1]  # [B, V]
            if bufs.sampling:
                # The decoder samples draft_tok[:, step] from these, before step + 1 reads it.
                t.draft_logits[:, step].copy_(logits)
                if self.p_min > 0.0:
                    self._break(t, step, torch.softmax(logits.float(), dim=-1).amax(dim=-1))
                return
            conf, tok = torch.softmax(logits, dim=-1).max(dim=-1)  # [B] float32, [B] int64
            t.draft_tok[:, step].copy_(tok)
            t.draft_conf[:, step].copy_(conf)
            if self.p_min > 0.0:
                self._break(t, step, conf)
            if self.writes_verify_tokens:
                usable = t.brk[:, 1] == 0
                t.vtok[:, 1 + step].copy_(torch.where(usable, tok.to(torch.int32), t.vtok[:, 1 + step]))
            if step == k - 1:
                # All k accepted keeps anchor + k + 1 entries: append the last proposal's KV too.
                self._forward(tok.unsqueeze(1), t.pos_ctr + k)

    def _break(self, t, step: int, conf) -> None:
        """First low-confidence step of a still-unbroken row: ``brk = [step, 1]`` (n_valid = step)."""
        torch = self.torch
        newly = (t.brk[:, 1] == 0) & (conf < self.p_min)
        t.brk[:, 0].copy_(torch.where(newly, step, t.brk[:, 0]))
        t.brk[:, 1].copy_(torch.where(newly, 1, t.brk[:, 1]))

    def draft_append_last(self, bufs: StreamBufs, stream) -> None:
        """Sampling mode: the sampled last draft's KV at ``pos_ctr + k`` (protocol rule 2)."""
        t, k = self._views(bufs), bufs.k
        with self._on(stream), self.torch.no_grad():
            self._forward(self._tokens(t.draft_tok[:, k - 1:k]), t.pos_ctr + k)

"""Fixed-address burst buffers, KV caches and the device pointer tables over them.

Everything here is allocated once; a captured burst graph bakes in these addresses, so
nothing may be reallocated while a graph that uses it lives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .backend import Backend, get_backend
from .burst_tokens import BurstTokens
from .guard import Watched
from .kernels.sampling_scratch import SCRATCH_LAYOUT
from .constants import ABSENT_LAYER, MAX_K, MAX_TABLE_ENTRIES, NO_EOS, SAMPLE_MAX_VOCAB, TOP_P_OFF
from .validate import check_array, check_int


class StreamBufs(Watched):
    """Per-burst buffers of a batch of B sequences, k drafts per round, M rounds a burst.

    Parameters
    ----------
    batch, k, m_rounds : int
        B >= 1, 1 <= k <= MAX_K, M >= 1.
    backend : Backend or str
        Where the buffers live.

    Notes
    -----
    The ring holds at most ``M * (k + 1)`` tokens per sequence: every round commits
    between 1 and k + 1. ``ring[b, 0]`` is the count, reset by a burst's first round.
    """

    #: buffer name -> (shape as a function of (B, k, M), dtype); the single source of
    #: truth for allocation, the address guard and the byte count.
    LAYOUT = {
        "vtok": (lambda b, k, m: (b, k + 1), np.int32),  # assembled verify tokens
        "brk": (lambda b, k, m: (b, 2), np.int32),  # p-min break: [n_valid drafts, broke]
        "pend": (lambda b, k, m: (b,), np.int32),  # pending (bonus-fold) token
        "last_pred": (lambda b, k, m: (b,), np.int32),  # bonus: target prediction after the accepted run
        "pos_ctr": (lambda b, k, m: (b,), np.int32),  # device position counter (append base)
        "pos_start": (lambda b, k, m: (b,), np.int32),  # round-start position (rollback anchor)
        "ring": (lambda b, k, m: (b, m * (k + 1) + 1), np.int32),  # committed tokens, column 0 = count
        "acc": (lambda b, k, m: (b, 2), np.int32),  # [accepted drafts, rounds that committed]
        "draft_tok": (lambda b, k, m: (b, k), np.int32),  # draft proposals
        "draft_conf": (lambda b, k, m: (b, k), np.float32),  # draft confidences
        "tgt_pred": (lambda b, k, m: (b, k + 1), np.int32),  # target greedy prediction per position
        "n_acc": (lambda b, k, m: (b,), np.int32),  # accepted drafts this round
        "n_commit": (lambda b, k, m: (b,), np.int32),  # tokens committed this round
        "eos": (lambda b, k, m: (b,), np.int32),  # stop token, NO_EOS for none
        "budget": (lambda b, k, m: (b,), np.int32),  # tokens still allowed (0: idle), UNBOUNDED_BUDGET for none
    }

    #: sampling mode only (``vocab`` given): name -> (shape as a function of (B, k, M, V), dtype).
    SAMPLING_LAYOUT = {
        "tgt_logits": (lambda b, k, m, v: (b, k + 1, v), np.float32),  # target logits per verify position; probs here
        "draft_logits": (lambda b, k, m, v: (b, k, v), np.float32),  # draft logits per step; probs in place
        "temperature": (lambda b, k, m, v: (b,), np.float32),  # per slot; 0 = greedy
        "top_k": (lambda b, k, m, v: (b,), np.int32),  # per slot; TOP_K_OFF = 0 keeps every token
        "top_p": (lambda b, k, m, v: (b,), np.float32),  # per slot; TOP_P_OFF = 1 keeps every token
        "seed": (lambda b, k, m, v: (b,), np.uint64),  # per slot Philox key
        **SCRATCH_LAYOUT,  # the sampling kernels' per-tile partials (sampling_scratch.py)
    }

    _watched = frozenset(LAYOUT) | frozenset(SAMPLING_LAYOUT) | {"out_block"}
    #: buffers the host reads back after every burst; they share one allocation
    #: (``out_block``) so a graph copies them to the host in a single node. The position
    #: counter and budget ride along so the host mirror of a drained burst is two copies
    #: (``SpecDecoder.finish_burst``) instead of recomputing stops and budgets in a dozen
    #: numpy calls between bursts, while the GPU may wait.
    OUTPUTS = ("ring", "acc", "pos_ctr", "budget")

    def __init__(self, batch: int, k: int, m_rounds: int, backend: Backend | str = "auto", *,
                 vocab: int | None = None):
        self.batch = check_int("batch", batch)
        self.k = check_int("k", k, minimum=0, maximum=MAX_K)  # 0: plain decoding (engine/no_draft.py)
        self.m_rounds = check_int("m_rounds", m_rounds)
        self.backend = get_backend(backend)
        #: Sampling mode: the models write logits (``tgt_logits``, ``draft_logits``) and the
        #: burst samples; the buffers of ``SAMPLING_LAYOUT`` exist only then.
        self.sampling = vocab is not None
        self.vocab = None if vocab is None else check_int("vocab", vocab, minimum=2, maximum=SAMPLE_MAX_VOCAB)
        if self.sampling:
            for name, (shape, dtype) in self.SAMPLING_LAYOUT.items():
                setattr(self, name, self.backend.zeros(shape(self.batch, self.k, self.m_rounds, self.vocab), dtype))
            self.top_p[...] = TOP_P_OFF
        shapes = {name: shape(self.batch, self.k, self.m_rounds) for name, (shape, _) in self.LAYOUT.items()}
        for name, (_, dtype) in self.LAYOUT.items():
            if name not in self.OUTPUTS:
                setattr(self, name, self.backend.zeros(shapes[name], dtype))
        self._out_shapes = [shapes[n] for n in self.OUTPUTS]
        size = sum(int(np.prod(shape)) for shape in self._out_shapes)
        self.out_block = self.backend.zeros((size,), np.int32)  # [B*R + 4B] int32: ring, acc, pos_ctr, budget
        self.eos[...] = NO_EOS  # budget stays 0: a slot is idle, and emits nothing, until a prefill

    def _outputs(self) -> list:
        # Views are cached per block, so rebinding out_block moves ring and acc with it.
        cached = self.__dict__.get("_out_cache")
        if cached is None or cached[0] is not self.out_block:
            cached = (self.out_block, split_out_block(self.out_block, self._out_shapes))
            object.__setattr__(self, "_out_cache", cached)
        return cached[1]

    @property
    def ring(self):
        """``[B, M*(k+1) + 1] int32`` committed tokens, column 0 = count (a view of out_block)."""
        return self._outputs()[0]

    @property
    def acc(self):
        """``[B, 2] int32`` accept counters ``[accepted drafts, rounds]`` (a view of out_block)."""
        return self._outputs()[1]

    @property
    def pos_ctr(self):
        """``[B] int32`` device position counter, the append base (a view of out_block)."""
        return self._outputs()[2]

    @property
    def budget(self):
        """``[B] int32`` tokens still allowed, 0 idle or stopped (a view of out_block)."""
        return self._outputs()[3]

    @property
    def output_shapes(self) -> list:
        """Shapes of :attr:`OUTPUTS` in ``out_block`` order (for views of a host copy)."""
        return list(self._out_shapes)

    @property
    def ring_capacity(self) -> int:
        """Most tokens one burst can commit per sequence."""
        return self.m_rounds * (self.k + 1)

    def arrays(self) -> dict:
        """Every buffer by name (the set a burst graph bakes in), sampling buffers included."""
        names = [*self.LAYOUT, *(self.SAMPLING_LAYOUT if self.sampling else ())]
        return {name: getattr(self, name) for name in names}

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays().values())

    @classmethod
    def layout_nbytes(cls, batch: int, k: int, m_rounds: int, vocab: int | None = None) -> int:
        """The bytes :attr:`nbytes` will report for these arguments, without allocating (KV sizing)."""
        layouts = [(cls.LAYOUT, ())] + ([(cls.SAMPLING_LAYOUT, (vocab,))] if vocab is not None else [])
        return sum(int(np.prod(shape(batch, k, m_rounds, *extra))) * np.dtype(dtype).itemsize
                   for layout, extra in layouts for shape, dtype in layout.values())

    def drain_ring(self, stream) -> BurstTokens:
        """Read each sequence's committed tokens of the last burst, in order.

        This is the one host sync of a burst. The count is reset on the device by the
        next burst's first round, so draining twice returns the same tokens.

        Parameters
        ----------
        stream : stream the burst ran on

        Returns
        -------
        BurstTokens
            Sequence b's tokens are ``tokens[b]``, a ``[n_b] int32`` array.
        """
        return BurstTokens(self.backend.to_host(self.ring, stream))


def split_out_block(block, shapes) -> list:
    """Views of a flat ``out_block`` (device or host copy) as the output buffers, in order."""
    views, at = [], 0
    for shape in shapes:
        n = int(np.prod(shape))
        views.append(block[at : at + n].reshape(shape))
        at += n
    return views


class KVLayer(Watched):
    """One attention layer's KV: caller-owned storage plus its per-sequence length.

    Parameters
    ----------
    storage : array
        The layer's KV storage, in any layout the model likes (the burst never reads
        it; only its address enters the address guard).
    length : [B] int32 array
        Valid entries per sequence; the rollback kernel writes it.
    """

    _watched = frozenset({"storage", "length"})

    def __init__(self, storage, length):
        self.storage = storage
        self.length = length


class KVCache(Watched):
    """A model's KV cache: a list of layers, ``None`` for a layer without KV.

    Parameters
    ----------
    layers : sequence of KVLayer or None
    batch : int
    capacity : int
        Entries per sequence in every layer.
    backend : Backend or str
    """

    _watched = frozenset({"layers"})

    def __init__(self, layers: Sequence[KVLayer | None], batch: int, capacity: int, backend: Backend | str = "auto"):
        self.backend = get_backend(backend)
        self.batch = check_int("batch", batch)
        self.capacity = check_int("capacity", capacity, maximum=2**31 - 1)
        self.layers = tuple(layers)  # a tuple: swapping a layer means rebinding, which guards see
        for i, layer in enumerate(self.layers):
            if layer is None:
                continue
            if not isinstance(layer, KVLayer):
                raise TypeError(f"layers[{i}] must be a KVLayer or None, got {type(layer).__name__}")
            check_array(f"layers[{i}].length", layer.length, self.backend, (self.batch,), np.int32)
            self.backend.check_device(f"layers[{i}].storage", layer.storage)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_kv_layers(self) -> int:
        return sum(layer is not None for layer in self.layers)

    def lengths(self, stream) -> np.ndarray:
        """``[n_layers, B]`` host copy of every length, -1 for absent layers (a host sync)."""
        out = np.full((self.n_layers, self.batch), -1, np.int32)
        for i, layer in enumerate(self.layers):
            if layer is not None:
                out[i] = self.backend.to_host(layer.length, stream)
        return out


class PtrTable(Watched):
    """A device table of addresses; it holds every pointee so the pointers stay valid.

    Parameters
    ----------
    targets : sequence of array or None
    backend : Backend
    stream : optional
        The stream whose kernels read the table, or one they are ordered after: the
        addresses are copied on it. None: the device's current stream, the one a model
        built before its decoder uses (``SpecDecoder`` orders that stream's work before its
        own at construction and in ``refresh_tables``).

    Attributes
    ----------
    ptrs : [n] uint64 array on the backend; ``ABSENT_LAYER`` (0) marks no pointee
    targets : tuple of array or None, the pointees in table order
    stream : the stream the addresses were copied on (:meth:`resolve` reads on it)
    """

    _watched = frozenset({"ptrs", "targets"})

    def __init__(self, targets: Sequence, backend: Backend, *, stream=None):
        if len(targets) > MAX_TABLE_ENTRIES:
            raise ValueError(f"a pointer table holds at most {MAX_TABLE_ENTRIES} entries, got {len(targets)}")
        self.backend = backend
        self.targets = tuple(targets)
        self.stream = backend.current_stream() if stream is None else stream
        host = np.array(
            [ABSENT_LAYER if t is None else backend.address(t) for t in self.targets], dtype=np.uint64
        ).reshape(len(self.targets))  # [n] uint64
        self.ptrs = backend.to_device(host, self.stream)  # [n] uint64

    def __len__(self) -> int:
        return len(self.targets)

    def resolve(self) -> list:
        """Follow each address back to its array, as a kernel dereferences it.

        Raises ``KeyError`` for an address the table does not hold (a dangling entry).
        """
        by_addr = {self.backend.address(t): t for t in self.targets if t is not None}
        host = self.backend.to_host(self.ptrs, self.stream)
        return [None if int(p) == ABSENT_LAYER else by_addr[int(p)] for p in host]


def _as_caches(caches) -> list[KVCache]:
    if isinstance(caches, KVCache):
        return [caches]
    caches = list(caches)
    for i, c in enumerate(caches):
        if not isinstance(c, KVCache):
            raise TypeError(f"caches[{i}] must be a KVCache, got {type(c).__name__}")
    if not caches:
        raise ValueError("caches must name at least one KVCache")
    return caches


def kv_len_ptr_table_range(caches, layers: range, pos_ctr=None, *, stream=None) -> PtrTable:
    """Stage-local length-pointer table over a dense range of layers.

    Only the layers in ``layers`` (indices into the concatenated layer lists of
    ``caches``) enter the table, densely, so a pipeline stage never dereferences another
    stage's lengths. The position counter is appended when given.

    Parameters
    ----------
    caches : KVCache or sequence of KVCache
    layers : range with step 1 inside ``[0, total layers]``
    pos_ctr : [B] int32 array, optional
    stream : optional
        The stream the table is copied on (:class:`PtrTable`; None: the current stream).

    Returns
    -------
    PtrTable
        ``[len(layers) (+1)] uint64``; 0 for a layer without KV.
    """
    caches = _as_caches(caches)
    backend = caches[0].backend
    all_layers = [layer for c in caches for layer in c.layers]
    if not isinstance(layers, range) or layers.step != 1:
        raise TypeError(f"layers must be a range with step 1, got {layers!r}")
    if not 0 <= layers.start <= layers.stop <= len(all_layers):
        raise ValueError(f"layer range {layers!r} is outside the caches' {len(all_layers)} layers")
    for i, c in enumerate(caches):
        if c.backend.name != backend.name or c.batch != caches[0].batch:
            raise ValueError(f"caches[{i}] differs from caches[0] in backend or batch")
    targets = [None if layer is None else layer.length for layer in all_layers[layers.start : layers.stop]]
    if pos_ctr is not None:
        check_array("pos_ctr", pos_ctr, backend, (caches[0].batch,), np.int32)
        targets.append(pos_ctr)
    return PtrTable(targets, backend, stream=stream)


def kv_len_ptr_table(caches, pos_ctr=None, *, stream=None) -> PtrTable:
    """Length-pointer table over every layer of ``caches``, then ``pos_ctr`` if given.

    Parameters
    ----------
    caches : KVCache or sequence of KVCache
    pos_ctr : [B] int32 array, optional
    stream : optional
        As for :func:`kv_len_ptr_table_range`.

    Returns
    -------
    PtrTable
    """
    caches = _as_caches(caches)
    total = sum(c.n_layers for c in caches)
    return kv_len_ptr_table_range(caches, range(total), pos_ctr, stream=stream)


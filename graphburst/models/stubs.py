"""The built-in stub draft and target: deterministic models for tests and benchmarks.

The target's greedy token is a pure function of the whole prefix (a rolling digest,
:func:`graphburst.kernels.digest.greedy_reference`), computed through its KV cache: every layer
carries the digest, appends at its own length and reads only below it, and layers that
disagree garble the prediction. So a missing, partial or wrong rollback of any layer, or
of the position counter, changes the output. The draft computes the same digest
through its own layers and proposes the target's token with probability
``accept_prob``, keyed by (seed, position).

For sampling, each model also has a distribution per position (``stub_logits`` in
kernels.cu): a hashed logit row over the vocabulary, peaked at the model's greedy token,
so it depends only on the prefix and temperature 0 decodes exactly the greedy tokens.
The target's row is keyed by its greedy token and the draft's by its own proposal (with
other salts), so p and q differ and both the accept and the residual paths run.

Both implement protocol v1 (:mod:`graphburst.protocol`); nothing generic imports this
module.
"""

from __future__ import annotations

import math
import numbers

from collections.abc import Sequence

import numpy as np

from ..backend import Backend, get_backend
from ..buffers import KVCache, KVLayer, PtrTable, StreamBufs, kv_len_ptr_table_range
from ..kernels.digest import fixed24
from ..guard import Watched
from ..engine.admission.options import scatter_columns
from ..protocol import DraftModel, TargetModel
from ..validate import check_int, check_prob
from .capacity import MemorySpec

__all__ = ["StubDraft", "StubTarget", "normalize_layout", "storage_ptr_table", "stub_cache", "stub_memory_spec",
           "stub_pair"]

TARGET_SALT = 0x1B56C4E9  # stub_logits key of the target's rows
DRAFT_SALT = 0x3C6EF372  # ... and of the draft's
LOGIT_SPREAD = 2.0  # logits of non-greedy tokens lie in [0, spread)
STUB_ENTRY_BYTES = np.dtype(np.int32).itemsize  # a stub KV entry: one int32 digest
#: The stubs have no position limit; auto sizing stops here (2**20 entries) so that the
#: serving loop's host token rows (16 bytes per entry per slot) stay bounded on a big GPU.
STUB_MAX_CAPACITY = 2**20


def default_peak(vocab: int) -> float:
    """The greedy token's logit lead over the spread: 1 + ln(V) keeps its probability
    near e / (e + 1.3) ~ 0.7 at temperature 1 whatever the vocabulary size."""
    return 1.0 + math.log(vocab)


def normalize_layout(layers, name: str) -> list[bool]:
    """``layers`` as a KV/absent list: an int n means n KV layers, else a sequence of bools.

    Raises TypeError naming ``name`` for anything else (``True``, ``None``, a string...).
    """
    if isinstance(layers, numbers.Integral) and not isinstance(layers, (bool, np.bool_)):
        return [True] * check_int(name, layers)
    if isinstance(layers, np.ndarray):
        layers = layers.tolist()
    if isinstance(layers, (str, bytes, bytearray)) or not isinstance(layers, Sequence):
        raise TypeError(f"{name} must be an int (number of KV layers) or a sequence of bools (False: no KV), "
                        f"got {type(layers).__name__} {layers!r:.60}")
    for i, x in enumerate(layers):
        if not isinstance(x, (bool, np.bool_)) and not (isinstance(x, numbers.Integral) and x in (0, 1)):
            raise TypeError(f"{name}[{i}] must be a bool (True: a KV layer), got {type(x).__name__} {x!r:.60}")
    layout = [bool(x) for x in layers]
    if not any(layout):
        raise ValueError(f"{name} needs at least one KV layer to carry the stub digest, got {list(layers)!r}")
    return layout


def stub_cache(layout: Sequence[bool], batch: int, capacity: int, backend: Backend | str = "auto") -> KVCache:
    """Allocate a stub cache: ``[B, capacity] int32`` storage for each True in ``layout``."""
    backend = get_backend(backend)
    batch = check_int("batch", batch)
    capacity = check_int("capacity", capacity)
    layers = [
        KVLayer(backend.zeros((batch, capacity), np.int32), backend.zeros((batch,), np.int32)) if has_kv else None
        for has_kv in layout
    ]
    return KVCache(layers, batch, capacity, backend)


def stub_kv_bytes_per_row(layers) -> int:
    """Bytes per slot per KV row of a stub with ``layers`` (an int or a KV/absent layout)."""
    return STUB_ENTRY_BYTES * sum(normalize_layout(layers, "layers"))


def stub_memory_spec(layers, name: str) -> MemorySpec:
    """A stub model's :class:`MemorySpec` for KV sizing: only its cache grows with the capacity
    (the stub kernels have no activations)."""
    return MemorySpec(name, slot_row_bytes=stub_kv_bytes_per_row(layers), max_capacity=STUB_MAX_CAPACITY,
                      max_capacity_why="stub limit")


def storage_ptr_table(cache: KVCache, stream=None) -> PtrTable:
    """Storage-pointer table of a stub cache (what the stub kernels walk), copied on ``stream``
    (:class:`PtrTable`; None: the current stream)."""
    return PtrTable([None if layer is None else layer.storage for layer in cache.layers], cache.backend,
                    stream=stream)


class _StubModel(Watched):
    """Shared set-up of both stubs: a stub KV cache and its two pointer tables."""

    _watched = frozenset({"cache", "kv_table", "len_table", "seed", "agree24"})
    supports_sampling = True  # writes logits when bound to sampling StreamBufs
    chunked_prefill = True  # the digest continues from the entry below start
    prefill_in_graph = True  # the kernel reads prompt_len on the device: admission may be one graph

    def __init__(self, batch, vocab, layers, capacity, cost_ns, backend, role, logit_peak=None):
        self.backend = get_backend(backend)
        self.vocab = check_int("vocab", vocab, minimum=2, maximum=2**31 - 1)
        self.cost_ns = check_int("cost_ns", cost_ns, minimum=0)
        self.layout = normalize_layout(layers, f"{role} layers")
        self.cache = stub_cache(self.layout, batch, capacity, self.backend)
        peak = default_peak(self.vocab) if logit_peak is None else logit_peak
        if isinstance(peak, bool) or not isinstance(peak, numbers.Real) or not 0.0 < peak <= 1e4:
            raise ValueError(f"logit_peak must be a number in (0, 1e4], got {logit_peak!r}")
        self.logit_peak = float(peak)
        self._bufs = None  # the decoder's StreamBufs, from bind()
        self.refresh_tables()

    def bind(self, bufs: StreamBufs) -> None:
        """Keep the decoder's buffers: in sampling mode prefill writes ``tgt_logits``."""
        self._bufs = bufs

    def _sampling(self, bufs) -> bool:
        return bool(getattr(bufs, "sampling", False))

    def _logits(self, pred, pos, logits, salt, pos_offset, step, stream) -> None:
        self.backend.ops.stub_logits(pred, pos, logits, pos_offset=pos_offset, salt=salt, spread=LOGIT_SPREAD,
                                     peak=self.logit_peak, step=step, stream=stream)

    def refresh_tables(self) -> None:
        """Rebuild the pointer tables from the cache's current layers (before a recapture)."""
        self.kv_table = storage_ptr_table(self.cache)
        self.len_table = kv_len_ptr_table_range(self.cache, range(self.cache.n_layers))

    def watched(self) -> tuple:
        """The pointer tables: rebuilding one makes a captured graph stale."""
        return (self.kv_table, self.len_table)

    def graph_buffers(self) -> dict:
        """Buffers this model's kernels read or write, besides its cache and the StreamBufs."""
        out = {"kv_table": self.kv_table.ptrs, "len_table": self.len_table.ptrs}
        out.update({name: getattr(self, name) for name in ("seed", "agree24") if hasattr(self, name)})
        return out

    @property
    def batch(self) -> int:
        return self.cache.batch

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def prefill(self, prompt, prompt_len, pos_ctr, pend, stream, *, start=None, rows=None) -> None:
        """Enqueue the stub prefill of this model's cache (see ``stub_prefill``), at ``start``
        for a chunk of a longer prompt; a target bound to sampling buffers also writes the
        logits after the prompt to ``tgt_logits[:, 0]`` (with ``pend``: the last chunk).
        ``rows`` is not needed: the kernel reads ``prompt_len`` on the device."""
        self.backend.ops.stub_prefill(prompt, prompt_len, self.kv_table, self.len_table, self.capacity, self.vocab,
                                      pos_ctr, pend, start=start, stream=stream)
        if pend is not None and self._sampling(self._bufs):
            self._logits(pend.reshape(-1, 1), pos_ctr, self._bufs.tgt_logits, TARGET_SALT, 0, 0, stream)


class StubTarget(_StubModel, TargetModel):
    """Deterministic target model with a digest-carrying KV cache.

    Parameters
    ----------
    batch : int
    vocab : int
        >= 2.
    layers : int or sequence of bool
        Number of KV layers, or a layout where False marks a layer without KV.
    capacity : int
        KV entries per sequence.
    cost_ns : int
        Emulated device time per verify call.
    backend : Backend or str
    logit_peak : float, optional
        Sampling: the greedy token's logit lead (default :func:`default_peak`).
    """

    def __init__(self, batch: int, vocab: int, layers, capacity: int, *, cost_ns: int = 0,
                 backend: Backend | str = "auto", logit_peak: float | None = None):
        super().__init__(batch, vocab, layers, capacity, cost_ns, backend, "target", logit_peak)

    def verify(self, bufs: StreamBufs, stream) -> None:
        self.backend.ops.stub_verify(bufs.vtok, bufs.pos_ctr, self.kv_table, self.len_table, self.capacity,
                                     self.vocab, self.cost_ns, bufs.tgt_pred, stream=stream)
        if self._sampling(bufs):  # row t: the token at pos_ctr + t + 1, peaked at tgt_pred[:, t]
            self._logits(bufs.tgt_pred, bufs.pos_ctr, bufs.tgt_logits, TARGET_SALT, 1, None, stream)


class StubDraft(_StubModel, DraftModel):
    """Draft model that agrees with :class:`StubTarget` with a tunable probability.

    Parameters
    ----------
    batch, vocab, layers, capacity, cost_ns, backend
        As for :class:`StubTarget`; ``vocab`` must match the target's.
    accept_prob : float
        Probability in [0, 1] that a draft equals the target's greedy token,
        deterministic per (seed, position).
    p_min : float
        The chain breaks at the first draft whose confidence is below this.
    seed : int
        Agreement seed, per sequence through the ``seed`` option.

    Notes
    -----
    Per-request options (``option_keys``): ``accept_prob`` (float in [0, 1]) and
    ``seed`` (int in [0, 2**32)); a missing key keeps the model's default.
    """

    writes_verify_tokens = True  # each step also fills vtok[:, 1 + step]: no assemble launch
    option_keys = frozenset({"accept_prob", "seed"})

    def __init__(self, batch: int, vocab: int, layers, capacity: int, *, accept_prob: float = 0.7,
                 p_min: float = 0.0, seed: int = 0, cost_ns: int = 0, backend: Backend | str = "auto",
                 logit_peak: float | None = None):
        super().__init__(batch, vocab, layers, capacity, cost_ns, backend, "draft", logit_peak)
        self.p_min = check_prob("p_min", p_min)
        self.default_accept_prob = check_prob("accept_prob", accept_prob)
        self.default_seed = check_int("seed", seed, minimum=0, maximum=2**32 - 1)
        # The per-sequence settings are two int32 columns (``option_columns``): the decoder writes
        # an admitted slot's values in its admission launch, with no upload of its own.
        default = np.array(self._slot_values(self.default_seed, fixed24(self.default_accept_prob)), np.int32)
        # on the current stream, like the cache: the decoder orders that stream's work before its own
        self._slot_block = self.backend.to_device(np.repeat(default[:, None], self.batch, axis=1),
                                                  self.backend.current_stream())  # [2, B] int32
        self.seed = self._slot_block[0].view(np.uint32)  # [B] uint32
        self.agree24 = self._slot_block[1]  # [B] int32, 24-bit fixed point

    @staticmethod
    def _slot_values(seed: int, agree24: int) -> tuple:
        """A slot's ``(seed, agree24)`` column values: the uint32 seed as its int32 bit pattern."""
        return (seed - 2**32 if seed >= 2**31 else seed), agree24

    def option_columns(self) -> tuple:
        """The ``[B]`` int32 columns of the per-slot settings: seed (uint32 viewed as int32), agree24."""
        return self._slot_block[0], self._slot_block[1]

    def slot_options(self, options: dict) -> tuple:
        """Validate ``{"accept_prob": p, "seed": s}`` (either optional; a missing key takes the
        model's default) as the slot's ``(seed, agree24)`` option column values."""
        unknown = set(options) - self.option_keys
        if unknown:
            raise ValueError(f"unknown stub draft option {sorted(unknown)[0]!r}")
        prob, seed = options.get("accept_prob"), options.get("seed")
        prob = self.default_accept_prob if prob is None else check_prob("accept_prob", prob)
        seed = self.default_seed if seed is None else check_int("seed", seed, minimum=0, maximum=2**32 - 1)
        return self._slot_values(seed, fixed24(prob))

    def set_slots(self, settings: dict, stream=None) -> None:
        """Set sequences' agreement probability and seed between bursts (stream-ordered scatters
        of the named slots only: a decoder may have written the others at admission).

        Parameters
        ----------
        settings : dict
            ``slot -> (accept_prob or None, seed or None)``; None restores the default.
        stream : optional
            The stream whose kernels read the settings (a decoder's ``stream``); None: the
            device's current stream.
        """
        self.set_slot_options({slot: self.slot_options({"accept_prob": accept_prob, "seed": seed})
                               for slot, (accept_prob, seed) in settings.items()},
                              self.backend.current_stream() if stream is None else stream)

    def set_slot_options(self, settings: dict, stream) -> None:
        """Write :meth:`slot_options` results (None: the defaults) to the named slots' columns. A
        decoder writes them itself at admission (``option_columns``) and does not call this."""
        settings = {check_int("slot", b, minimum=0, maximum=self.batch - 1): v for b, v in settings.items()}
        scatter_columns(self.backend, self.option_columns(), settings, self.slot_options({}), stream)

    def set_slot(self, slot: int, *, accept_prob: float | None = None, seed: int | None = None, stream=None) -> None:
        """Set one sequence's agreement probability or seed (None: the default)."""
        self.set_slots({slot: (accept_prob, seed)}, stream)

    def draft_step(self, bufs: StreamBufs, step: int, stream) -> None:
        sampling = self._sampling(bufs)
        self.backend.ops.stub_draft_step(step, bufs.vtok, bufs.pos_ctr, self.kv_table, self.len_table, self.capacity,
                                         self.vocab, self.seed, self.agree24, fixed24(self.p_min), self.cost_ns,
                                         bufs.draft_tok, bufs.draft_conf, bufs.brk, extend_last=not sampling,
                                         stream=stream)
        if sampling:  # the row for pos_ctr + step + 1, peaked at the greedy proposal the decoder then replaces
            self._logits(bufs.draft_tok, bufs.pos_ctr, bufs.draft_logits, DRAFT_SALT, 1, step, stream)

    def draft_append_last(self, bufs: StreamBufs, stream) -> None:
        """Sampling mode: the KV entry of the sampled last draft (see ``stub_draft_append``)."""
        self.backend.ops.stub_draft_append(bufs.draft_tok, bufs.pos_ctr, bufs.brk, self.kv_table, self.len_table,
                                           self.capacity, stream=stream)


def stub_pair(batch: int, vocab: int, target_layers: Sequence[bool] | int, draft_layers: Sequence[bool] | int,
              capacity: int, *, accept_prob: float = 0.7, p_min: float = 0.0, seed: int = 0, cost_ns: int = 0,
              backend: Backend | str = "auto", logit_peak: float | None = None) -> tuple[StubTarget, StubDraft]:
    """Build a matching stub target and draft on one backend (``logit_peak``: both models' sampling peak)."""
    target_layers = normalize_layout(target_layers, "target_layers")
    draft_layers = normalize_layout(draft_layers, "draft_layers")
    backend = get_backend(backend)
    target = StubTarget(batch, vocab, target_layers, capacity, cost_ns=cost_ns, backend=backend, logit_peak=logit_peak)
    draft = StubDraft(batch, vocab, draft_layers, capacity, accept_prob=accept_prob, p_min=p_min, seed=seed,
                      cost_ns=cost_ns, backend=backend, logit_peak=logit_peak)
    return target, draft

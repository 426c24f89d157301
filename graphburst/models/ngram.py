"""Prompt-lookup (n-gram) drafting: a draft that is not a model, computed inside the burst.

:class:`NgramDraft` fills the draft side of protocol v1 (:mod:`graphburst.protocol`) with
no weights. Each sequence's token history lives on the device (``hist [B, capacity]``,
the prompt then the committed tokens, at a fixed address); one kernel per round
(``ngram_search`` in ``kernels/ngram.cuh``) finds the most recent earlier occurrence of
the sequence's last n tokens, trying n from ``n_max`` down to ``n_min``, and proposes up
to k tokens that followed. The burst stays M rounds of one target with no host in the
loop; vLLM, SGLang, TensorRT-LLM and transformers compute the same proposal on the host
between rounds.

How the history stays exact with nothing but the burst's own kernels: at round start
the search stores the pending token ``vtok[:, 0]`` at ``pos_ctr`` and its proposals
after it (in sampling mode ``draft_append_last`` stores the drafts the burst actually
sampled). The committed tokens of a round are the pending token and the accepted
drafts, so after the rollback every entry below the new ``pos_ctr`` is the sequence;
entries above it are stale and never read. The history is the draft's one "KV layer",
so the burst's rollback sets its length like any draft's.

A round with no match proposes nothing (``brk = [0, 1]``): the verify checks only the
pending token and the round commits it plus the target's bonus token, as plain decoding
would, at the cost of the search kernel alone (no draft forward). Idle and finished
slots (budget 0) skip the search.

Sampling mode: a deterministic proposal is a one-hot q (logits 0 at the token, -inf
elsewhere), so the burst's rejection sampling stays lossless: a draft x is accepted with
probability p(x) and a rejection resamples from max(0, p - q), which is p without x.
"""

from __future__ import annotations

import numpy as np

from ..backend import Backend, get_backend
from ..buffers import KVCache, KVLayer, StreamBufs
from ..constants import NGRAM_MAX
from ..guard import Watched
from ..engine.admission.options import scatter_columns
from ..protocol import DraftModel
from ..validate import check_int
from .capacity import MemorySpec

__all__ = ["DEFAULT_NGRAM_MAX", "DEFAULT_NGRAM_MIN", "NGRAM_DRAFT", "NgramDraft", "check_ngram_range", "ngram_for"]

NGRAM_DRAFT = "ngram"  # the draft name (--draft, ServeConfig.draft) that selects prompt lookup

DEFAULT_NGRAM_MIN = 1  # a single repeated token already predicts copies in code and quoting
DEFAULT_NGRAM_MAX = 4  # longer suffixes pick the right one of several earlier occurrences


def check_ngram_range(n_min, n_max, *, prefix: str = "ngram") -> tuple[int, int]:
    """``(n_min, n_max)`` validated: ``1 <= n_min <= n_max <= NGRAM_MAX``; names ``{prefix}_min/max``."""
    lo = check_int(f"{prefix}_min", n_min, minimum=1, maximum=NGRAM_MAX)
    hi = check_int(f"{prefix}_max", n_max, minimum=1, maximum=NGRAM_MAX)
    if lo > hi:
        raise ValueError(f"{prefix}_min ({lo}) must be <= {prefix}_max ({hi})")
    return lo, hi


class NgramDraft(Watched, DraftModel):
    """Prompt-lookup draft: proposes what followed the last n tokens earlier in the sequence.

    Parameters
    ----------
    batch : int
    vocab : int
        The target's vocabulary (proposals are always tokens of the history).
    capacity : int
        History entries per sequence: the prompt plus every generated token must fit
        (use the target's KV capacity).
    n_min, n_max : int
        The n-gram lengths tried, longest first: ``1 <= n_min <= n_max <= NGRAM_MAX``.
    backend : Backend or str

    Notes
    -----
    Per-request options (``option_keys``): ``ngram_min`` and ``ngram_max`` (ints in
    ``[1, NGRAM_MAX]``); a missing key keeps the drafter's default.
    """

    writes_verify_tokens = True  # the search fills vtok[:, 1 + j] itself: no assemble launch
    supports_sampling = True  # one-hot draft logits (see the module docstring)
    chunked_prefill = True  # a chunk is a copy at its offset
    prefill_in_graph = True  # the copy reads prompt_len on the device: admission may be one graph
    option_keys = frozenset({"ngram_min", "ngram_max"})
    _watched = frozenset({"cache", "hist", "hist_len", "n_min", "n_max", "prop"})

    def __init__(self, batch: int, vocab: int, capacity: int, *, n_min: int = DEFAULT_NGRAM_MIN,
                 n_max: int = DEFAULT_NGRAM_MAX, backend: Backend | str = "auto"):
        self.backend = get_backend(backend)
        batch = check_int("batch", batch)
        self.vocab = check_int("vocab", vocab, minimum=2, maximum=2**31 - 1)
        capacity = check_int("capacity", capacity, maximum=2**31 - 2)
        self.default_range = check_ngram_range(n_min, n_max)
        self.hist = self.backend.zeros((batch, capacity), np.int32)  # [B, capacity] int32 token history
        self.hist_len = self.backend.zeros((batch,), np.int32)  # [B] int32: the burst's rollback sets it
        self.cache = KVCache([KVLayer(self.hist, self.hist_len)], batch, capacity, self.backend)
        # Per-slot n-gram range, as two option columns: the decoder writes an admitted slot's
        # values in its admission launch (``option_columns``).
        self.n_min = self.backend.full((batch,), self.default_range[0], np.int32)  # [B] int32
        self.n_max = self.backend.full((batch,), self.default_range[1], np.int32)  # [B] int32
        self.prop = None  # [B, k] int32 sampling-mode proposals, from bind()

    @property
    def batch(self) -> int:
        return self.cache.batch

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @staticmethod
    def kv_bytes_per_row() -> int:
        """Bytes per slot per history row: one int32 token (the draft's only per-row storage)."""
        return np.dtype(np.int32).itemsize

    @classmethod
    def memory_spec(cls) -> MemorySpec:
        """The :class:`MemorySpec` for KV sizing: the history grows with the capacity, nothing else."""
        return MemorySpec("n-gram draft", slot_row_bytes=cls.kv_bytes_per_row(), max_capacity=2**31 - 2,
                          max_capacity_why="int32 positions")

    def __repr__(self) -> str:
        lo, hi = self.default_range
        return f"NgramDraft(batch={self.batch}, capacity={self.capacity}, n_min={lo}, n_max={hi})"

    # ------------------------------------------------------------------ protocol hooks

    def bind(self, bufs: StreamBufs) -> None:
        """Allocate the proposal buffer for the decoder's k (sampling mode samples over it).

        ``empty``, not ``zeros``: no fill kernel to race the decoder's stream, and the
        search writes every entry before anything reads it.
        """
        if self.prop is None or self.prop.shape != (bufs.batch, bufs.k):
            with self.backend.device():
                self.prop = self.backend.xp.empty((bufs.batch, bufs.k), np.int32)  # [B, k] int32

    def graph_buffers(self) -> dict:
        """Buffers the captured search reads or writes besides the cache and the StreamBufs."""
        out = {"ngram_n_min": self.n_min, "ngram_n_max": self.n_max}
        if self.prop is not None:
            out["ngram_prop"] = self.prop
        return out

    def prefill(self, prompt, prompt_len, pos_ctr, pend, stream, *, start=None, rows=None) -> None:
        """Copy each prefilled slot's prompt (or its chunk, at ``start``) into its history
        (``ngram_prefill``); ``rows`` is not needed, the kernel reads ``prompt_len``."""
        self.backend.ops.ngram_prefill(prompt, prompt_len, self.hist, self.hist_len, start=start, stream=stream)

    def draft_step(self, bufs: StreamBufs, step: int, stream) -> None:
        """Step 0 searches and proposes every draft of the round; later greedy steps are free.

        In sampling mode each step writes its row of one-hot logits for the burst to
        sample (the proposals wait in ``prop``).
        """
        sampling = bool(getattr(bufs, "sampling", False))
        ops = self.backend.ops
        if step == 0:
            ops.ngram_search(bufs.vtok, bufs.pos_ctr, bufs.budget, self.n_min, self.n_max, self.hist, self.hist_len,
                             self.prop if sampling else bufs.draft_tok, bufs.draft_conf, bufs.brk,
                             write_vtok=not sampling, stream=stream)
        if sampling:
            ops.ngram_onehot_logits(self.prop, bufs.brk, bufs.draft_logits, step=step, stream=stream)

    def draft_append_last(self, bufs: StreamBufs, stream) -> None:
        """Sampling mode: the history gets the drafts the burst sampled (``ngram_append``)."""
        self.backend.ops.ngram_append(bufs.draft_tok, bufs.pos_ctr, bufs.brk, self.hist, stream=stream)

    # ------------------------------------------------------------------ per-request options

    def option_columns(self) -> tuple:
        """The ``[B]`` int32 columns the search reads: ``n_min``, ``n_max``."""
        return self.n_min, self.n_max

    def slot_options(self, options: dict) -> tuple:
        """Validate ``{"ngram_min": a, "ngram_max": b}`` (either optional) against the defaults:
        the slot's ``(n_min, n_max)`` option column values."""
        unknown = set(options) - self.option_keys
        if unknown:
            raise ValueError(f"unknown n-gram draft option {sorted(unknown)[0]!r}")
        lo = options.get("ngram_min", self.default_range[0])
        hi = options.get("ngram_max", self.default_range[1])
        return check_ngram_range(lo, hi)

    def set_slot_options(self, settings: dict, stream) -> None:
        """Write :meth:`slot_options` results (None: the defaults) to the named slots' columns. A
        decoder writes them itself at admission (``option_columns``) and does not call this."""
        settings = {check_int("slot", b, minimum=0, maximum=self.batch - 1): v for b, v in settings.items()}
        scatter_columns(self.backend, self.option_columns(), settings, self.default_range, stream)


def ngram_for(target, *, n_min: int = DEFAULT_NGRAM_MIN, n_max: int = DEFAULT_NGRAM_MAX) -> NgramDraft:
    """A prompt-lookup draft sized for ``target``: its batch, vocabulary, KV capacity and backend."""
    cache = target.cache
    return NgramDraft(cache.batch, target.vocab, cache.capacity, n_min=n_min, n_max=n_max, backend=cache.backend)

"""The model protocol a caller implements, and the built-in stub draft and target.

Protocol
--------
A burst calls the models through two methods that only *enqueue* work on the stream
they are given, over the documented :class:`~graphburst.buffers.StreamBufs` fields:

* ``draft.draft_step(bufs, step, stream)`` for ``step`` in ``[0, k)``. Step j reads its
  input token (``vtok[:, 0]`` for j = 0, else ``draft_tok[:, j-1]``) at position
  ``pos_ctr + j`` and writes ``draft_tok[:, j]``. A chain that stops early sets
  ``brk[b] = [n_valid, 1]`` (the round starts with ``[k, 0]``). After the chain, each
  draft KV layer must hold valid entries at positions ``[anchor, anchor + n_valid]``,
  so that rollback to any accepted length leaves only real entries. A draft that also
  writes each usable proposal to ``vtok[:, 1 + j]`` (the round starts with slots 1..k
  set to ``PLACEHOLDER_TOKEN``) sets ``writes_verify_tokens = True``, and the burst then
  skips the ``assemble_verify`` launch.
* ``target.verify(bufs, stream)`` reads ``vtok [B, k+1]`` at positions
  ``pos_ctr + [0, k]`` (slots past the break hold ``PLACEHOLDER_TOKEN``: clamp before
  an embedding lookup), appends KV entries and writes the greedy prediction after each
  position into ``tgt_pred [B, k+1]``.

Both must be capturable: no allocation, no host sync, fixed addresses. Each exposes a
``cache`` (:class:`~graphburst.buffers.KVCache`) whose lengths the burst rolls back.

The stubs
---------
The target's greedy token is a pure function of the whole prefix (a rolling digest,
:func:`graphburst.digest.greedy_reference`), computed through its KV cache: every layer
carries the digest, appends at its own length and reads only below it, and layers that
disagree garble the prediction. So a missing, partial or wrong rollback of any layer, or
of the position counter, changes the output. The draft computes the same digest
through its own layers and proposes the target's token with probability
``accept_prob``, keyed by (seed, position).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from .backend import Backend, get_backend
from .buffers import KVCache, StreamBufs, kv_len_ptr_table_range, storage_ptr_table
from .digest import fixed24
from .guard import Watched
from .validate import check_int, check_prob


@runtime_checkable
class DraftModel(Protocol):
    cache: KVCache

    def draft_step(self, bufs: StreamBufs, step: int, stream) -> None: ...


@runtime_checkable
class TargetModel(Protocol):
    cache: KVCache

    def verify(self, bufs: StreamBufs, stream) -> None: ...


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


class _StubModel(Watched):
    """Shared set-up of both stubs: a stub KV cache and its two pointer tables."""

    _watched = frozenset({"cache", "kv_table", "len_table", "seed", "agree24"})

    def __init__(self, batch, vocab, layers, capacity, cost_ns, backend, role):
        self.backend = get_backend(backend)
        self.vocab = check_int("vocab", vocab, minimum=2, maximum=2**31 - 1)
        self.cost_ns = check_int("cost_ns", cost_ns, minimum=0)
        self.layout = normalize_layout(layers, f"{role} layers")
        self.cache = KVCache.for_stub(self.layout, batch, capacity, self.backend)
        self.refresh_tables()

    def refresh_tables(self) -> None:
        """Rebuild the pointer tables from the cache's current layers (before a recapture)."""
        self.kv_table = storage_ptr_table(self.cache)
        self.len_table = kv_len_ptr_table_range(self.cache, range(self.cache.n_layers))

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

    def prefill(self, prompt, prompt_len, pos_ctr, pend, stream) -> None:
        """Enqueue the stub prefill of this model's cache (see ``stub_prefill``)."""
        self.backend.ops.stub_prefill(prompt, prompt_len, self.kv_table, self.len_table, self.capacity, self.vocab,
                                      pos_ctr, pend, stream=stream)


class StubTarget(_StubModel):
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
    """

    def __init__(self, batch: int, vocab: int, layers, capacity: int, *, cost_ns: int = 0,
                 backend: Backend | str = "auto"):
        super().__init__(batch, vocab, layers, capacity, cost_ns, backend, "target")

    def verify(self, bufs: StreamBufs, stream) -> None:
        self.backend.ops.stub_verify(bufs.vtok, bufs.pos_ctr, self.kv_table, self.len_table, self.capacity,
                                     self.vocab, self.cost_ns, bufs.tgt_pred, stream=stream)


class StubDraft(_StubModel):
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
        Agreement seed, per sequence via :meth:`set_slot`.
    """

    writes_verify_tokens = True  # each step also fills vtok[:, 1 + step]: no assemble launch

    def __init__(self, batch: int, vocab: int, layers, capacity: int, *, accept_prob: float = 0.7,
                 p_min: float = 0.0, seed: int = 0, cost_ns: int = 0, backend: Backend | str = "auto"):
        super().__init__(batch, vocab, layers, capacity, cost_ns, backend, "draft")
        self.p_min = check_prob("p_min", p_min)
        self.default_accept_prob = check_prob("accept_prob", accept_prob)
        self.default_seed = check_int("seed", seed, minimum=0, maximum=2**32 - 1)
        # Host mirrors of the per-sequence settings: changing slots is one upload of each.
        self._host_seed = np.full(self.batch, self.default_seed, np.uint32)
        self._host_agree = np.full(self.batch, fixed24(self.default_accept_prob), np.int32)
        self.seed = self.backend.zeros((self.batch,), np.uint32)  # [B] uint32
        self.agree24 = self.backend.zeros((self.batch,), np.int32)  # [B] int32, 24-bit fixed point
        self._upload_slots(None)

    def _upload_slots(self, stream) -> None:
        self.backend.upload(self.seed, self._host_seed, stream)
        self.backend.upload(self.agree24, self._host_agree, stream)

    def set_slots(self, settings: dict, stream=None) -> None:
        """Set sequences' agreement probability and seed between bursts (plain writes).

        Parameters
        ----------
        settings : dict
            ``slot -> (accept_prob or None, seed or None)``; None restores the default.
        """
        for slot, (accept_prob, seed) in settings.items():
            slot = check_int("slot", slot, minimum=0, maximum=self.batch - 1)
            prob = self.default_accept_prob if accept_prob is None else check_prob("accept_prob", accept_prob)
            self._host_agree[slot] = fixed24(prob)
            self._host_seed[slot] = self.default_seed if seed is None else check_int("seed", seed, minimum=0,
                                                                                     maximum=2**32 - 1)
        if settings:
            self._upload_slots(stream)

    def set_slot(self, slot: int, *, accept_prob: float | None = None, seed: int | None = None, stream=None) -> None:
        """Set one sequence's agreement probability or seed (None: the default)."""
        self.set_slots({slot: (accept_prob, seed)}, stream)

    def draft_step(self, bufs: StreamBufs, step: int, stream) -> None:
        self.backend.ops.stub_draft_step(step, bufs.vtok, bufs.pos_ctr, self.kv_table, self.len_table, self.capacity,
                                         self.vocab, self.seed, self.agree24, fixed24(self.p_min), self.cost_ns,
                                         bufs.draft_tok, bufs.draft_conf, bufs.brk, stream=stream)


def check_pair(target: TargetModel, draft: DraftModel) -> None:
    """Raise when a target/draft pair cannot share one burst."""
    if not isinstance(target, TargetModel):
        raise TypeError(f"target must implement verify(bufs, stream) and .cache, got {type(target).__name__}")
    if not isinstance(draft, DraftModel):
        raise TypeError(f"draft must implement draft_step(bufs, step, stream) and .cache, got {type(draft).__name__}")
    if target.cache.batch != draft.cache.batch:
        raise ValueError(f"target batch {target.cache.batch} != draft batch {draft.cache.batch}")
    if target.cache.backend.name != draft.cache.backend.name:
        raise ValueError(f"target backend {target.cache.backend.name} != draft backend {draft.cache.backend.name}")
    tv, dv = getattr(target, "vocab", None), getattr(draft, "vocab", None)
    if tv is not None and dv is not None and tv != dv:
        raise ValueError(f"target vocab {tv} != draft vocab {dv}")


def stub_pair(batch: int, vocab: int, target_layers: Sequence[bool] | int, draft_layers: Sequence[bool] | int,
              capacity: int, *, accept_prob: float = 0.7, p_min: float = 0.0, seed: int = 0, cost_ns: int = 0,
              backend: Backend | str = "auto") -> tuple[StubTarget, StubDraft]:
    """Build a matching stub target and draft on one backend."""
    target_layers = normalize_layout(target_layers, "target_layers")
    draft_layers = normalize_layout(draft_layers, "draft_layers")
    backend = get_backend(backend)
    target = StubTarget(batch, vocab, target_layers, capacity, cost_ns=cost_ns, backend=backend)
    draft = StubDraft(batch, vocab, draft_layers, capacity, accept_prob=accept_prob, p_min=p_min, seed=seed,
                      cost_ns=cost_ns, backend=backend)
    return target, draft

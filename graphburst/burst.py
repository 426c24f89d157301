"""Eager M-round speculative bursts over fixed buffers, on either backend.

A :class:`SpecDecoder` owns the burst buffers and the rollback pointer table of one
(target, draft) pair. It builds each round as a list of bound kernel calls
(:mod:`graphburst.program`); the eager modes run that list, and
:mod:`graphburst.capture` captures the same list.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from .buffers import BurstTokens, StreamBufs, kv_len_ptr_table
from .burst_mode import EAGER_MODES, MODES, BurstMode  # noqa: F401 (MODES re-exported: the old name)
from .guard import Watched
from .constants import NO_EOS, NO_PREFILL, UNBOUNDED_BUDGET
from .torch_capture import capture_api, stream_pair
from .protocol import DraftModel, TargetModel, check_pair, hook, split_options
from .program import (Call, CallCache, assemble_call, epilogue_call, round_calls,  # noqa: F401 (re-exported)
                      sampling_round_calls, seed_call, separate_tail_calls)
from .sampling.mode import SlotSampling, check_slot, sample_first_tokens
from .validate import check_int, check_prompt, per_slot



_BIG = np.iinfo(np.int64).max  # "any number of bursts fits"


class CapacityError(ValueError):
    """A request or burst would write past a KV cache's capacity.

    Attributes
    ----------
    slots : tuple of int
        The batch slots that would overflow (empty when not tied to slots).
    """

    def __init__(self, message: str, slots=()):
        super().__init__(message)
        self.slots = tuple(int(b) for b in slots)


class SpecDecoder(Watched):
    """Speculative-decoding bursts of a target/draft pair over fixed-address buffers.

    Parameters
    ----------
    target : TargetModel
    draft : DraftModel
    k : int
        Drafts per round, 1..MAX_K.
    m_rounds : int
        Rounds per burst, >= 1.
    stream : optional
        Stream to run on; a new non-blocking stream by default.
    fused : bool
        Run accept, commit, rollback and the next round's seed as one epilogue kernel
        (plus one head seed per burst) instead of the separate kernels. Both produce
        identical state.
    assemble : bool, optional
        Launch ``assemble_verify`` each round. By default only when the draft does not
        declare ``writes_verify_tokens``. Bookkeeping per round is then 1 launch (fused,
        no assemble) to 5 (separate, with assemble).
    sampling : bool
        Speculative rejection sampling with per-slot temperature, top-k, top-p and seed
        (:mod:`graphburst.sampling.mode`): both models must declare ``supports_sampling`` and
        write logits. The round is then always unfused with an assemble launch; slots
        at temperature 0 still decode exactly the greedy tokens.
    """

    _watched = frozenset({"bufs", "table", "target", "draft", "stream"})

    def __init__(self, target: TargetModel, draft: DraftModel, *, k: int, m_rounds: int, stream=None,
                 fused: bool = True, assemble: bool | None = None, sampling: bool = False):
        check_pair(target, draft, sampling=sampling)
        self.sampling = bool(sampling)
        # The fused epilogue is greedy only; a sampling round assembles vtok from the
        # sampled drafts (a draft's own vtok writes, if any, are its greedy proposals).
        self.fused = bool(fused) and not self.sampling
        own_vtok = hook(draft, "writes_verify_tokens")
        self.assemble = self.sampling or (not own_vtok if assemble is None else bool(assemble))
        self.target, self.draft = target, draft
        self.backend = target.cache.backend
        self.batch = target.cache.batch
        self.stream = self.backend.new_stream() if stream is None else stream
        # Torch models are captured by torch (capture.py): the decoder's stream must then
        # be one CUDA stream that both torch and CuPy name.
        self.torch_stream = None
        if self.backend.is_gpu and capture_api(target, draft) == "torch":
            self.stream, self.torch_stream = stream_pair(self.backend, stream)
        # The caller's models (KV caches, tables) were initialised on the device's
        # current stream, which this stream does not wait for: order that work first,
        # with an event rather than a host sync.
        self.backend.order_after_current(self.stream)
        self.capacity = min(target.cache.capacity, draft.cache.capacity)
        with self.stream:  # the decoder's own buffers are initialised in order with its stream
            self.bufs = StreamBufs(self.batch, k, m_rounds, self.backend,
                                   vocab=target.vocab if self.sampling else None)
            # Prefill staging, allocated once so admitting a request never allocates.
            self._prompt_flat = self.backend.zeros((self.batch * self.capacity,), np.int32)  # [B * capacity] int32
            self._prompt_len = self.backend.zeros((self.batch,), np.int32)  # [B] int32
        self.k, self.m_rounds = self.bufs.k, self.bufs.m_rounds
        for model in (target, draft):  # the buffers never move from here on: models may view them
            hook(model, "bind")(self.bufs)
        with self.stream:
            self.table = kv_len_ptr_table([target.cache, draft.cache], pos_ctr=self.bufs.pos_ctr)
        # Host mirror of what has been drained: positions and token budgets per slot.
        self.host_pos = np.zeros(self.batch, np.int64)
        self.host_left = np.zeros(self.batch, np.int64)  # tokens still allowed; 0 = idle or finished
        self.host_eos = np.full(self.batch, NO_EOS, np.int64)
        self.host_sampling = SlotSampling(self.batch) if self.sampling else None
        self._any_limit = False  # any slot with a token budget or an EOS: finish_burst must track it
        self.host_syncs = 0
        self.bursts = 0
        self.outstanding = 0  # bursts enqueued but not yet drained
        self._fits = 0  # further bursts that fit every live slot; nothing is live before prefill
        # enqueue_burst's bound calls, built once: rebinding the decoder's or its buffers'
        # watched attributes (refresh_tables rebinds ``table``) drops them.
        self._enqueued_program = CallCache()
        self.watch(self._enqueued_program)
        # Built: the buffers now belong to a live decoder (an adapter refuses to rebind them).
        self.bufs.decoder = weakref.ref(self)

    # ------------------------------------------------------------------ admission

    def prefill(self, prompts: Sequence[Sequence[int] | None], *, max_new_tokens=None, eos=None, temperature=None,
                top_k=None, top_p=None, seed=None) -> None:
        """Write prompts into the caches and reset those slots' bookkeeping.

        Parameters
        ----------
        prompts : sequence of length B
            Token list per slot, or None to leave a slot untouched.
        max_new_tokens : int or sequence, optional
            Per-slot token limit (unbounded by default).
        eos : int or sequence, optional
            Per-slot stop token (none by default).
        temperature, top_k, top_p, seed : scalar or sequence, optional
            Per-slot sampling settings (``sampling_params.check_sampling``); None means
            greedy (temperature 0, filters off, seed 0). Temperature > 0 needs a decoder
            built with ``sampling=True``; the first token is then sampled too.

        Raises
        ------
        ValueError, TypeError
            Before anything is written, for a bad prompt, limit or stop token.
        CapacityError
            When a request cannot fit in the KV cache.
        """
        rows, limits, stops, settings = self._check_prefill(prompts, max_new_tokens, eos, temperature, top_k, top_p,
                                                            seed)
        if not rows:
            return
        stage, lens = self._stage_prompts(rows)
        self._prefill_models(stage, lens, settings)
        self._admit(rows, limits, stops)

    def _check_prefill(self, prompts, max_new_tokens, eos, temperature, top_k, top_p, seed):
        """Parse: ``({slot: prompt [n] int32}, budgets [B], stop tokens [B], {slot: SamplingParams})``."""
        if self.outstanding:
            raise RuntimeError("drain every enqueued burst before prefilling: its tokens would be lost")
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            prompts = list(prompts)
        if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list with one entry (token list or None) per slot ({self.batch}), "
                            f"got {type(prompts).__name__}")
        if len(prompts) != self.batch:
            raise ValueError(f"prompts must have one entry per slot ({self.batch}), got {len(prompts)}")
        slots = [b for b, p in enumerate(prompts) if p is not None]
        limits = per_slot("max_new_tokens", max_new_tokens, self.batch)
        stops = per_slot("eos", eos, self.batch)
        rows = {}
        for b in slots:
            rows[b], limits[b], stops[b] = self.check_first_burst_fits(prompts[b], limits[b], stops[b], index=b)
        return rows, limits, stops, self._check_sampling_args(slots, temperature, top_k, top_p, seed)

    def _stage_prompts(self, rows: dict):
        """Build: the prompts padded to the longest (``[B, P_max] int32``, a view of the staging
        buffer) and their lengths (``[B] int32`` on the host, NO_PREFILL for slots left alone), uploaded."""
        p_max = max(len(r) for r in rows.values())
        host = np.zeros((self.batch, p_max), np.int32)  # [B, P_max] int32
        lens = np.full(self.batch, NO_PREFILL, np.int32)  # [B] int32
        for b, row in rows.items():
            host[b, : len(row)] = row
            lens[b] = len(row)
        stage = self._prompt_flat[: self.batch * p_max].reshape(self.batch, p_max)
        self.backend.upload(stage, host, self.stream)
        self.backend.upload(self._prompt_len, lens, self.stream)
        return stage, lens

    def _prefill_models(self, stage, lens, settings: dict) -> None:
        """Run: the models' prefill (the target sets ``pos_ctr`` and ``pend``), then a sampled first token."""
        s, bufs = self.stream, self.bufs
        if self.sampling:
            self.host_sampling.set(settings)
            self.host_sampling.upload(self.backend, bufs, s)
        self.target.prefill(stage, self._prompt_len, bufs.pos_ctr, bufs.pend, s)
        self.draft.prefill(stage, self._prompt_len, None, None, s)
        if self.sampling:
            sample_first_tokens(self.backend.ops, self.backend, bufs, lens, s)

    def _admit(self, rows: dict, limits, stops) -> None:
        """Record: each prefilled slot's budget, stop token and zeroed counters, on the device and in
        the host mirror (the prefill's one sync)."""
        s, bufs = self.stream, self.bufs
        budget, stop, acc = (self.backend.to_host(a, s) for a in (bufs.budget, bufs.eos, bufs.acc))
        for b, row in rows.items():
            budget[b] = limits[b]
            stop[b] = stops[b]
            acc[b] = 0
            self.host_pos[b] = len(row)
            self.host_left[b] = budget[b]
            self.host_eos[b] = stop[b]
        self._any_limit = bool(((self.host_left > 0) & (self.host_left != UNBOUNDED_BUDGET)).any()
                               or (self.host_eos != NO_EOS).any())
        for dst, src in ((bufs.budget, budget), (bufs.eos, stop), (bufs.acc, acc)):
            self.backend.upload(dst, src, s)
        s.synchronize()
        self._update_fits()

    def check_first_burst_fits(self, prompt, max_new_tokens=None, eos=None, *, index: int | None = None):
        """Validate one slot's prefill arguments without touching the device: the prompt plus
        one burst of its tokens must fit the cache (the serving loop's stricter rule, and
        why they differ: ``graphburst.serving.request.check_whole_request_fits``).

        Returns ``(prompt [n] int32, budget, stop token)`` with the sentinels filled in
        (``UNBOUNDED_BUDGET``, ``NO_EOS``). ``index`` names the slot in messages.

        Raises
        ------
        TypeError, ValueError
            For a bad prompt, limit or stop token.
        CapacityError
            When the prompt plus one burst's worth of its tokens cannot fit the cache.
        """
        at = "" if index is None else f"[{index}]"
        row = check_prompt(f"prompts{at}", prompt, self.target.vocab)
        limit = UNBOUNDED_BUDGET if max_new_tokens is None else check_int(
            f"max_new_tokens{at}", max_new_tokens, maximum=UNBOUNDED_BUDGET - 1)
        stop = NO_EOS if eos is None else check_int(f"eos{at}", eos, minimum=0, maximum=self.target.vocab - 1)
        need = len(row) + min(limit, self.bufs.ring_capacity)
        if need > self.capacity:
            raise CapacityError(
                f"prompts{at} of length {len(row)} plus {min(limit, self.bufs.ring_capacity)} new tokens "
                f"needs {need} KV entries, but the cache holds {self.capacity}")
        return row, limit, stop

    def _check_sampling_args(self, slots, temperature, top_k, top_p, seed) -> dict:
        """Per-slot sampling settings of a prefill: ``slot -> SamplingParams``, validated."""
        per = [per_slot(name, v, self.batch) for name, v in
               (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed))]
        return {b: check_slot(*(p[b] for p in per), sampling=self.sampling, index=b) for b in slots}

    def release(self, slots) -> None:
        """Make slots idle (budget 0) between bursts: they emit nothing until the next prefill."""
        if self.outstanding:
            raise RuntimeError("drain every enqueued burst before releasing slots")
        slots = [check_int("slot", b, minimum=0, maximum=self.batch - 1) for b in slots]
        if not slots:
            return
        budget = self.backend.to_host(self.bufs.budget, self.stream)
        budget[slots] = 0
        self.backend.upload(self.bufs.budget, budget, self.stream)
        self.host_left[slots] = 0

    def slot_options(self, options: dict | None) -> dict:
        """Validate one request's model options (at submission); see :func:`protocol.split_options`.

        Returns an opaque value for :meth:`set_slot_options`; raises ValueError/TypeError
        naming a key no model accepts or a model's own complaint.
        """
        return split_options({"target": self.target, "draft": self.draft}, options)

    def set_slot_options(self, settings: dict) -> None:
        """Apply validated options between bursts (at admission, before :meth:`prefill`).

        Parameters
        ----------
        settings : dict
            ``slot -> slot_options(...) result``, or None to restore the models' defaults
            (give every admitted slot an entry, so a reused slot forgets its last request).
        """
        if self.outstanding:
            raise RuntimeError("drain every enqueued burst before changing slot options")
        for slot in settings:
            check_int("slot", slot, minimum=0, maximum=self.batch - 1)
        for role in ("target", "draft"):
            per_slot = {b: None if v is None else v[role] for b, v in settings.items()}
            if per_slot:
                hook(getattr(self, role), "set_slot_options")(per_slot, self.stream)

    def abandon_enqueued(self) -> None:
        """Forget bursts enqueued but never drained, after a failure mid-enqueue.

        Their tokens are lost; the host mirror is re-read from the device (a host sync)
        so capacity checks stay exact. For error recovery only.
        """
        self.stream.synchronize()
        self.outstanding = 0
        self.host_pos[:] = self.backend.to_host(self.bufs.pos_ctr, self.stream)
        budget = self.backend.to_host(self.bufs.budget, self.stream).astype(np.int64)
        self.host_left[:] = budget
        self._update_fits()

    # ------------------------------------------------------------------ the round program

    def _seed_call(self, reset_ring: bool) -> Call:
        return seed_call(self.backend.ops, self.bufs, reset_ring)

    def round_calls(self, first_round: bool) -> list[Call]:
        """The bound kernel calls of one round, in stream order (see :func:`program.round_calls`)."""
        return round_calls(self.backend.ops, self.bufs, self.table, self.target, self.draft, k=self.k,
                           fused=self.fused, assemble=self.assemble, sampling=self.sampling, first_round=first_round)

    def burst_calls(self) -> list[Call]:
        """The bound calls of a whole M-round burst (fused bursts start with a head seed)."""
        head = [self._seed_call(reset_ring=True)] if self.fused else []
        return head + [c for r in range(self.m_rounds) for c in self.round_calls(first_round=r == 0)]

    # ------------------------------------------------------------------ running

    def refresh_tables(self) -> None:
        """Rebuild every pointer table from the caches' current layers (before a recapture)."""
        for model in (self.target, self.draft):
            hook(model, "refresh_tables")()
        self.backend.order_after_current(self.stream)  # new layers may have been initialised on another stream
        self._enqueued_program.invalidate("refresh_tables")
        with self.stream:
            self.table = kv_len_ptr_table([self.target.cache, self.draft.cache], pos_ctr=self.bufs.pos_ctr)

    def _bursts_that_fit(self) -> np.ndarray:
        """``[B]`` int64: how many more bursts each slot can take; ``BIG`` when any number can.

        Over n bursts a live slot writes at most ``min(host_left, n * ring_capacity)``
        tokens (its budget bounds it, and so does the ring), so n bursts fit iff
        ``host_pos + min(host_left, n * R) <= capacity``. A slot whose whole remaining
        budget fits never limits the count; idle and finished slots write nothing.
        """
        ring = self.bufs.ring_capacity
        left = self.host_left
        whole_budget_fits = self.host_pos + left <= self.capacity
        by_ring = np.maximum(self.capacity - self.host_pos, 0) // ring
        return np.where((left <= 0) | whole_budget_fits, _BIG, by_ring)

    def _update_fits(self) -> None:
        """Recompute exactly how many more bursts fit every live slot."""
        self._fits = int(self._bursts_that_fit().min(initial=_BIG))

    def check_fits(self) -> None:
        """Raise CapacityError unless one more burst, after those outstanding, fits every live slot.

        ``_fits`` is a lower bound kept in O(1) per burst: a drained burst of c tokens
        moves a slot to ``(pos + c, left - c)`` with ``c <= ring_capacity``, which fits
        n bursts whenever the old state fitted n + 1. The exact recount runs only when
        the bound is reached.
        """
        if self.outstanding + 1 <= self._fits:
            return
        self._update_fits()
        if self.outstanding + 1 <= self._fits:
            return
        n = self.outstanding + 1
        fits = self._bursts_that_fit()
        b = int(np.argmin(fits))
        over = np.flatnonzero(fits < n)
        raise CapacityError(
            f"slot {b} is at position {int(self.host_pos[b])} with {int(self.host_left[b])} tokens left; "
            f"{n} more burst(s) of up to {self.bufs.ring_capacity} tokens would pass the KV capacity {self.capacity}",
            slots=over)

    def begin_burst(self, max_outstanding: int = 1) -> None:
        """Host-side checks before enqueueing a burst (no device work, no sync)."""
        if self.outstanding >= max_outstanding:
            raise RuntimeError(f"{self.outstanding} burst(s) not drained; another would overwrite their tokens")
        self.check_fits()
        self.outstanding += 1

    def enqueue_burst(self, *, mode: BurstMode | str = BurstMode.PRE_ISSUED) -> None:
        """Enqueue one eager burst; ``PER_ROUND_SYNC`` reads ``n_commit`` after every round."""
        mode = BurstMode.parse(mode, EAGER_MODES)
        self.begin_burst()
        head, first, later = self._enqueued_calls()
        for call in head:
            call(self.stream)
        for r in range(self.m_rounds):
            for call in first if r == 0 else later:
                call(self.stream)
            if mode is BurstMode.PER_ROUND_SYNC:
                self.backend.to_host(self.bufs.n_commit, self.stream)
                self.host_syncs += 1

    def _enqueued_calls(self) -> tuple[list[Call], list[Call], list[Call]]:
        """(head seed, first round, later rounds) of an eager burst, built once and cached."""
        key = (self.fused, self.assemble, self.sampling, self.k, self.backend.ops)
        calls = self._enqueued_program.get(key)
        if calls is None:
            self.bufs.watch(self._enqueued_program)  # the calls bind these buffers (idempotent)
            head = [self._seed_call(reset_ring=True)] if self.fused else []
            calls = self._enqueued_program.put(
                key, (head, self.round_calls(first_round=True), self.round_calls(first_round=False)))
        return calls

    def drain(self) -> BurstTokens:
        """Read the last burst's committed tokens per slot: the burst's one host sync."""
        if self.outstanding == 0:
            raise RuntimeError("no burst to drain: enqueue_burst() first")
        tokens = self.bufs.drain_ring(self.stream)
        self.finish_burst(tokens)
        return tokens

    def finish_burst(self, tokens: BurstTokens) -> None:
        """Advance the host mirror by a drained burst's tokens (vectorised over the batch)."""
        self.host_syncs += 1
        self.bursts += 1
        self.outstanding -= 1
        self._fits -= 1
        self.host_pos += tokens.counts
        if self._any_limit:
            bounded = self.host_left != UNBOUNDED_BUDGET
            self.host_left[bounded] -= tokens.counts[bounded]
            stopped = (self.host_eos != NO_EOS) & (tokens.counts > 0) & (tokens.last() == self.host_eos)
            self.host_left[stopped] = 0

    def run_burst(self, *, mode: BurstMode | str = BurstMode.PRE_ISSUED) -> BurstTokens:
        """Enqueue one eager burst and drain it."""
        self.enqueue_burst(mode=mode)
        return self.drain()

    # ------------------------------------------------------------------ inspection

    def accept_counters(self) -> np.ndarray:
        """``[B, 2]`` host copy of ``[accepted drafts, rounds]`` (a host sync)."""
        return self.backend.to_host(self.bufs.acc, self.stream)

    def positions(self) -> np.ndarray:
        """``[B]`` host copy of the device position counter (a host sync)."""
        return self.backend.to_host(self.bufs.pos_ctr, self.stream)

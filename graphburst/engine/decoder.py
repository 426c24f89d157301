"""Eager M-round speculative bursts over fixed buffers, on either backend.

A :class:`SpecDecoder` owns the burst buffers and the rollback pointer table of one
(target, draft) pair. It builds each round as a list of bound kernel calls
(:mod:`graphburst.engine.program`); the eager modes run that list, and
:mod:`graphburst.capture` captures the same list.
"""

from __future__ import annotations

import collections
import weakref

import numpy as np

from .admission.slots import STAGE_HEAD, SlotAdmission
from .admission.checks import CapacityError
from ..buffers import StreamBufs, kv_len_ptr_table
from ..burst_tokens import BurstTokens
from .mode import EAGER_MODES, BurstMode
from ..guard import Watched
from .admission.options import OptionColumns
from .admission.graphs import AdmissionGraphs
from . import host_ops
from ..constants import NO_EOS, UNBOUNDED_BUDGET
from .torch_capture import capture_api, stream_pair
from ..protocol import DraftModel, TargetModel, check_pair, hook
from .program import Call, CallCache, round_calls, seed_call
from ..sampling.mode import SlotSampling



_BIG = np.iinfo(np.int64).max  # "any number of bursts fits"


class SpecDecoder(SlotAdmission, Watched):
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
    admission_graphs : bool
        Admit through one captured graph per prompt width when both models declare
        ``prefill_in_graph`` (greedy decoders; :mod:`graphburst.engine.admission.graphs`). False:
        always the eager calls.
    """

    _watched = frozenset({"bufs", "table", "target", "draft", "stream"})

    def __init__(self, target: TargetModel, draft: DraftModel, *, k: int, m_rounds: int, stream=None,
                 fused: bool = True, assemble: bool | None = None, sampling: bool = False,
                 admission_graphs: bool = True):
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
            # The models' per-slot int32 options, written by admission's one launch (admission/options.py)
            self.option_columns = OptionColumns.of({"target": target, "draft": draft}, self.batch, self.backend,
                                                   self.stream)
            self._option_appliers = self._models_applying_options()  # the models that apply their own options
            # Prefill staging, allocated once so admitting a request never allocates; one block,
            # so an admission is one host-to-device copy (admission.py, _stage_prompts).
            b = self.batch
            self._stage_head = STAGE_HEAD + (self.option_columns.count if self.option_columns else 0)  # H = 5 + C
            self._stage = self.backend.zeros((self._stage_head * b + b * self.capacity,), np.int32)  # [HB + B*cap]
            self._prompt_len = self._stage[:b]  # [B] int32: chunk lengths, NO_PREFILL for slots left alone
            self._prompt_start = self._stage[b: 2 * b]  # [B] int32: a chunk's first position
            # [2B, HB): the admission table, [3 + C, n] int32 (slot, budget, stop token, C option values)
            self._prompt_flat = self._stage[self._stage_head * b:]  # [B * capacity] int32: chunks, viewed [B, P_max]
            self._stage_views: dict = {}  # (part, size, rows) -> device view of _stage (admission._stage_view)
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
        self.host_syncs = 0
        self.bursts = 0
        self.outstanding = 0  # bursts enqueued but not yet drained
        # Slot generations (admission.py): a burst's tokens for a slot prefilled or released
        # after its launch belong to the slot's previous sequence and are dropped at drain.
        self.slot_gen = np.zeros(self.batch, np.int64)  # [B] int64
        self._gen_epoch = 0  # bumped with any slot's generation: a drain compares generations only when it moved
        # [epoch, [B] int64 slot_gen or None] at each launch of a burst in flight, oldest first: the generations
        # are copied only when they change with the burst in flight (_new_generation), not at every launch
        self._launch_gen: collections.deque = collections.deque()
        self._inflight = np.zeros(self.batch, np.int64)  # [B] bursts in flight that commit for this sequence
        self._launchable = 0  # more bursts that fit every live slot; nothing is live before prefill
        # finish_burst runs between bursts on the host, where a numpy call over B slots costs
        # about a microsecond, mostly fixed overhead: its masks go into these scratch arrays,
        # and it compares against arrays, which costs a third of converting a Python scalar.
        self._current = np.zeros(self.batch, bool)  # [B] bool scratch: slots whose sequence a burst committed for
        self._mask = np.zeros(self.batch, bool)  # [B] bool scratch
        self._mask2 = np.zeros(self.batch, bool)  # [B] bool scratch
        self._unbounded = np.full(self.batch, UNBOUNDED_BUDGET, np.int64)  # [B] int64 constant
        self._no_eos = np.full(self.batch, NO_EOS, np.int64)  # [B] int64 constant
        self._one = np.ones(self.batch, np.int64)  # [B] int64 constant (begin_burst)
        # finish_burst in C (host_ops.c, one call instead of ~10 numpy ones) for a graph's drain; None: numpy
        lib = host_ops.library()
        self.host_mirror = None if lib is None else host_ops.Mirror(
            lib, row=self.bufs.ring_capacity + 1, slot_gen=self.slot_gen, inflight=self._inflight,
            host_pos=self.host_pos, host_left=self.host_left)
        # enqueue_burst's bound calls, built once: rebinding the decoder's or its buffers'
        # watched attributes (refresh_tables rebinds ``table``) drops them.
        self._enqueued_program = CallCache()
        self.watch(self._enqueued_program)
        # Admission as one graph launch when both models prefill from device sizes (admission/graphs.py)
        self.admission_graphs = AdmissionGraphs(self) if admission_graphs and AdmissionGraphs.usable(self) else None
        # Built: the buffers now belong to a live decoder (an adapter refuses to rebind them).
        self.bufs.decoder = weakref.ref(self)

    def abandon_enqueued(self) -> None:
        """Forget bursts enqueued but never drained, after a failure mid-enqueue.

        Their tokens are lost; the host mirror is re-read from the device (a host sync)
        so capacity checks stay exact. For error recovery only.
        """
        self.stream.synchronize()
        self.outstanding = 0
        self._launch_gen.clear()
        self._inflight[:] = 0
        self.host_pos[:] = self.backend.to_host(self.bufs.pos_ctr, self.stream)
        budget = self.backend.to_host(self.bufs.budget, self.stream).astype(np.int64)
        self.host_left[:] = budget
        self._update_fits()

    def _new_generation(self, slots: np.ndarray) -> None:
        """Slots prefilled or released: bursts in flight no longer commit for their sequence."""
        if self._launch_gen and self._launch_gen[-1][1] is None:
            launched = self.slot_gen.copy()  # the generations every burst launched since the last change saw
            for entry in reversed(self._launch_gen):
                if entry[1] is not None:
                    break
                entry[1] = launched
        self.slot_gen[slots] += 1
        self._gen_epoch += 1
        self._inflight[slots] = 0

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
        if self.option_columns is not None:  # a model may hand out new option arrays with its tables
            self.option_columns.invalidate("refresh_tables")
        with self.stream:
            self.table = kv_len_ptr_table([self.target.cache, self.draft.cache], pos_ctr=self.bufs.pos_ctr)

    def _bursts_that_fit(self) -> np.ndarray:
        """``[B]`` int64: how many more bursts each slot can take beyond those in flight for
        it; ``BIG`` when any number can.

        Over n bursts a live slot writes at most ``min(host_left, n * ring_capacity)``
        tokens (its budget bounds it, and so does the ring), so n bursts fit iff
        ``host_pos + min(host_left, n * R) <= capacity``. A slot whose whole remaining
        budget fits never limits the count; idle and finished slots write nothing. Only the
        bursts launched since the slot's sequence was admitted count against it.
        """
        ring = self.bufs.ring_capacity
        left = self.host_left
        whole_budget_fits = self.host_pos + left <= self.capacity
        by_ring = np.maximum(self.capacity - self.host_pos, 0) // ring - self._inflight
        return np.where((left <= 0) | whole_budget_fits, _BIG, by_ring)

    def _update_fits(self) -> None:
        """Recompute exactly how many more bursts fit every live slot."""
        self._launchable = int(self._bursts_that_fit().min(initial=_BIG))

    def check_fits(self) -> None:
        """Raise CapacityError unless one more burst, after those in flight, fits every live slot.

        ``_launchable`` is a lower bound kept in O(1) per burst: a launch uses one for
        every slot; a drained burst of c tokens moves a slot to ``(pos + c, left - c)``
        with ``c <= ring_capacity`` and one burst fewer in flight for it, which never lowers
        its count. The exact recount runs only when the bound is reached.
        """
        if self._launchable >= 1:
            return
        self._update_fits()
        if self._launchable >= 1:
            return
        fits = self._bursts_that_fit()
        b = int(np.argmin(fits))
        over = np.flatnonzero(fits < 1)
        n = int(self._inflight[b]) + 1
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
        if self._launchable != _BIG:
            self._launchable -= 1
        np.add(self._inflight, self._one, out=self._inflight)  # an array operand: cheaper than ``+= 1``
        self._launch_gen.append([self._gen_epoch, None])  # generations copied if they change in flight

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

    def finish_burst(self, tokens: BurstTokens, mirror=None) -> None:
        """Advance the host mirror by a drained burst's tokens (vectorised over the batch).

        Tokens for a slot prefilled or released since the burst's launch are dropped from
        ``tokens`` first (their counts become 0): they belonged to the slot's previous sequence.

        Parameters
        ----------
        tokens : BurstTokens
        mirror : ([B] int32, [B] int32), optional
            The device's ``pos_ctr`` and ``budget`` as of the burst's end (a graph copies
            them with the ring). The host mirror of every slot the burst committed for
            becomes these values: what the device computed, in two copies. Without them the
            mirror is advanced from the tokens (:meth:`_advance_mirror`), as the device does.
        """
        launch_gen = self._drained()
        if launch_gen is None:  # no slot prefilled or released since the launch: no compare
            every, current = True, None
            np.subtract(self._inflight, self._one, out=self._inflight)  # one burst fewer in flight for each
        else:
            current = np.equal(launch_gen, self.slot_gen, out=self._current)  # [B] bool
            every = np.count_nonzero(current) == self.batch  # count_nonzero: a fifth of the cost of .all()
            if not every:
                tokens.drop(np.logical_not(current, out=self._mask2))
            self._inflight -= current  # one burst fewer in flight for the sequences it committed for
        if mirror is None:
            self._advance_mirror(tokens)
            return
        pos, budget = mirror
        if every:
            np.copyto(self.host_pos, pos)
            np.copyto(self.host_left, budget)
        else:  # a refilled or released slot keeps the values its admission or release set
            np.copyto(self.host_pos, pos, where=current)
            np.copyto(self.host_left, budget, where=current)

    def finish_block(self, pinned_addr: int) -> BurstTokens:
        """:meth:`finish_burst` of a graph's drained output block in C (``host_mirror``, not None):
        the block at ``pinned_addr`` ([B*R1 ring | 2B acc | B pos | B budget] int32, host) is read
        into a fresh ``[B*R1 ring | B counts | 2B acc]`` block, viewed by the returned tokens
        (``tokens.acc``: the accept counters), and into the host mirror."""
        mirror = self.host_mirror
        block, addr = mirror.new_block()
        mirror.drain(pinned_addr, addr, self._drained())
        return BurstTokens.of_block(block, addr, self.batch)

    def _drained(self) -> np.ndarray | None:
        """Count the oldest burst in flight as drained; the slot generations at its launch
        (``[B]`` int64), or None when none has moved since."""
        self.host_syncs += 1
        self.bursts += 1
        self.outstanding -= 1
        epoch, launch_gen = self._launch_gen.popleft()
        return None if epoch == self._gen_epoch else launch_gen

    def _advance_mirror(self, tokens: BurstTokens) -> None:
        """``host_pos`` and ``host_left`` after ``tokens`` (dropped rows count 0), computed on
        the host the way the commit kernel does on the device: positions advance by the
        count, a bounded budget falls by it, and a slot whose last token is its stop token
        stops (budget 0)."""
        counts = tokens.counts
        self.host_pos += counts
        left, eos = self.host_left, self.host_eos
        bounded = np.not_equal(left, self._unbounded, out=self._mask)
        np.subtract(left, counts, out=left, where=bounded)
        # A slot stops when its last committed token is its stop token. tail() is that
        # token where the count is > 0 (counts are >= 0, so logical_and tests count > 0).
        stopped = np.equal(tokens.tail(), eos, out=self._mask)
        np.logical_and(stopped, counts, out=stopped)
        stopped &= np.not_equal(eos, self._no_eos, out=self._mask2)
        if np.count_nonzero(stopped):
            left[stopped] = 0

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

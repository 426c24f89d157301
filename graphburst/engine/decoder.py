"""Eager M-round speculative bursts over fixed buffers, on either backend.

A :class:`SpecDecoder` owns the burst buffers and the rollback pointer table of one
(target, draft) pair. It builds each round as a list of bound kernel calls
(:mod:`graphburst.engine.program`); the eager modes run that list, and
:mod:`graphburst.capture` captures the same list.

It owns, by composition: its :class:`~graphburst.engine.admission.slots.Admission`
(``admission``: prefill, release, per-slot options, the admission graphs), which it
builds with everything admission writes; the :class:`~graphburst.engine.ledger.SlotLedger`
(``ledger``: the host mirror, slot generations, bursts in flight) that both advance; and a
:class:`~graphburst.guard.Watcher` its rollback table's setter tells when ``table`` is
rebound. The models, buffers and stream are fixed at construction: the models are bound to
the buffers, and admission and every captured graph hold them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from .admission.slots import Admission, StagingBlock
from .admission.checks import CapacityError
from ..buffers import PtrTable, StreamBufs, kv_len_ptr_table
from ..burst_tokens import BurstTokens
from .mode import EAGER_MODES, BurstMode
from ..guard import Watcher
from .admission.options import OptionColumns
from .draft_caps import DraftCaps
from .admission.graphs import AdmissionGraphs
from . import host_ops
from ..constants import NO_EOS, UNBOUNDED_BUDGET
from .ledger import ANY_NUMBER, SlotLedger
from .torch_capture import capture_api, stream_pair
from ..protocol import DraftModel, TargetModel, check_pair, check_target, hook
from ..sampling.fields import SlotFields
from .no_draft import NoDraft
from .program import Call, CallCache, round_calls, seed_call
from .round_exit import RoundExit, rounds_and_reason


class SpecDecoder:
    """Speculative-decoding bursts of a target/draft pair over fixed-address buffers.

    Parameters
    ----------
    target : TargetModel
    draft : DraftModel or None
        None decodes plainly: no draft model, one token a round (needs ``k=0``;
        :class:`~graphburst.engine.no_draft.NoDraft` takes the draft's place).
    k : int
        Drafts per round, 1..MAX_K with a draft, 0 without.
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
    fields : bool
        Per-request logits processing on the device (``logit_bias``, presence / frequency /
        repetition penalties, ``min_p``, ``min_tokens``, ``ignore_eos``; :mod:`graphburst.sampling.fields`):
        needs ``sampling=True``. Allocates ``[B, V]`` counts and prompt marks (``self.fields``); off
        by default, so a decoder without it runs no extra kernel.
    draft_caps : bool
        Let a request ask for fewer drafts a round: the per-request option ``"k"``, 0 to ``k``
        (0: plain decoding) (:mod:`graphburst.engine.draft_caps`). One small launch a round
        after the draft chain; off by default.
    spec_max_batch : int, optional
        Switch speculation off (every slot's cap 0) for the rounds in which more than this many
        slots are active, inside the same graph; implies ``draft_caps``.
    """

    def __init__(self, target: TargetModel, draft: DraftModel | None, *, k: int, m_rounds: int, stream=None,
                 fused: bool = True, assemble: bool | None = None, sampling: bool = False,
                 admission_graphs: bool = True, fields: bool = False, draft_caps: bool = False,
                 spec_max_batch: int | None = None):
        draft = plain_draft(target, draft, k)
        if not isinstance(fields, (bool, np.bool_)):
            raise TypeError(f"fields must be a bool, got {type(fields).__name__} {fields!r}")
        if fields and not sampling:
            raise ValueError("fields=True processes logits, which only a sampling decoder has: build it with "
                             "sampling=True (temperature 0 still decodes greedily)")
        check_pair(target, draft, sampling=sampling)
        # Told when ``table`` is rebound: the eager program's calls and every captured burst graph bake it.
        self._watcher = Watcher(type(self).__name__)
        self.sampling = bool(sampling)
        # The fused epilogue is greedy only; a sampling round assembles vtok from the
        # sampled drafts (a draft's own vtok writes, if any, are its greedy proposals).
        self.fused = bool(fused) and not self.sampling
        own_vtok = hook(draft, "writes_verify_tokens")
        self.assemble = self.sampling or (not own_vtok if assemble is None else bool(assemble))
        self._target, self._draft = target, draft
        self.backend = target.cache.backend
        self.batch = target.cache.batch
        self._stream = self.backend.new_stream() if stream is None else stream
        # Torch models are captured by torch (capture.py): the decoder's stream must then
        # be one CUDA stream that both torch and CuPy name.
        self.torch_stream = None
        if self.backend.is_gpu and capture_api(target, draft) == "torch":
            self._stream, self.torch_stream = stream_pair(self.backend, stream)
        # The caller's models (KV caches, tables) were initialised on the device's
        # current stream, which this stream does not wait for: order that work first,
        # with an event rather than a host sync.
        self.backend.order_after_current(self.stream)
        self.capacity = min(target.cache.capacity, draft.cache.capacity)
        with self._stream:  # the decoder's own buffers are initialised in order with its stream
            bufs = self._bufs = StreamBufs(self.batch, k, m_rounds, self.backend,
                                           vocab=target.vocab if self.sampling else None)
            # Per-request k and the batch-size switch (draft_caps.py): a cap column and a launch a round
            self.caps = DraftCaps(self.batch, bufs.k, self.backend, spec_max_batch=spec_max_batch) \
                if draft_caps or spec_max_batch is not None else None
            # The models' per-slot int32 options and the caps, written by admission's one launch
            # (admission/options.py)
            option_columns = OptionColumns.of({"target": target, "draft": draft, "speculation": self.caps},
                                              self.batch, self.backend, self._stream)
            # The logits processing fields' buffers (sampling/fields.py), or None
            self.fields = SlotFields(self.batch, target.vocab, self.backend) if fields else None
            # Prefill staging, allocated once so admitting a request never allocates (admission/slots.py)
            staging = StagingBlock(self.batch, self.capacity, option_columns.count if option_columns else 0,
                                   self.backend)
        self.k, self.m_rounds = bufs.k, bufs.m_rounds
        with self._stream:  # what a model allocates or fills in bind is then in order with the bursts
            for model in (target, draft):  # the buffers never move from here on: models may view them
                hook(model, "bind")(bufs)
        self._table = kv_len_ptr_table([target.cache, draft.cache], pos_ctr=bufs.pos_ctr, stream=self._stream)
        # Host mirror of what has been drained, slot generations, bursts in flight (ledger.py):
        # advanced here at each launch and drain, written by admission at each prefill and release.
        ledger = self.ledger = SlotLedger(self.batch, self.capacity, bufs.ring_capacity)
        self.host_syncs = 0
        self.bursts = 0
        self.outstanding = 0  # bursts enqueued but not yet drained
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
            lib, row=bufs.ring_capacity + 1, slot_gen=ledger.gen, inflight=ledger.inflight,
            host_pos=ledger.pos, host_left=ledger.left)
        # enqueue_burst's bound calls, built once: rebinding the decoder's ``table`` (refresh_tables
        # does) or its buffers' watched attributes drops them.
        self._enqueued_program = CallCache()
        self._watcher.watch(self._enqueued_program)
        # Device-exit bursts (round_exit.py): their loop state and stop flag, made on first use,
        # and the eager program's calls, built once as the fixed-M ones are
        self._round_exit = None
        self._exit_program = CallCache()
        self._watcher.watch(self._exit_program)
        self._eager_exit = False  # the burst in flight is an eager device-exit burst
        self.last_rounds = None  # rounds the last drained eager burst ran
        self.last_exit_reason = None  # why it ended ("m_max", "idle", "flag"); None for a fixed-M burst
        # Admission as one graph launch when both models prefill from device sizes (admission/graphs.py)
        graphs = AdmissionGraphs(target=target, draft=draft, bufs=bufs, staging=staging,
                                 option_columns=option_columns, backend=self.backend, stream=self._stream) \
            if admission_graphs and AdmissionGraphs.usable(target, draft, sampling=self.sampling) else None
        # Admission holds what it writes, not the decoder: no cycle through it (a dead decoder is
        # freed by reference counting, its graphs and streams with it).
        self.admission = Admission(target=target, draft=draft, bufs=bufs, stream=self._stream, backend=self.backend,
                                   staging=staging, option_columns=option_columns, graphs=graphs, ledger=ledger,
                                   sampling=self.sampling, fields=self.fields, caps=self.caps)
        # Built: the buffers now belong to a live decoder (an adapter refuses to rebind them).
        bufs.decoder = weakref.ref(self)

    # ------------------------------------------------------------------ what is baked in

    @property
    def target(self) -> TargetModel:
        """The target model (fixed: it is bound to the buffers, and admission and graphs hold it)."""
        return self._target

    @property
    def draft(self) -> DraftModel:
        """The draft model (fixed, as :attr:`target`); a :class:`NoDraft` when decoding plainly."""
        return self._draft

    @property
    def plain(self) -> bool:
        """Plain decoding: no draft model, k = 0, one token a round."""
        return isinstance(self._draft, NoDraft)

    @property
    def bufs(self) -> StreamBufs:
        """The burst buffers (fixed: the models view them; a buffer inside may be rebound, and its
        rebinding drops what baked it)."""
        return self._bufs

    @property
    def stream(self):
        """The stream every burst and admission is enqueued on (fixed)."""
        return self._stream

    @property
    def table(self) -> PtrTable:
        """The rollback pointer table: every KV layer's length, then ``pos_ctr``."""
        return self._table

    @table.setter
    def table(self, table: PtrTable) -> None:
        # Rebound by refresh_tables (a parallel decoder's stage table too): the eager program and
        # every burst graph that baked the old one must not run it again.
        self._watcher.rebound("table")
        self._table = table

    def watch(self, guard) -> None:
        """Register ``guard`` (``invalidate(what)``) to be told when :attr:`table` is rebound."""
        self._watcher.watch(guard)

    @property
    def round_exit(self) -> RoundExit:
        """The loop state and stop flag of this decoder's device-exit bursts (eager or graphed: one
        flag per decoder), allocated on first use, never inside a capture."""
        if self._round_exit is None:
            self._round_exit = RoundExit(self._bufs, self.backend, self._stream)
        return self._round_exit

    def request_stop(self) -> None:
        """Ask the device-exit burst in flight to end at its next round boundary; with none in
        flight, the next one runs zero rounds (:mod:`graphburst.engine.round_exit`). No device work,
        no sync: one store to mapped host memory."""
        self.round_exit.request_stop()

    def answer_stop(self, upto: int | None = None) -> None:
        """Held stops (graphs captured with ``hold_stops``): answer the stop requests made so far (or
        those up to the count ``upto``, read earlier with :attr:`stop_requests`), in stream order
        behind the work enqueued so far (an admission, say): bursts launched after it run whole,
        those before it zero rounds. One small fill on the decoder's stream, no sync."""
        self.round_exit.answer(self._stream, upto)

    @property
    def stop_requests(self) -> int:
        """The count of stop requests made so far (any thread's); :meth:`answer_stop` takes it."""
        return self.round_exit.flag.count

    @property
    def stop_pending(self) -> bool:
        """A stop request no :meth:`answer_stop` covers yet (held stops)."""
        return self._round_exit is not None and self._round_exit.pending

    # ------------------------------------------------------------------ the host mirror

    @property
    def host_pos(self) -> np.ndarray:
        """``[B]`` int64: each slot's position as of the last drained burst (the ledger's, in place)."""
        return self.ledger.pos

    @property
    def host_left(self) -> np.ndarray:
        """``[B]`` int64: tokens each slot may still emit; 0 = idle or finished."""
        return self.ledger.left

    @property
    def host_eos(self) -> np.ndarray:
        """``[B]`` int64: each slot's stop token (``NO_EOS`` for none)."""
        return self.ledger.eos

    @property
    def slot_gen(self) -> np.ndarray:
        """``[B]`` int64: slot generations (:mod:`graphburst.engine.ledger`)."""
        return self.ledger.gen

    # ------------------------------------------------------------------ admission (``self.admission``'s)

    def prefill(self, prompts: Sequence[Sequence[int] | None], *, start=None, final: bool = True,
                max_new_tokens=None, eos=None, temperature=None, top_k=None, top_p=None, seed=None,
                fields=None) -> None:
        """Write prompts (or chunks of them) into the caches, validated first: see
        :meth:`Admission.prefill <graphburst.engine.admission.slots.Admission.prefill>`."""
        self.admission.prefill(prompts, start=start, final=final, max_new_tokens=max_new_tokens, eos=eos,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, fields=fields)

    def prefill_slots(self, slots: list, rows: list, starts: list, *, final: bool = True, limits: list | None = None,
                      stops: list | None = None, sampling: list | None = None, options: list | None = None) -> None:
        """:meth:`prefill` of values validated already, per slot as lists (the serving loop's admission):
        see :meth:`Admission.prefill_slots <graphburst.engine.admission.slots.Admission.prefill_slots>`."""
        self.admission.prefill_slots(slots, rows, starts, final=final, limits=limits, stops=stops, sampling=sampling,
                                     options=options)

    def prefill_checked(self, rows: dict, starts: dict, *, final: bool = True, limits: dict | None = None,
                        stops: dict | None = None, sampling: dict | None = None, options: dict | None = None) -> None:
        """:meth:`prefill_slots` of values given per slot as dicts, with no checks repeated (anything
        not validated as :meth:`prefill` validates is undefined behaviour).

        Parameters
        ----------
        rows : dict
            ``slot -> [n] int32`` tokens of this chunk (n >= 1, each in ``[0, vocab)``).
        starts : dict
            ``slot -> position`` of the chunk's first token (0 for a whole prompt).
        final : bool
            As for :meth:`prefill`.
        limits, stops : dict, final chunks only
            ``slot -> budget`` (``UNBOUNDED_BUDGET`` for none) and ``slot -> stop token``
            (``NO_EOS`` for none); default: none.
        sampling : dict, optional
            ``slot -> SamplingParams`` (sampling decoders, final chunks); default: greedy.
        options : dict, optional
            ``slot -> slot_options(...) result`` or None (the defaults). For exactly the
            prefilled slots they are written with the admission (option columns in its one
            launch; not at all if it fails); a dict naming other slots too is applied first,
            by :meth:`set_slot_options`.
        """
        slots = sorted(rows)
        limits, stops, sampling = limits or {}, stops or {}, sampling or {}
        admission = self.admission
        if options and options.keys() != rows.keys():  # options of other slots too: applied apart, first
            admission.set_slot_options(options)
            options = None
        admission.prefill_slots(slots, [rows[b] for b in slots], [starts.get(b, 0) for b in slots], final=final,
                                limits=[limits.get(b, UNBOUNDED_BUDGET) for b in slots] if final else None,
                                stops=[stops.get(b, NO_EOS) for b in slots] if final else None,
                                sampling=[sampling.get(b) for b in slots] if final and self.sampling else None,
                                options=[options[b] for b in slots] if options else None)

    def check_first_burst_fits(self, prompt, max_new_tokens=None, eos=None, *, index: int | None = None,
                               start: int = 0):
        """Validate one slot's prefill arguments without touching the device: see
        :func:`graphburst.engine.admission.checks.check_first_burst_fits`."""
        return self.admission.check_first_burst_fits(prompt, max_new_tokens, eos, index=index, start=start)

    def release(self, slots) -> None:
        """Make slots idle (budget 0), bursts in flight or not: see :meth:`Admission.release
        <graphburst.engine.admission.slots.Admission.release>`."""
        self.admission.release(slots)

    def slot_options(self, options: dict | None) -> dict:
        """Validate one request's model options (at submission); see :func:`protocol.split_options`.

        Returns an opaque value for :meth:`set_slot_options`; raises ValueError/TypeError
        naming a key no model accepts or a model's own complaint.
        """
        return self.admission.slot_options(options)

    def set_slot_options(self, settings: dict) -> None:
        """Apply validated options (``slot -> slot_options(...) result`` or None for the models'
        defaults), stream-ordered: see :meth:`Admission.set_slot_options
        <graphburst.engine.admission.slots.Admission.set_slot_options>`."""
        self.admission.set_slot_options(settings)

    def warm_admission_graphs(self, *, longest: int | None = None, chunk: int | None = None) -> int:
        """Capture now the admission graphs a serving loop's admissions take; returns how many were
        captured: see :meth:`Admission.warm_graphs <graphburst.engine.admission.slots.Admission.warm_graphs>`."""
        return self.admission.warm_graphs(longest=longest, chunk=chunk)

    @property
    def admission_graphs(self) -> AdmissionGraphs | None:
        """The admission graphs, or None when admission is eager (from construction, or since a
        capture failed)."""
        return self.admission.graphs

    @property
    def option_columns(self) -> OptionColumns | None:
        """The models' per-slot int32 option columns (None when neither model declares any)."""
        return self.admission.option_columns

    def abandon_enqueued(self) -> None:
        """Forget bursts enqueued but never drained, after a failure mid-enqueue.

        Their tokens are lost; the host mirror is re-read from the device (a host sync)
        so capacity checks stay exact. For error recovery only.
        """
        stream, ledger = self._stream, self.ledger
        stream.synchronize()
        self.outstanding = 0
        ledger.launch_gen.clear()
        ledger.inflight[:] = 0
        ledger.pos[:] = self.backend.to_host(self._bufs.pos_ctr, stream)
        budget = self.backend.to_host(self._bufs.budget, stream).astype(np.int64)
        ledger.left[:] = budget
        ledger.update_fits()

    # ------------------------------------------------------------------ the round program

    def _seed_call(self, reset_ring: bool) -> Call:
        return seed_call(self.backend.ops, self.bufs, reset_ring)

    def round_calls(self, first_round: bool) -> list[Call]:
        """The bound kernel calls of one round, in stream order (see :func:`program.round_calls`)."""
        return round_calls(self.backend.ops, self.bufs, self.table, self.target, self.draft, k=self.k,
                           fused=self.fused, assemble=self.assemble, sampling=self.sampling, first_round=first_round,
                           fields=self.fields, caps=self.caps if self.k else None)

    def burst_calls(self, rounds: int | None = None) -> list[Call]:
        """The bound calls of a whole burst of ``rounds`` rounds (default M; fused bursts start with a
        head seed). A shorter burst commits into the same ring, so it leaves an r-round burst's state."""
        rounds = self.m_rounds if rounds is None else rounds
        assert 1 <= rounds <= self.m_rounds, rounds  # the ring holds M rounds
        head = [self._seed_call(reset_ring=True)] if self.fused else []
        return head + [c for r in range(rounds) for c in self.round_calls(first_round=r == 0)]

    # ------------------------------------------------------------------ running

    def refresh_tables(self) -> None:
        """Rebuild every pointer table from the caches' current layers (before a recapture)."""
        for model in (self.target, self.draft):
            hook(model, "refresh_tables")()
        self.backend.order_after_current(self._stream)  # new layers may have been initialised on another stream
        self._enqueued_program.invalidate("refresh_tables")
        # a model may hand out new option arrays with its tables: the columns are read again, and
        # the admission graphs (which bake the models' tables) dropped
        self.admission.refresh("refresh_tables")
        self.table = kv_len_ptr_table([self.target.cache, self.draft.cache], pos_ctr=self._bufs.pos_ctr,
                                      stream=self._stream)

    def check_fits(self) -> None:
        """Raise CapacityError unless one more burst, after those in flight, fits every live slot.

        ``ledger.launchable`` is a lower bound kept in O(1) per burst: a launch uses one for
        every slot; a drained burst of c tokens moves a slot to ``(pos + c, left - c)``
        with ``c <= ring_capacity`` and one burst fewer in flight for it, which never lowers
        its count. The exact recount runs only when the bound is reached.
        """
        ledger = self.ledger
        if ledger.launchable >= 1:
            return
        ledger.update_fits()
        if ledger.launchable >= 1:
            return
        fits = ledger.bursts_that_fit()
        b = int(np.argmin(fits))
        over = np.flatnonzero(fits < 1)
        n = int(ledger.inflight[b]) + 1
        raise CapacityError(
            f"slot {b} is at position {int(ledger.pos[b])} with {int(ledger.left[b])} tokens left; "
            f"{n} more burst(s) of up to {self._bufs.ring_capacity} tokens would pass the KV capacity {self.capacity}",
            slots=over)

    def begin_burst(self, max_outstanding: int = 1) -> None:
        """Host-side checks before enqueueing a burst (no device work, no sync)."""
        if self.outstanding >= max_outstanding:
            raise RuntimeError(f"{self.outstanding} burst(s) not drained; another would overwrite their tokens")
        self.check_fits()
        self.outstanding += 1
        ledger = self.ledger
        if ledger.launchable != ANY_NUMBER:
            ledger.launchable -= 1
        np.add(ledger.inflight, self._one, out=ledger.inflight)  # an array operand: cheaper than ``+= 1``
        ledger.launch_gen.append([ledger.epoch, None])  # generations copied if they change in flight

    def enqueue_burst(self, *, mode: BurstMode | str = BurstMode.PRE_ISSUED, device_exit: bool = False) -> None:
        """Enqueue one eager burst; ``PER_ROUND_SYNC`` reads ``n_commit`` after every round.

        ``device_exit``: run rounds only while the device-exit condition holds (below ``m_rounds``
        rounds, a slot with budget left, no stop request), as a device-exit burst graph does; the
        host reads the condition after every boundary (a host sync per round on cupy).
        """
        mode = BurstMode.parse(mode, EAGER_MODES)
        if not isinstance(device_exit, (bool, np.bool_)):
            raise TypeError(f"device_exit must be a bool, got {type(device_exit).__name__} {device_exit!r}")
        self.begin_burst()
        self._eager_exit = bool(device_exit)
        if device_exit:
            self._enqueue_until_exit(mode)
            return
        head, first, later = self._enqueued_calls()
        stream = self._stream
        for call in head:
            call(stream)
        for r in range(self.m_rounds):
            for call in first if r == 0 else later:
                call(stream)
            if mode is BurstMode.PER_ROUND_SYNC:
                self.backend.to_host(self._bufs.n_commit, stream)
                self.host_syncs += 1

    def _enqueue_until_exit(self, mode: BurstMode) -> None:
        head, body = self.device_exit_calls()
        stream, rx = self._stream, self.round_exit
        for call in head:
            call(stream)
        while True:
            go = rx.go(stream)  # the condition the head or the last round's end computed
            self.host_syncs += 1
            if not go:
                return
            for call in body:
                call(stream)
            if mode is BurstMode.PER_ROUND_SYNC:
                self.backend.to_host(self._bufs.n_commit, stream)
                self.host_syncs += 1

    def device_exit_calls(self, handle: int = 0, *, hold: bool = False) -> tuple[list[Call], list[Call]]:
        """(head, body) of a device-exit burst: the head seed (which empties the ring) and the first
        condition; then one round (never the first: the head emptied the ring) and the condition
        after it. ``handle``: the WHILE node's conditional handle (a graph's capture); the eager
        program (0) is built once and cached. ``hold``: stop requests stay pending past the burst's
        end until :meth:`answer_stop` (:mod:`graphburst.engine.round_exit`, held stops)."""
        key = (self.fused, self.assemble, self.sampling, self.k, self.backend.ops, bool(hold))
        if handle == 0:
            calls = self._exit_program.get(key)
            if calls is not None:
                return calls
            self.bufs.watch(self._exit_program)
        rx = self.round_exit
        head = [self._seed_call(reset_ring=True), rx.call(begin=True, handle=handle, hold=hold)]
        body = self.round_calls(first_round=False) + [rx.call(begin=False, handle=handle, hold=hold)]
        return self._exit_program.put(key, (head, body)) if handle == 0 else (head, body)

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
        if self._eager_exit:
            self.last_rounds, self.last_exit_reason = rounds_and_reason(self.round_exit.read(self.stream))
            tokens.rounds = self.last_rounds
        else:
            self.last_rounds, self.last_exit_reason = self.m_rounds, None
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
        ledger = self.ledger
        inflight = ledger.inflight
        if launch_gen is None:  # no slot prefilled or released since the launch: no compare
            every, current = True, None
            np.subtract(inflight, self._one, out=inflight)  # one burst fewer in flight for each
        else:
            current = np.equal(launch_gen, ledger.gen, out=self._current)  # [B] bool
            every = np.count_nonzero(current) == self.batch  # count_nonzero: a fifth of the cost of .all()
            if not every:
                tokens.drop(np.logical_not(current, out=self._mask2))
            inflight -= current  # one burst fewer in flight for the sequences it committed for
        if mirror is None:
            self._advance_mirror(tokens)
            return
        pos, budget = mirror
        if every:
            np.copyto(ledger.pos, pos)
            np.copyto(ledger.left, budget)
        else:  # a refilled or released slot keeps the values its admission or release set
            np.copyto(ledger.pos, pos, where=current)
            np.copyto(ledger.left, budget, where=current)

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
        ledger = self.ledger
        epoch, launch_gen = ledger.launch_gen.popleft()
        return None if epoch == ledger.epoch else launch_gen

    def _advance_mirror(self, tokens: BurstTokens) -> None:
        """``host_pos`` and ``host_left`` after ``tokens`` (dropped rows count 0), computed on
        the host the way the commit kernel does on the device: positions advance by the
        count, a bounded budget falls by it, and a slot whose last token is its stop token
        stops (budget 0)."""
        counts = tokens.counts
        ledger = self.ledger
        ledger.pos += counts
        left, eos = ledger.left, ledger.eos
        bounded = np.not_equal(left, self._unbounded, out=self._mask)
        np.subtract(left, counts, out=left, where=bounded)
        # A slot stops when its last committed token is its stop token. tail() is that
        # token where the count is > 0 (counts are >= 0, so logical_and tests count > 0).
        stopped = np.equal(tokens.tail(), eos, out=self._mask)
        np.logical_and(stopped, counts, out=stopped)
        stopped &= np.not_equal(eos, self._no_eos, out=self._mask2)
        if np.count_nonzero(stopped):
            left[stopped] = 0

    def run_burst(self, *, mode: BurstMode | str = BurstMode.PRE_ISSUED, device_exit: bool = False) -> BurstTokens:
        """Enqueue one eager burst and drain it (``device_exit``: as for :meth:`enqueue_burst`)."""
        self.enqueue_burst(mode=mode, device_exit=device_exit)
        return self.drain()

    # ------------------------------------------------------------------ inspection

    def accept_counters(self) -> np.ndarray:
        """``[B, 2]`` host copy of ``[accepted drafts, rounds]`` (a host sync)."""
        return self.backend.to_host(self.bufs.acc, self.stream)

    def positions(self) -> np.ndarray:
        """``[B]`` host copy of the device position counter (a host sync)."""
        return self.backend.to_host(self.bufs.pos_ctr, self.stream)


def plain_draft(target, draft, k):
    """The draft a decoder runs: ``draft``, or a :class:`NoDraft` for ``draft=None`` with ``k=0``.

    Raises ValueError for a draft with ``k=0`` (it would never be called) and for ``draft=None``
    with drafts per round; TypeError for a ``k`` that is not an int.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be an int, got {type(k).__name__} {k!r}")
    if draft is None:
        if k != 0:
            raise ValueError(f"k={k} drafts per round need a draft model; draft=None decodes plainly, with k=0")
        check_target(target)  # NoDraft takes its sizes from the target's cache
        return NoDraft(target)
    if k == 0 and not isinstance(draft, NoDraft):
        raise ValueError(f"k=0 decodes plainly and never calls the draft {type(draft).__name__}; pass draft=None")
    return draft

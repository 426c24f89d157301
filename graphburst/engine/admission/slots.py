"""Putting sequences into batch slots: prefill (whole or in chunks), release, per-slot options.

:class:`Admission` does it for one decoder, which builds it and holds it (``dec.admission``)
and hands it, at construction, everything it writes: the models, the burst buffers, the
stream, the staging block, the option columns, the admission graphs and the
:class:`~graphburst.engine.ledger.SlotLedger` the decoder's bursts read.

Every write here is enqueued on the decoder's stream and touches only the slots it
names (scatters, never a read-modify-write through the host), so it may run while
bursts are still in flight: it lands behind them in stream order, and the burst after
it sees the new slot. No call here syncs with the device.

A slot's **generation** changes whenever it is prefilled or released
(:mod:`graphburst.engine.ledger`): a burst's tokens for a slot prefilled or released
after its launch belonged to the slot's previous sequence, and are dropped at drain.

A long prompt may be prefilled in **chunks**: ``prefill(..., start=s, final=False)``
writes one chunk's KV behind the rows already cached and leaves the slot idle (budget
0, emitting nothing) with its position at the chunk's end; the final chunk
(``final=True``) also computes the first token and makes the slot live. Both models
must declare ``chunked_prefill`` (see :mod:`graphburst.protocol`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from .graphs import NO_SLOT, TABLE_ROWS, AdmissionCaptureError, width_bucket
from ...constants import NO_EOS, NO_PREFILL, UNBOUNDED_BUDGET
from . import checks
from .checks import chunked_prefill
from ...protocol import ModelHooks, hook, split_options
from ...sampling.mode import SlotSampling, sample_first_tokens
from ...sampling.params import SamplingParams
from ...validate import check_int

GREEDY = SamplingParams()  # a slot's settings when none are given
_NO_OPTIONS = ModelHooks.set_slot_options  # the protocol's default: a model without per-slot options
#: The staging block's head, in units of B int32, for models without option columns: lengths,
#: starts, then the [3, n] admission table (with C option columns, H = STAGE_HEAD + C: [3 + C, n]).
STAGE_HEAD = 5


def _fresh_and_continued(lens: dict, starts: dict) -> list:
    """An admission's chunks (slot -> length) as ``[(slot -> length, fresh), ...]``: those at
    position 0 (fresh), then those continuing a cached prompt; a part only where it has slots.
    ``starts``: slot -> the chunk's first position."""
    later = {b: n for b, n in lens.items() if starts[b]}
    if not later or len(later) == len(lens):
        return [(lens, not later)]
    return [({b: n for b, n in lens.items() if not starts[b]}, True), (later, False)]


class StagingBlock:
    """The prefill staging block: one device array, allocated once so admitting a request never
    allocates, and one block so an admission is one host-to-device copy (:meth:`Admission.stage`).

    Layout, in int32: a head of ``H = STAGE_HEAD + C`` rows of B (chunk lengths ``[B]``, starts
    ``[B]``, then the admission table ``[3 + C, n]``), then the chunks, viewed ``[B, P_max]``.

    Parameters
    ----------
    batch : int
        Slots (B).
    capacity : int
        The longest chunk (the decoder's KV capacity).
    option_columns : int
        C, the models' option columns: the table's extra rows.
    backend
        Allocates the block (zeroed on the current stream: build it under the decoder's).
    """

    def __init__(self, batch: int, capacity: int, option_columns: int, backend):
        self.batch, self.capacity = batch, capacity
        self.head = STAGE_HEAD + option_columns  # H = 5 + C
        b = batch
        self.block = backend.zeros((self.head * b + b * capacity,), np.int32)  # [HB + B*cap] int32
        self.lengths = self.block[:b]  # [B] int32: chunk lengths, NO_PREFILL for slots left alone
        self.starts = self.block[b: 2 * b]  # [B] int32: a chunk's first position
        # [2B, HB): the admission table, [3 + C, n] int32 (slot, budget, stop token, C option values)
        self.chunks = self.block[self.head * b:]  # [B * capacity] int32: chunks, viewed [B, P_max]
        self._views: dict = {}  # (part, size, rows) -> device view of the block

    def view(self, part: str, size: int, rows: int = TABLE_ROWS):
        """A device view of the block, made once per (part, size, rows): a view costs a few
        microseconds of host time on cupy, and admission runs while the GPU may wait.

        ``("chunks", P_max)``: ``[B, P_max]``; ``("head+chunks", P_max)``: the block up to the
        chunks' end (the upload's destination); ``("table", n, rows)``: ``[rows, n]``.
        """
        view = self._views.get((part, size, rows))
        if view is None:
            b = self.batch
            if part == "chunks":
                view = self.chunks[: b * size].reshape(b, size)
            elif part == "head+chunks":
                view = self.block[: self.head * b + b * size]
            else:
                assert part == "table" and TABLE_ROWS <= rows <= self.head - 2, (part, rows)
                view = self.block[2 * b: 2 * b + rows * size].reshape(rows, size)
            self._views[(part, size, rows)] = view
        return view


class Admission:
    """A decoder's admission: every write that puts sequences into batch slots or takes them out.

    Built and held by :class:`~graphburst.engine.decoder.SpecDecoder` (``dec.admission``); the
    decoder's ``prefill``, ``prefill_slots``, ``release``, ... call it. Entry points: :meth:`prefill`
    (the one that validates) and :meth:`prefill_slots` (the unchecked fast path a serving loop
    takes), :meth:`release`, :meth:`set_slot_options`. An admission runs its phases through
    attribute lookup (``self.stage(...)``), so a profiler may time one by wrapping it on the
    instance: :meth:`stage` (the staging upload), then :meth:`admit_in_graph` (one graph launch)
    or, eagerly, :meth:`prefill_models` (the models' prefill calls) and :meth:`admit` (the one
    ``admit_slots`` launch), then :meth:`record` (the host's record of it).

    Parameters
    ----------
    target, draft : the decoder's models
    bufs : StreamBufs
        The burst buffers admission writes (budget, stop tokens, accept counters, ``pos_ctr``,
        ``pend``, the sampling settings).
    stream, backend
        The decoder's: every write is enqueued on its stream.
    staging : StagingBlock
        The decoder's staging block (the admission graphs bake it).
    option_columns : OptionColumns or None
        The models' per-slot int32 options, written by the ``admit_slots`` launch.
    graphs : AdmissionGraphs or None
        The admission graphs, or None for an eager decoder.
    ledger : SlotLedger
        The host's per-slot record, shared with the decoder's bursts.
    sampling : bool
        The decoder samples: final chunks carry sampling settings and draw the first token.
    fields : SlotFields or None
        The decoder's logits processing buffers (``SpecDecoder(..., fields=True)``): every chunk
        resets (at a prompt's start) and marks its slot's prompt tokens, a final chunk uploads its
        settings and counts its first token; ``ignore_eos`` makes the slot's stop token ``NO_EOS``.
    """

    def __init__(self, *, target, draft, bufs, stream, backend, staging: StagingBlock, option_columns, graphs,
                 ledger, sampling: bool, fields=None, caps=None):
        self.target, self.draft, self.bufs = target, draft, bufs
        self.stream, self.backend = stream, backend
        self.staging, self.option_columns, self.graphs, self.ledger = staging, option_columns, graphs, ledger
        self.sampling = bool(sampling)
        self.batch, self.capacity = staging.batch, staging.capacity  # the staging is sized by the decoder's
        self.host_sampling = SlotSampling(self.batch) if self.sampling else None
        self.fields = fields  # SlotFields (sampling/fields.py) or None: the logits processing fields
        self.caps = caps  # DraftCaps (engine/draft_caps.py) or None: the per-request k option
        self._option_appliers = self._models_applying_options()  # the models that apply their own options

    # ------------------------------------------------------------------ validated entry point

    def prefill(self, prompts: Sequence[Sequence[int] | None], *, start=None, final: bool = True,
                max_new_tokens=None, eos=None, temperature=None, top_k=None, top_p=None, seed=None,
                fields=None) -> None:
        """Write prompts (or chunks of them) into the caches and reset those slots' bookkeeping.

        May be called with bursts in flight: it is ordered behind them on the stream, and
        their tokens for the slots it touches are dropped at drain (the module docstring).

        Parameters
        ----------
        prompts : sequence of length B
            Token list per slot (this chunk's tokens), or None to leave a slot untouched.
        start : int or sequence, optional
            Per-slot position of the chunk's first token: rows ``[0, start)`` already hold
            the prompt's earlier chunks. Default 0 (a whole prompt).
        final : bool
            The chunk ends the prompt: compute the first token and make the slot live.
            ``False``: write the chunk's KV only; the slot stays idle (budget 0) until its
            final chunk. ``start > 0`` or ``final=False`` need both models' ``chunked_prefill``.
        max_new_tokens : int or sequence, optional
            Per-slot token limit (unbounded by default). Final chunks only.
        eos : int or sequence, optional
            Per-slot stop token (none by default). Final chunks only.
        temperature, top_k, top_p, seed : scalar or sequence, optional
            Per-slot sampling settings (``sampling_params.check_sampling``); None means
            greedy (temperature 0, filters off, seed 0). Temperature > 0 needs a decoder
            built with ``sampling=True``; the first token is then sampled too. Final chunks only.
        fields : dict, or sequence of dict or None, optional
            The logits processing fields (``sampling.params.check_fields``), for every slot
            or per slot; they need a decoder built with ``fields=True``. Final chunks only.

        Raises
        ------
        ValueError, TypeError
            Before anything is written, for a bad prompt, start, limit or stop token.
        CapacityError
            When a request cannot fit in the KV cache.
        """
        slots, rows, starts, limits, stops, sampling = checks.check_prefill(
            prompts, start, final, max_new_tokens, eos, temperature, top_k, top_p, seed, batch=self.batch,
            capacity=self.capacity, ring_capacity=self.bufs.ring_capacity, target=self.target, draft=self.draft,
            sampling=self.sampling, fields=fields, with_fields=self.fields is not None)
        if slots:  # validated now: on through the unchecked entry point
            self.prefill_slots(slots, rows, starts, final=final, limits=limits, stops=stops, sampling=sampling)

    def check_first_burst_fits(self, prompt, max_new_tokens=None, eos=None, *, index: int | None = None,
                               start: int = 0):
        """:func:`checks.check_first_burst_fits` against this decoder's vocabulary, capacity and ring."""
        return checks.check_first_burst_fits(prompt, max_new_tokens, eos, vocab=self.target.vocab,
                                             capacity=self.capacity, ring_capacity=self.bufs.ring_capacity,
                                             index=index, start=start)

    # ------------------------------------------------------------------ the unchecked fast path

    def prefill_slots(self, slots: list, rows: list, starts: list, *, final: bool = True, limits: list | None = None,
                      stops: list | None = None, sampling: list | None = None, options: list | None = None) -> None:
        """:meth:`prefill` of values the caller has validated already, given per slot as lists,
        with no checks repeated and no dict built or looked up (the serving loop's admission).

        A serving loop validates every request once at submission with the checks
        :meth:`prefill` uses and a stricter capacity rule (the whole request must fit;
        ``serving.request.check_whole_request_fits``): admission is then host work the GPU
        waits on, and repeating the checks there would cost every refill. Anything not
        validated so is undefined behaviour; use :meth:`prefill`.

        Parameters
        ----------
        slots : list of int
            Distinct slots, ascending.
        rows, starts : lists, one entry per slot
            Its chunk (``[n] int32``, n >= 1, each in ``[0, vocab)``) and the chunk's first position.
        final : bool
            As for :meth:`prefill`.
        limits, stops : lists, final chunks only
            Budget (``UNBOUNDED_BUDGET`` for none) and stop token (``NO_EOS`` for none).
        sampling : list, optional
            ``SamplingParams`` or None (greedy) per slot (sampling decoders, final chunks).
        options : list, optional
            A ``slot_options(...)`` result or None (the defaults) per slot, applied first as by
            :meth:`set_slot_options`; None: the slots keep their options. A model's option
            columns (``option_columns``) are written in the admission's one launch (not at all
            if it fails).
        """
        # min/max, not a generator over the slots: admission runs while the GPU may wait
        assert not slots or (0 <= slots[0] and slots[-1] < self.batch), "prefill_slots: a slot outside the batch"
        if not slots:
            return
        option_rows, cols = None, self.option_columns
        if options is not None:
            if self._option_appliers:  # a model without columns applies its own
                self._apply_options(dict(zip(slots, options)), with_columns=False)
            if cols is not None:
                option_rows = cols.rows(options)
        if not final:
            limits = stops = None
        elif limits is None or stops is None:
            limits = limits or [UNBOUNDED_BUDGET] * len(slots)
            stops = stops or [NO_EOS] * len(slots)
        # only a sampling decoder reads the settings (greedy decoders sample nothing)
        settings = {b: p or GREEDY for b, p in zip(slots, sampling or [None] * len(slots))} \
            if final and self.sampling else {}
        if self.fields is not None and final and any(p.ignore_eos for p in settings.values()):
            stops = [NO_EOS if settings[b].ignore_eos else stop for b, stop in zip(slots, stops)]
        # Stage (one upload), then the models' prefill and the slot writes: one admission graph
        # launch (graphs.py) or, eagerly, each model's calls and one admit_slots launch.
        index = np.asarray(slots, np.int64)  # [n] int64: the slots, ascending
        lengths = [len(r) for r in rows]
        graphs = self.graphs
        width = width_bucket(max(lengths), self.capacity) if graphs is not None else None
        host, table = self.stage(slots, index, rows, lengths, starts, limits, stops, option_rows, width)
        ends = [s + n for s, n in zip(starts, lengths)]  # each chunk's end: the slot's position after it
        n_rows, n = table.shape[0], len(slots)
        if graphs is not None and not self.admit_in_graph(width, n_rows, final, any(starts)):
            graphs = None  # the staging (padded width, NO_SLOT-padded table) serves the eager calls too
        if graphs is None:
            batch = self.batch
            stage = self.staging.view("chunks", (host.size - self.staging.head * batch) // batch)
            self.prefill_models(stage, ends, slots, index, lengths, starts, settings, final, stops)
            self.admit(table)
        self.record(index, ends, limits, host[2 * self.batch: 2 * self.batch + table.size].reshape(n_rows, -1)[:, :n])

    # ------------------------------------------------------------------ the phases of an admission

    def stage(self, slots: list, index: np.ndarray, rows: list, lengths: list, starts: list,
              limits: list | None, stops: list | None, option_rows: list | None = None, width: int | None = None):
        """Build the staging block on the host and upload it in one copy: chunk lengths
        (``[B]``, NO_PREFILL for slots left alone), starts (``[B]``), the admission table
        (``[3 + c, n]``: slot, budget, stop token, then ``option_rows``' c rows of option column
        values; budget 0 until a prompt's final chunk: ``limits`` None) and, after the head of
        ``H = 5 + C`` rows of B, the chunks padded to the longest (``[B, P_max]``). ``index``:
        ``slots`` (ascending) as ``[n]`` int64; the other lists hold one entry per slot. ``width``
        (an admission graph's): the chunks padded to it instead, and the table to ``B`` entries,
        the last ``B - n`` of slot ``NO_SLOT``.
        Returns ``(the host block [HB + B*P_max] int32, the table's device view [3 + c, n] int32)``."""
        batch, n, staging = self.batch, len(slots), self.staging
        p_max = max(lengths) if width is None else width
        head = staging.head
        host = np.zeros(head * batch + batch * p_max, np.int32)  # the head, then [B, P_max] int32
        host[:batch] = NO_PREFILL
        host[index] = lengths
        if any(starts):  # else they stay 0 (whole prompts: a serving loop's common case)
            host[batch + index] = starts
        table_rows = TABLE_ROWS + (len(option_rows) if option_rows else 0)
        entries = n if width is None else batch  # a graph's table has B entries, the padding skipped
        full = host[2 * batch: 2 * batch + table_rows * entries].reshape(table_rows, entries)  # [3 + c, n or B]
        table = full[:, :n]
        if width is not None:
            full[0, n:] = NO_SLOT
        table[0] = index
        if limits is not None:
            table[1], table[2] = limits, stops
        else:
            table[2] = NO_EOS  # and budget 0
        if option_rows:
            table[3:] = option_rows
        # Whole columns above, the chunks slot by slot (a padded scatter costs more at ~20 short prompts).
        tokens = host[head * batch:].reshape(batch, p_max)  # [B, P_max] int32
        for b, chunk, size in zip(slots, rows, lengths):
            tokens[b, :size] = chunk
        # Stream-ordered, into the staging block: a second prefill enqueued before the first
        # has run overwrites it only after the first's kernels have read it.
        self.backend.upload(staging.view("head+chunks", p_max), host, self.stream)
        return host, staging.view("table", entries, table_rows)

    def admit_in_graph(self, width: int, rows: int, final: bool, continued: bool) -> bool:
        """Launch the admission graph (the models' prefill and ``admit_slots`` in one launch); False
        (and eager admission from now on, with a warning) when it cannot be captured: a model that
        declared ``prefill_in_graph`` wrongly must not cost every admission its requests."""
        try:
            self.graphs.launch(width, rows, final, continued)
            return True
        except AdmissionCaptureError as exc:
            self._admit_eagerly(exc)
            return False

    def _admit_eagerly(self, exc: AdmissionCaptureError) -> None:
        warnings.warn(f"{exc}; admitting eagerly from now on", RuntimeWarning, stacklevel=4)
        self.graphs = None

    def prefill_models(self, stage, ends: list, slots: list, index: np.ndarray, lengths: list, starts: list,
                       settings: dict, final: bool, stops: list | None = None) -> None:
        """Run: the models' prefill (the target sets ``pos_ctr`` and, when final, ``pend``), in
        the calls each model asks for (``prefill_groups``), then a sampled first token.
        ``slots`` ascending, ``index`` the same as ``[n]`` int64; ``ends``, ``lengths``, ``starts``:
        each chunk's end, length and first position, one entry per slot.

        Slots whose chunk starts at position 0 are **fresh**: the models are told so by
        ``start=None`` (a torch module then attends to the prompt's own tokens, and may pack
        them). A model that asks for it (``prefill_fresh_apart``) gets them in calls apart from
        later chunks of longer prompts (padded, attending over the cache)."""
        s, bufs, prompt_len = self.stream, self.bufs, self.staging.lengths
        sampling = self.sampling and final
        if sampling:
            self.host_sampling.set(settings)
            self.host_sampling.upload(self.backend, bufs, s)
        fields = self.fields
        if fields is not None:  # the prompt's tokens (a fresh prompt's rows reset first), the final's settings
            fields.admit_chunks(self.backend.ops, self.staging, stage, s)
            if sampling:
                fields.set(settings, dict(zip(slots, ends)), dict(zip(slots, stops or [NO_EOS] * len(slots))))
                fields.upload(self.backend, settings, s)
        pend = bufs.pend if final else None
        lens = None
        for model, pos_ctr, out in ((self.target, bufs.pos_ctr, pend), (self.draft, None, None)):
            if not chunked_prefill(model):
                model.prefill(stage, prompt_len, pos_ctr, out, s)
                continue
            if lens is None:
                lens, later = dict(zip(slots, lengths)), any(starts)
            apart = later and hook(model, "prefill_fresh_apart")
            parts = _fresh_and_continued(lens, dict(zip(slots, starts))) if apart else [(lens, not later)]
            for part, fresh in parts:
                start = None if fresh else self.staging.starts
                for group in hook(model, "prefill_groups")(part, fresh):
                    # the slot list on the host spares the model a device sync; the staging is
                    # narrowed to this call's longest chunk, so the call pads to its own rows only
                    if group == slots:  # one call for the whole admission (most models)
                        width, rows, sizes = stage.shape[1], index, lengths
                    else:
                        sizes = [part[b] for b in group]
                        width, rows = max(sizes), np.asarray(group, np.int64)
                    # a packing model takes the lengths too, so it never reads them from the device
                    extra = {"lengths": np.asarray(sizes, np.int32)} if getattr(model, "packed_prefill", False) \
                        else {}
                    model.prefill(stage if width == stage.shape[1] else stage[:, :width], prompt_len, pos_ctr,
                                  out, s, start=start, rows=rows, **extra)
        if sampling:
            prompt_end = np.full(self.batch, NO_PREFILL, np.int32)  # [B] int32
            prompt_end[index] = ends
            sample_first_tokens(self.backend.ops, self.backend, bufs, prompt_end, s, fields, prompt_len)

    def admit(self, table) -> None:
        """The one ``admit_slots`` launch of an eager admission: each slot of ``table`` (the staged
        ``[3 + c, n]`` int32 view: slot, budget, stop token, c option values) gets its budget and
        stop token, its accept counters zeroed, and its option column values."""
        bufs = self.bufs
        self.backend.ops.admit_slots(table, bufs.budget, bufs.eos, bufs.acc,
                                     self.option_columns.table if table.shape[0] > TABLE_ROWS else None,
                                     stream=self.stream)

    def record(self, slots: np.ndarray, ends: list, limits: list | None, host_table: np.ndarray) -> None:
        """Record in the host mirror what the admission wrote on the device: each prefilled slot's
        budget (``limits``; 0 until its final chunk: None) and stop token (``host_table``, the host
        copy of the table's ``[3 + c, n]`` entries), and ``ends``, each slot's position after its
        chunk; a new generation. ``slots``: ``[n]`` int64, ascending."""
        ledger = self.ledger
        ledger.pos[slots], ledger.left[slots], ledger.eos[slots] = ends, host_table[1], host_table[2]
        ledger.new_generation(slots)
        # The other slots' launch counts did not change and a slot whose whole budget fits never limits
        # it (SlotLedger.bursts_that_fit): a serving loop admits only such requests, so it recounts nothing here.
        # limit > capacity - end, not end + limit > capacity: an int32 end plus UNBOUNDED_BUDGET would wrap
        if limits is not None and any(limit > self.capacity - end for end, limit in zip(ends, limits)):
            ledger.update_fits()

    # ------------------------------------------------------------------ release, options, graphs

    def release(self, slots) -> None:
        """Make slots idle (budget 0): they emit nothing until the next prefill.

        May be called with bursts in flight: their tokens for these slots are dropped.
        """
        slots = [check_int("slot", b, minimum=0, maximum=self.batch - 1) for b in slots]
        if not slots:
            return
        slots = np.asarray(sorted(set(slots)), np.int64)
        self.backend.scatter(self.bufs.budget, slots, 0, self.stream)
        ledger = self.ledger
        ledger.left[slots] = 0
        ledger.new_generation(slots)
        ledger.update_fits()

    def slot_options(self, options: dict | None) -> dict:
        """Validate one request's model options (at submission); see :func:`protocol.split_options`.

        Returns an opaque value for :meth:`set_slot_options`; raises ValueError/TypeError
        naming a key no model accepts or a model's own complaint.
        """
        models = {"target": self.target, "draft": self.draft}
        if self.caps is not None:
            models["speculation"] = self.caps
        return split_options(models, options)

    def set_slot_options(self, settings: dict) -> None:
        """Apply validated options (at admission, before :meth:`prefill`), stream-ordered.

        Parameters
        ----------
        settings : dict
            ``slot -> slot_options(...) result``, or None to restore the models' defaults
            (give every admitted slot an entry, so a reused slot forgets its last request).
        """
        for slot in settings:
            check_int("slot", slot, minimum=0, maximum=self.batch - 1)
        self._apply_options(settings)

    def _apply_options(self, settings: dict, *, with_columns: bool = True) -> None:
        """:meth:`set_slot_options` of checked slots, only to the models that take options: the
        option columns scattered (unless ``with_columns`` is False), the other models called."""
        if not settings:
            return
        cols = self.option_columns
        if cols is not None and with_columns:
            cols.scatter(self.backend, settings, self.stream)
        for role, apply in self._option_appliers:
            apply({b: None if v is None else v[role] for b, v in settings.items()}, self.stream)

    def _models_applying_options(self) -> list:
        """``[(role, its set_slot_options)]`` of the models that apply their own options: those
        without option columns whose ``set_slot_options`` is not the protocol's default (which
        does nothing). Found once, at construction: admission asks at every refill."""
        cols, appliers = self.option_columns, []
        for role in ("target", "draft"):
            if cols is not None and cols.owns(role):
                continue
            apply = getattr(getattr(self, role), "set_slot_options", None)
            if getattr(apply, "__func__", apply) not in (None, _NO_OPTIONS):
                appliers.append((role, apply))
        return appliers

    def warm_graphs(self, *, longest: int | None = None, chunk: int | None = None) -> int:
        """Capture now the admission graphs a serving loop's admissions take
        (:meth:`AdmissionGraphs.warm`: prompts up to ``longest`` tokens, default the capacity;
        ``chunk``: the loop's ``prefill_chunk``), so none is captured while bursts run. Returns the
        graphs captured: 0 for an eager decoder, or when a capture fails, which warns and makes
        admission eager from then on, as at an admission."""
        longest = self.capacity if longest is None else check_int("longest", longest, minimum=1)
        chunk = None if chunk is None else check_int("chunk", chunk, minimum=1)
        graphs = self.graphs
        if graphs is None:
            return 0
        cols = self.option_columns
        try:
            return graphs.warm(longest=longest, chunk=chunk,
                               option_rows=0 if cols is None else cols.count)
        except AdmissionCaptureError as exc:
            self._admit_eagerly(exc)
            return 0

    def refresh(self, what: str = "refresh_tables") -> None:
        """The decoder refreshes its tables (before a recapture): the models may hand out new tables
        and option arrays, so the option columns are read again and every admission graph is
        dropped (each recaptured at its next use)."""
        if self.option_columns is not None:
            self.option_columns.invalidate(what)
        if self.graphs is not None:
            self.graphs.invalidate(what)

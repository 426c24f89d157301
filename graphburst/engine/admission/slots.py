"""Putting sequences into batch slots: prefill (whole or in chunks), release, per-slot options.

Every write here is enqueued on the decoder's stream and touches only the slots it
names (scatters, never a read-modify-write through the host), so it may run while
bursts are still in flight: it lands behind them in stream order, and the burst after
it sees the new slot. No call here syncs with the device.

A slot's **generation** changes whenever it is prefilled or released. A burst remembers
the generations it was launched under; when it is drained, the tokens it committed for
a slot whose generation has changed since are dropped (they belonged to the slot's
previous sequence, a finished or cancelled one), and the host mirror ignores them.

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
from .checks import PrefillChecks, chunked_prefill
from ...protocol import ModelHooks, hook, split_options
from ...sampling.mode import sample_first_tokens
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


class SlotAdmission(PrefillChecks):
    """The admission half of :class:`~graphburst.engine.decoder.SpecDecoder` (a mixin; the decoder
    owns ``bufs``, ``stream``, the host mirrors and ``_update_fits``)."""

    # ------------------------------------------------------------------ prefill

    def prefill(self, prompts: Sequence[Sequence[int] | None], *, start=None, final: bool = True,
                max_new_tokens=None, eos=None, temperature=None, top_k=None, top_p=None, seed=None) -> None:
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

        Raises
        ------
        ValueError, TypeError
            Before anything is written, for a bad prompt, start, limit or stop token.
        CapacityError
            When a request cannot fit in the KV cache.
        """
        rows, starts, limits, stops, settings = self._check_prefill(prompts, start, final, max_new_tokens, eos,
                                                                    temperature, top_k, top_p, seed)
        if rows:  # validated now: on through the unchecked entry point, which puts them in slot order
            self.prefill_checked(rows, starts, final=final, limits=limits, stops=stops, sampling=settings)

    def prefill_checked(self, rows: dict, starts: dict, *, final: bool = True, limits: dict | None = None,
                        stops: dict | None = None, sampling: dict | None = None, options: dict | None = None) -> None:
        """:meth:`prefill` of values the caller has validated already, with no checks repeated.

        For a serving loop, which validates every request once at submission with the
        checks :meth:`prefill` uses and a stricter capacity rule (the whole request must
        fit; ``serving.request.check_whole_request_fits``): admission is then host work the
        GPU waits on, and repeating the checks there would cost every refill. Anything not
        validated so is undefined behaviour; use :meth:`prefill`. :meth:`prefill_slots` takes
        the same values as lists, with no dict built or looked up.

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
            as by :meth:`set_slot_options`.
        """
        slots = sorted(rows)
        limits, stops, sampling = limits or {}, stops or {}, sampling or {}
        if options and options.keys() != rows.keys():  # options of other slots too: applied apart, first
            self._set_slot_options(options)
            options = None
        self.prefill_slots(slots, [rows[b] for b in slots], [starts.get(b, 0) for b in slots], final=final,
                           limits=[limits.get(b, UNBOUNDED_BUDGET) for b in slots] if final else None,
                           stops=[stops.get(b, NO_EOS) for b in slots] if final else None,
                           sampling=[sampling.get(b) for b in slots] if final and self.sampling else None,
                           options=[options[b] for b in slots] if options else None)

    def prefill_slots(self, slots: list, rows: list, starts: list, *, final: bool = True, limits: list | None = None,
                      stops: list | None = None, sampling: list | None = None, options: list | None = None) -> None:
        """:meth:`prefill_checked` of values given per slot as lists (the serving loop's admission).

        Parameters
        ----------
        slots : list of int
            Distinct slots, ascending.
        rows, starts : lists, one entry per slot
            Its chunk (``[n] int32``, n >= 1) and the chunk's first position.
        limits, stops : lists, final chunks only
            Budget (``UNBOUNDED_BUDGET`` for none) and stop token (``NO_EOS`` for none).
        sampling : list, optional
            ``SamplingParams`` or None (greedy) per slot (sampling decoders, final chunks).
        options : list, optional
            A ``slot_options(...)`` result or None (the defaults) per slot, applied first as by
            :meth:`set_slot_options`; None: the slots keep their options. A model's option
            columns (``option_columns``) are written in the admission's one launch.
        """
        # min/max, not a generator over the slots: admission runs while the GPU may wait
        assert not slots or (0 <= slots[0] and slots[-1] < self.batch), "prefill_slots: a slot outside the batch"
        if not slots:
            return
        option_rows, cols = None, self.option_columns
        if options is not None:
            if self._option_appliers:  # a model without columns applies its own
                self._set_slot_options(dict(zip(slots, options)), with_columns=False)
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
        self._prefill_checked(slots, rows, starts, limits, stops, settings, final, option_rows)

    def _prefill_checked(self, slots: list, rows: list, starts: list, limits: list | None, stops: list | None,
                         settings: dict, final: bool, option_rows: list | None = None) -> None:
        """Stage (one upload), then the models' prefill and the slot writes: one admission graph
        launch (graphs.py) or, eagerly, each model's calls and one ``admit_slots`` launch.
        ``slots`` ascending; ``rows``, ``starts``, ``limits`` and ``stops`` (None for a non-final
        chunk) one entry per slot; ``option_rows``: C lists of option column values (None: the
        columns are left alone)."""
        index = np.asarray(slots, np.int64)  # [n] int64: the slots, ascending
        lengths = [len(r) for r in rows]
        graphs = self.admission_graphs
        width = width_bucket(max(lengths), self.capacity) if graphs is not None else None
        host, table = self._stage_prompts(slots, index, rows, lengths, starts, limits, stops, option_rows, width)
        ends = [s + n for s, n in zip(starts, lengths)]  # each chunk's end: the slot's position after it
        n_rows, n = table.shape[0], len(slots)
        if graphs is not None and not self._admit_in_graph(graphs, width, n_rows, final, any(starts)):
            graphs = None  # the staging (padded width, NO_SLOT-padded table) serves the eager calls too
        if graphs is None:
            stage = self._stage_view("chunks", (host.size - self._stage_head * self.batch) // self.batch)
            self._prefill_models(stage, ends, slots, index, lengths, starts, settings, final)
            bufs = self.bufs
            self.backend.ops.admit_slots(table, bufs.budget, bufs.eos, bufs.acc,
                                         self.option_columns.table if n_rows > 3 else None, stream=self.stream)
        self._admit(index, ends, limits, host[2 * self.batch: 2 * self.batch + table.size].reshape(n_rows, -1)[:, :n])

    def _admit_in_graph(self, graphs, width: int, rows: int, final: bool, continued: bool) -> bool:
        """Launch the admission graph; False (and eager admission from now on, with a warning) when
        it cannot be captured: a model that declared ``prefill_in_graph`` wrongly must not cost
        every admission its requests."""
        try:
            graphs.launch(width, rows, final, continued)
            return True
        except AdmissionCaptureError as exc:
            self._admit_eagerly(exc)
            return False

    def _admit_eagerly(self, exc: AdmissionCaptureError) -> None:
        warnings.warn(f"{exc}; admitting eagerly from now on", RuntimeWarning, stacklevel=4)
        self.admission_graphs = None

    def warm_admission_graphs(self, *, longest: int | None = None, chunk: int | None = None) -> int:
        """Capture now the admission graphs a serving loop's admissions take
        (:meth:`AdmissionGraphs.warm`: prompts up to ``longest`` tokens, default the capacity;
        ``chunk``: the loop's ``prefill_chunk``), so none is captured while bursts run. Returns the
        graphs captured: 0 for an eager decoder, or when a capture fails, which warns and makes
        admission eager from then on, as at an admission."""
        longest = self.capacity if longest is None else check_int("longest", longest, minimum=1)
        chunk = None if chunk is None else check_int("chunk", chunk, minimum=1)
        graphs = self.admission_graphs
        if graphs is None:
            return 0
        cols = self.option_columns
        try:
            return graphs.warm(longest=longest, chunk=chunk,
                               option_rows=0 if cols is None else cols.count)
        except AdmissionCaptureError as exc:
            self._admit_eagerly(exc)
            return 0

    def _stage_prompts(self, slots: list, index: np.ndarray, rows: list, lengths: list, starts: list,
                       limits: list | None, stops: list | None, option_rows: list | None = None,
                       width: int | None = None):
        """Build the staging block on the host and upload it in one copy: chunk lengths
        (``[B]``, NO_PREFILL for slots left alone), starts (``[B]``), the admission table
        (``[3 + c, n]``: slot, budget, stop token, then ``option_rows``' c rows of option column
        values; budget 0 until a prompt's final chunk: ``limits`` None) and, after the head of
        ``H = 5 + C`` rows of B, the chunks padded to the longest (``[B, P_max]``). ``index``:
        ``slots`` (ascending) as ``[n]`` int64; the other lists hold one entry per slot. ``width``
        (an admission graph's): the chunks padded to it instead, and the table to ``B`` entries,
        the last ``B - n`` of slot ``NO_SLOT``.
        Returns ``(the host block [HB + B*P_max] int32, the table's device view [3 + c, n] int32)``."""
        batch, n = self.batch, len(slots)
        p_max = max(lengths) if width is None else width
        head = self._stage_head
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
        self.backend.upload(self._stage_view("head+chunks", p_max), host, self.stream)
        return host, self._stage_view("table", entries, table_rows)

    def _stage_view(self, part: str, size: int, rows: int = 3):
        """A device view of the staging block, made once per (part, size, rows): a view costs a
        few microseconds of host time on cupy, and admission runs while the GPU may wait.

        ``("chunks", P_max)``: ``[B, P_max]``; ``("head+chunks", P_max)``: the block up to the
        chunks' end (the upload's destination); ``("table", n, rows)``: ``[rows, n]``.
        """
        view = self._stage_views.get((part, size, rows))
        if view is None:
            b = self.batch
            if part == "chunks":
                view = self._prompt_flat[: b * size].reshape(b, size)
            elif part == "head+chunks":
                view = self._stage[: self._stage_head * b + b * size]
            else:
                assert part == "table" and 3 <= rows <= self._stage_head - 2, (part, rows)
                view = self._stage[2 * b: 2 * b + rows * size].reshape(rows, size)
            self._stage_views[(part, size, rows)] = view
        return view

    def _prefill_models(self, stage, ends: list, slots: list, index: np.ndarray, lengths: list, starts: list,
                        settings: dict, final: bool) -> None:
        """Run: the models' prefill (the target sets ``pos_ctr`` and, when final, ``pend``), in
        the calls each model asks for (``prefill_groups``), then a sampled first token.
        ``slots`` ascending, ``index`` the same as ``[n]`` int64; ``ends``, ``lengths``, ``starts``:
        each chunk's end, length and first position, one entry per slot.

        Slots whose chunk starts at position 0 are **fresh**: the models are told so by
        ``start=None`` (a torch module then attends to the prompt's own tokens, and may pack
        them). A model that asks for it (``prefill_fresh_apart``) gets them in calls apart from
        later chunks of longer prompts (padded, attending over the cache)."""
        s, bufs = self.stream, self.bufs
        sampling = self.sampling and final
        if sampling:
            self.host_sampling.set(settings)
            self.host_sampling.upload(self.backend, bufs, s)
        pend = bufs.pend if final else None
        lens = None
        for model, pos_ctr, out in ((self.target, bufs.pos_ctr, pend), (self.draft, None, None)):
            if not chunked_prefill(model):
                model.prefill(stage, self._prompt_len, pos_ctr, out, s)
                continue
            if lens is None:
                lens, later = dict(zip(slots, lengths)), any(starts)
            apart = later and hook(model, "prefill_fresh_apart")
            parts = _fresh_and_continued(lens, dict(zip(slots, starts))) if apart else [(lens, not later)]
            for part, fresh in parts:
                start = None if fresh else self._prompt_start
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
                    model.prefill(stage if width == stage.shape[1] else stage[:, :width], self._prompt_len, pos_ctr,
                                  out, s, start=start, rows=rows, **extra)
        if sampling:
            prompt_end = np.full(self.batch, NO_PREFILL, np.int32)  # [B] int32
            prompt_end[index] = ends
            sample_first_tokens(self.backend.ops, self.backend, bufs, prompt_end, s)

    def _admit(self, slots: np.ndarray, ends: list, limits: list | None, host_table: np.ndarray) -> None:
        """Record in the host mirror what the admission wrote on the device: each prefilled slot's
        budget (``limits``; 0 until its final chunk: None) and stop token (``host_table``, the host
        copy of the table's ``[3 + c, n]`` entries), and ``ends``, each slot's position after its
        chunk; a new generation."""
        self.host_pos[slots], self.host_left[slots], self.host_eos[slots] = ends, host_table[1], host_table[2]
        self._new_generation(slots)
        # The other slots' launch counts did not change and a slot whose whole budget fits never limits
        # it (_bursts_that_fit): a serving loop admits only such requests, so it recounts nothing here.
        # limit > capacity - end, not end + limit > capacity: an int32 end plus UNBOUNDED_BUDGET would wrap
        if limits is not None and any(limit > self.capacity - end for end, limit in zip(ends, limits)):
            self._update_fits()

    # ------------------------------------------------------------------ release and options

    def release(self, slots) -> None:
        """Make slots idle (budget 0): they emit nothing until the next prefill.

        May be called with bursts in flight: their tokens for these slots are dropped.
        """
        slots = [check_int("slot", b, minimum=0, maximum=self.batch - 1) for b in slots]
        if not slots:
            return
        slots = np.asarray(sorted(set(slots)), np.int64)
        self.backend.scatter(self.bufs.budget, slots, 0, self.stream)
        self.host_left[slots] = 0
        self._new_generation(slots)
        self._update_fits()

    def slot_options(self, options: dict | None) -> dict:
        """Validate one request's model options (at submission); see :func:`protocol.split_options`.

        Returns an opaque value for :meth:`set_slot_options`; raises ValueError/TypeError
        naming a key no model accepts or a model's own complaint.
        """
        return split_options({"target": self.target, "draft": self.draft}, options)

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
        self._set_slot_options(settings)

    def _set_slot_options(self, settings: dict, *, with_columns: bool = True) -> None:
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

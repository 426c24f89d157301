"""Admission as one captured CUDA graph per prompt width, for models that prefill from device sizes.

An eager admission is a staging upload and then three launches from Python: the target's
prefill, the draft's, and ``admit_slots``. When both models declare ``prefill_in_graph``
(their ``prefill`` reads every size on the device: each slot's chunk length from
``prompt_len``, ``NO_PREFILL`` for a slot left alone), those three launches depend on the
host only through the staging block's width and the admission table's shape. So the
decoder captures them once per **width bucket** (the next power of two of the longest
prompt, at least :data:`MIN_WIDTH`, at most the capacity) over a table of all ``B``
entries, padded with :data:`NO_SLOT`, and an admission is then the staging upload plus
one graph launch. Between bursts every host microsecond of admission is GPU idle when the
bursts are short (zero-cost models, n-gram drafting); a graph launch costs the host a few
microseconds, a kernel launch from Python ten or more.

Every admission of a greedy decoder whose models qualify takes this path: a graph per
(width, table rows, final chunk or not, continuing cached prompts or not); other
decoders stay eager (:mod:`graphburst.engine.admission.slots`). On the numpy backend the same bound
calls are recorded and run in order, so CI runs this path. A captured graph bakes the
staging block, the burst buffers, the models' caches and tables: it registers with every
holder of them that tells its guards of a rebinding, and rebinding one, or the decoder's
``refresh_tables`` before a recapture, drops every graph, recaptured at its next use.
"""

from __future__ import annotations

from ...protocol import hook
from ..collector import COLLECTOR_PAUSE
from ..torch_capture import capture_api


class AdmissionCaptureError(RuntimeError):
    """An admission graph could not be captured (a model's prefill allocated, synced, or used an
    API capture forbids): the decoder then admits eagerly (``Admission.prefill_slots``)."""


#: Narrowest staging width captured: shorter prompts share one graph.
MIN_WIDTH = 16
#: Admission-table entry of no slot (the padding of a graph's ``B``-entry table): ``admit_slots`` skips it.
NO_SLOT = -1
#: The admission table's rows before any option column: slot, budget, stop token.
TABLE_ROWS = 3


def width_bucket(p_max: int, capacity: int) -> int:
    """The staging width a graph admission of prompts up to ``p_max`` tokens uses: the next
    power of two of ``p_max``, at least :data:`MIN_WIDTH` and at most ``capacity``."""
    width = MIN_WIDTH
    while width < p_max:
        width *= 2
    return min(width, capacity)


def widths_up_to(p_max: int, capacity: int) -> list:
    """Every width bucket (:func:`width_bucket`) of prompts of 1 to ``p_max`` tokens, narrowest first."""
    top, width, widths = width_bucket(p_max, capacity), MIN_WIDTH, []
    while width < top:
        widths.append(width)
        width *= 2
    return widths + [top]


class _Recorded:
    """The numpy backend's stand-in for a captured graph: the bound calls, run in order."""

    def __init__(self, calls: list):
        self.calls = calls

    def launch(self, stream) -> None:
        for call in self.calls:
            call(stream)


class AdmissionGraphs:
    """The admission graphs of one decoder, one per (width bucket, table rows), captured at first use
    or ahead of it (:meth:`warm`: a serving loop captures all of its own when it is built).

    Parameters
    ----------
    target, draft : the models
        Their prefill calls, caches and tables are baked in.
    bufs : StreamBufs
        The burst buffers ``prefill`` and ``admit_slots`` write (baked in).
    staging : StagingBlock
        The decoder's prefill staging block (:mod:`graphburst.engine.admission.slots`): its
        views are baked in, so each admission uploads into it before the launch.
    option_columns : OptionColumns or None
        The models' option columns, written through their pointer table by ``admit_slots``.
    backend, stream
        The decoder's: graphs are uploaded and launched on its stream.

    Holds the models and buffers, never the decoder or its admission: nothing they hold refers
    back here but weakly (the watchers), so no cycle leaves a dead decoder's graphs and capture
    stream to the cyclic collector, which may run while another graph is being captured, and
    destroying a graph or stream then invalidates that capture.
    """

    def __init__(self, *, target, draft, bufs, staging, option_columns, backend, stream):
        self._target, self._draft, self._bufs = target, draft, bufs
        self._staging, self._option_columns = staging, option_columns
        self._backend, self._stream = backend, stream
        self._graphs: dict = {}  # (width, table rows, final, continued) -> graph
        self.captures = 0  # graphs captured (a recapture after invalidation counts again)
        self.launches = 0  # admissions run through a graph
        # Captured on a stream of their own: the decoder's may have bursts in flight.
        self._capture_stream = backend.new_stream() if backend.is_gpu else None
        for holder in self._holders():
            holder.watch(self)

    @staticmethod
    def usable(target, draft, *, sampling: bool) -> bool:
        """Whether a decoder's admissions may run as graphs: both models prefill from device sizes,
        through CuPy (a torch model is captured by torch), and the decoder is greedy (``sampling``
        False: a sampled first token is drawn on the host's settings)."""
        models = (target, draft)
        # a packing model's prefill takes the lengths from the host (Admission.prefill_models)
        return not sampling and capture_api(*models) == "cupy" and \
            all(hook(m, "prefill_in_graph") and not hook(m, "packed_prefill") for m in models)

    def _holders(self) -> list:
        """Every object that tells its guards when it rebinds a buffer the graphs bake (as BurstGraph
        watches them): the burst buffers, the models, their caches and layers, the models' own
        holders. The option columns follow the models, watched by them; the decoder's rollback
        table is not baked, and the decoder drops these graphs itself when it refreshes its tables."""
        holders = [self._bufs]
        for model in (self._target, self._draft):
            holders += [model, model.cache, *(layer for layer in model.cache.layers if layer is not None)]
            holders += list(hook(model, "watched")())
        return [h for h in holders if hasattr(h, "watch")]

    def invalidate(self, what: str = "") -> None:
        """A baked buffer may have moved: drop every graph (each is recaptured at its next use)."""
        self._graphs.clear()

    def warm(self, *, longest: int, chunk: int | None, option_rows: int) -> int:
        """Capture now, without launching, every graph a serving loop's admissions can take, so
        that none is captured while bursts run (with short bursts the GPU waits for a capture, and
        the first prompt of each width bucket would pay one).

        A loop passes every admitted slot's options, so its final chunks carry ``option_rows``
        extra table rows. Without ``chunk``, each prompt is one fresh final chunk: one graph per width
        bucket of prompts up to ``longest`` tokens. With ``chunk`` (the loop's ``prefill_chunk``), no
        admission is wider than the chunk; the keys are each width bucket up to it, final (with the
        option rows) or not (:data:`TABLE_ROWS`: a partial chunk carries no options), fresh or
        continued. Graphs already held are kept. Returns the graphs captured; raises
        :class:`AdmissionCaptureError` as an admission's capture would.
        """
        widths = widths_up_to(longest if chunk is None else min(chunk, longest), self._staging.capacity)
        kinds = ((TABLE_ROWS + option_rows, True),) if chunk is None else \
            ((TABLE_ROWS + option_rows, True), (TABLE_ROWS, False))
        keys = [(w, rows, final, continued) for w in widths for rows, final in kinds
                for continued in ((False,) if chunk is None else (False, True))]
        captured = 0
        for key in keys:
            if key not in self._graphs:
                self._graphs[key] = self._capture(*key)
                captured += 1
        return captured

    def launch(self, width: int, rows: int, final: bool, continued: bool) -> None:
        """Enqueue the admission graph of staging ``width`` and a ``[rows, B]`` table on the
        decoder's stream (capturing it first if needed). ``final``: the chunks end their prompts
        (the target writes the first tokens); ``continued``: some chunk starts past position 0.
        The staging block must already hold this admission (its upload is enqueued before)."""
        key = (width, rows, bool(final), bool(continued))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(*key)
        graph.launch(self._stream)
        self.launches += 1

    def _calls(self, width: int, rows: int, final: bool, continued: bool) -> list:
        """The admission's device work as bound calls (``call(stream)``): both models' prefill
        over the ``[B, width]`` staging (one call each, every slot's length read on the device),
        then ``admit_slots`` over the ``[rows, B]`` table. The calls hold the models and buffers,
        not this object (no cycle through a recorded program)."""
        bufs, ops, target_model, draft_model = self._bufs, self._backend.ops, self._target, self._draft
        staging = self._staging
        stage = staging.view("chunks", width)
        table = staging.view("table", staging.batch, rows)
        columns = self._option_columns.table if rows > TABLE_ROWS else None
        prompt_len, pend = staging.lengths, bufs.pend if final else None
        at = {"start": staging.starts} if continued else {}  # only chunked models continue a prompt

        def target(stream):
            target_model.prefill(stage, prompt_len, bufs.pos_ctr, pend, stream, **at)

        def draft(stream):
            draft_model.prefill(stage, prompt_len, None, None, stream, **at)

        def admit(stream):
            ops.admit_slots(table, bufs.budget, bufs.eos, bufs.acc, columns, stream=stream)

        return [target, draft, admit]

    def _capture(self, width: int, rows: int, final: bool, continued: bool):
        calls = self._calls(width, rows, final, continued)
        self.captures += 1
        if not self._backend.is_gpu:
            return _Recorded(calls)
        try:
            return self._stream_capture(calls)
        except Exception as exc:  # noqa: BLE001 - reported as what it is, with the cause chained
            raise AdmissionCaptureError(f"admission graph capture failed (width {width}, {rows} table rows): "
                                        f"{type(exc).__name__}: {exc}") from exc

    def _stream_capture(self, calls: list):
        """``calls`` captured on this object's stream into an uploaded CUDA graph."""
        from ...kernels import cuda_ops  # the CUDA module is imported only on a GPU backend

        backend = self._backend
        rt = backend.xp.cuda.runtime
        stream = self._capture_stream
        with backend.device():
            cuda_ops.warm_up(backend.device_id)  # no module load inside the capture
            with COLLECTOR_PAUSE:
                # Thread-local: a serving process's other threads may use CUDA meanwhile, and an
                # allocation in this thread still fails the capture (none belongs in it).
                stream.begin_capture(mode=rt.streamCaptureModeThreadLocal)
                try:
                    for call in calls:
                        call(stream)
                except Exception:
                    try:
                        stream.end_capture()  # returns the stream to normal use; the partial graph is dropped
                    except Exception:  # noqa: BLE001 - the capture's own error is the one to report
                        pass
                    raise
                graph = stream.end_capture()
            graph.upload(self._stream)
        return graph

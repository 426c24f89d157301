"""Capture a whole M-round burst into one CUDA graph; replay it once per burst.

Lifecycle (docs/capture.md has the diagram): warm every kernel up, capture the
decoder's burst program on its stream in a strict mode (an allocation or host sync in
the region fails the capture), upload, then ``replay()`` = one graph launch and
``drain()`` = the one host sync. Every graph ends with one device-to-host copy of the
ring and accept counters into pinned memory, so draining is an event wait plus host
work. With ``gapless=True`` two graphs (``depth`` of them) differ only in the pinned
buffer that copy fills, so burst n+1 can be enqueued before burst n is read. On the numpy backend
"capture" records the same bound calls into a :class:`RecordedProgram`, which has a
CUDA graph's face (``upload``, ``launch``), so replay has one path and CI exercises the
same ordering and baking logic.
"""

from __future__ import annotations

import functools
from collections import deque

import numpy as np

from .buffers import PtrTable, StreamBufs, split_out_block
from .burst_tokens import BurstTokens, split_ring
from .engine.program import Call, assemble_call, epilogue_call, seed_call, separate_tail_calls
from .engine.decoder import SpecDecoder
from .constants import EXIT_WORDS, MAX_DEPTH
from .engine import conditional
from .engine.collector import COLLECTOR_PAUSE
from .engine.round_exit import rounds_and_reason
from .guard import AddressGuard, StaleGraphError
from .protocol import hook
from .engine.torch_capture import TorchCapturer, capture_api, graph_node_count, probe_while
from .validate import check_int

CAPTURE_MODES = ("global", "thread_local")
__all__ = ["BurstGraph", "CaptureError", "StaleGraphError", "CAPTURE_MODES"]


class CaptureError(RuntimeError):
    """Capture failed; the stream was taken out of capture and stays usable."""


@functools.cache
def _warm_up(device_id: int) -> None:
    """Compile and load every library kernel, and launch each bookkeeping kernel once on
    scratch buffers, outside any capture (a first launch may still do lazy work).

    Models are not run here: protocol v1 asks a model to have its own kernels loaded
    before the first capture (docs/models.md).
    """
    from .kernels import cuda_ops
    from .backend import Backend

    cuda_ops.warm_up(device_id)
    backend = Backend("cupy", device_id)
    bufs = StreamBufs(1, 1, 1, backend)  # budget 0: the scratch round commits nothing
    stream = backend.new_stream()
    table = PtrTable([bufs.pos_ctr], backend, stream=stream)  # [1] uint64: rollback writes pos_ctr only
    backend.order_after_current(stream)  # the scratch buffers were zero-filled on the current stream
    ops = backend.ops
    calls = [seed_call(ops, bufs, reset_ring=True), assemble_call(ops, bufs), *separate_tail_calls(ops, bufs, table),
             epilogue_call(ops, bufs, table)]
    with backend.device():
        for call in calls:
            call(stream)
        stream.synchronize()


class RecordedProgram:
    """A burst program recorded on the numpy backend, with a CUDA graph's face.

    Parameters
    ----------
    calls : list of Call
        Bound calls in stream order; ``launch`` re-runs them.
    """

    def __init__(self, calls: list[Call]):
        self.calls = list(calls)

    def upload(self, stream) -> None:
        """Nothing to upload: the calls run on the host."""

    def launch(self, stream) -> None:
        for call in self.calls:
            call(stream)


class LoopProgram:
    """A device-exit burst recorded on the numpy backend: the head, then the body while the
    condition it ends with holds (the WHILE node's semantics), then the tail."""

    def __init__(self, head: list[Call], body: list[Call], tail: list[Call], round_exit):
        self.head, self.body, self.tail, self.round_exit = list(head), list(body), list(tail), round_exit

    def upload(self, stream) -> None:
        """Nothing to upload: the calls run on the host."""

    def launch(self, stream) -> None:
        for call in self.head:
            call(stream)
        while self.round_exit.go(stream):
            for call in self.body:
                call(stream)
        for call in self.tail:
            call(stream)

    def __len__(self) -> int:
        return len(self.head) + 1 + len(self.tail)


DEVICE_EXIT_CHOICES = (False, True, "auto")


def ladder_rungs(m_max: int) -> tuple[int, ...]:
    """The burst lengths of a ladder up to ``m_max``: 1, 2, 4, ... below it, then ``m_max`` itself."""
    rungs, r = [], 1
    while r < m_max:
        rungs.append(r)
        r *= 2
    return (*rungs, m_max)


def device_exit_refusal(decoder: SpecDecoder) -> tuple[str | None, str]:
    """(why a device-exit burst graph cannot be built for ``decoder``, or None; what the probe found).

    The numpy backend always can (its loop runs on the host). On cupy :func:`conditional.probe`
    decides, and for torch models also :func:`_torch_probe` (torch must own the capture, and the
    WHILE body's temporaries must come from the graph's pool).
    """
    if not decoder.backend.is_gpu:
        return None, "numpy backend: the loop runs on the host"
    ok, found = conditional.probe(decoder.backend.device_id)
    if ok and capture_api(decoder.target, decoder.draft) == "torch":
        ok, torch_found = _torch_probe(decoder.backend.device_id)
        found = f"{found}; torch: {torch_found}"
    return (None if ok else found), found


@functools.cache
def _torch_probe(device_id: int) -> tuple[bool, str]:
    """(whether torch models can run in a WHILE body here, what was found): cached per device
    (:func:`graphburst.engine.torch_capture.probe_while`)."""
    found = probe_while(device_id)
    if found["ok"]:
        return True, "a torch op in a trial WHILE body ran 3 rounds with its temporaries in the graph's pool"
    return False, found["why"]


class HostEvent:
    """Stand-in for a CUDA event on the numpy backend: host work is already done."""

    def record(self, stream=None) -> None:
        """Nothing to mark: the stream has no queue."""

    def synchronize(self) -> None:
        """Nothing to wait for."""


def _capture_failed(call, exc: Exception):
    """Raise CaptureError naming the call that failed (the stream is already out of capture)."""
    where = call.name if call is not None else "start"
    raise CaptureError(f"capture failed in {where}: {type(exc).__name__}: {exc}") from exc


def _warm_up_models(dec: SpecDecoder, stream=None) -> None:
    """Run the decoder's burst program once eagerly, then restore every buffer it wrote.

    Torch models do lazy work on a first call (library handles, kernel selection) that
    must not happen inside a capture. Running the real program once does it without a
    scratch model. The burst writes only the StreamBufs, KV lengths and KV entries at or
    above each layer's length, which no one reads (protocol rule 1), so restoring the
    buffers and lengths leaves the sequences exactly as they were.

    ``stream``: where to run it (default the decoder's): a device-exit burst's WHILE body runs the
    rounds on a stream of its own, where torch's per-stream state (cuBLAS's workspace) is made too.
    """
    bufs = dec.bufs
    if stream is None:
        stream = dec.stream
    else:
        dec.stream.synchronize()  # the buffers were last written there
    arrays = [bufs.out_block] + [getattr(bufs, n) for n in bufs.LAYOUT if n not in bufs.OUTPUTS]
    arrays += [layer.length for m in (dec.target, dec.draft) for layer in m.cache.layers if layer is not None]
    with dec.backend.device(), stream:
        saved = [a.copy() for a in arrays]
        bufs.budget[...] = 0  # nothing commits: each round writes at most k + 2 rows past a length
    try:
        for call in dec.burst_calls():
            call(stream)
    finally:
        with dec.backend.device(), stream:
            for a, s in zip(arrays, saved):
                a[...] = s
    stream.synchronize()


def _abort_capture(stream) -> None:
    # Ending the capture is what returns the stream to normal use; the half-built graph
    # (or the error saying it was invalidated) is discarded.
    try:
        stream.end_capture()
    except Exception:  # noqa: BLE001 - the original capture error is the one to report
        pass


class BurstGraph:
    """One captured M-round burst of a :class:`SpecDecoder`, replayed per burst.

    Parameters
    ----------
    decoder : SpecDecoder
        Its buffers, tables and models are baked in; they must not be reallocated
        while this graph lives (the address guard raises if they are).
    gapless : bool
        Capture two graphs whose final copy fills alternating pinned buffers, so the
        host may enqueue the next burst before reading this one.
    depth : int, optional
        With ``gapless``: how many bursts may be in flight, i.e. graphs in rotation, each
        with its own pinned output block (2 to ``MAX_DEPTH``; default 2). A deeper queue
        lets the host spend longer between drains (admitting requests, say) before the
        GPU runs out of work.
    capture_mode : {"global", "thread_local"}
        Strict capture modes: an allocation or host sync in the region fails capture.
    device_exit : {False, True, "auto"}
        Run the rounds in a conditional WHILE node that goes on only while fewer than
        ``m_rounds`` (``M_max``) have run, some slot has budget left and no stop was requested
        (:meth:`request_stop`; :mod:`graphburst.engine.round_exit`), so a burst may end after
        r < M rounds, leaving exactly an r-round burst's state; ``drain`` reports r
        (:attr:`last_rounds`, ``tokens.rounds``). True raises ValueError where that graph
        cannot be built (torch models; no cuda-python, an old driver, a failed probe); "auto"
        captures the fixed-M graph there instead. :attr:`device_exit` says which was captured,
        :attr:`device_exit_probe` what the probe found.
    hold_stops : bool
        With ``device_exit``: a stop request stays pending past the end of the burst it ends, so
        every burst launched before :meth:`answer_stop` runs zero rounds, however many are queued
        (a serving loop answers with the admission it asked for). Without it the end of a burst
        answers every request made before it.
    ladder : bool
        Where the burst is not a device-exit one (``device_exit`` False, or "auto" where the WHILE
        graph cannot be built): capture one fixed-length graph per rung of :func:`ladder_rungs`
        (M = 1, 2, 4, ..., ``m_rounds``) for each graph in rotation, so :meth:`replay` may launch a
        burst of fewer rounds (``rounds``) where the host wants the next boundary sooner. The rungs
        share the buffers and the pinned output blocks; :attr:`rungs` lists them.
    """

    def __init__(self, decoder: SpecDecoder, *, gapless: bool = False, depth: int | None = None,
                 capture_mode: str = "global", device_exit: bool | str = False, hold_stops: bool = False,
                 ladder: bool = False):
        if not isinstance(decoder, SpecDecoder):
            raise TypeError(f"decoder must be a SpecDecoder, got {type(decoder).__name__}")
        if depth is not None:
            if not gapless:
                raise ValueError(f"depth={depth!r} needs gapless=True: without it one burst is in flight")
            depth = check_int("depth", depth, minimum=2, maximum=MAX_DEPTH)
        if capture_mode not in CAPTURE_MODES:
            raise ValueError(f"capture_mode must be one of {CAPTURE_MODES}, got {capture_mode!r}")
        self.dec = decoder
        self.backend = decoder.backend
        self.gapless = bool(gapless)
        self.capture_mode = capture_mode
        # bursts that may be in flight, each graph with its own pinned output block and event
        self.n_graphs = (depth or 2) if self.gapless else 1
        # Torch models need torch to own the capture (docs/capture.md); numpy records either way.
        self.capture_api = capture_api(decoder.target, decoder.draft)
        self._torch = None
        if self.backend.is_gpu and self.capture_api == "torch":
            if decoder.torch_stream is None:
                raise ValueError("torch models need the decoder's torch stream; build the SpecDecoder with them")
            self._torch = TorchCapturer(decoder.torch_stream)  # one graph pool for both gapless graphs
        if not any(device_exit is c for c in DEVICE_EXIT_CHOICES):
            raise ValueError(f"device_exit must be one of {DEVICE_EXIT_CHOICES}, got {device_exit!r}")
        self.device_exit, self.device_exit_probe = False, None
        if device_exit is not False:
            refusal, self.device_exit_probe = device_exit_refusal(decoder)
            if refusal is not None and device_exit is True:
                raise ValueError(f"device_exit=True is not available here: {refusal}")
            self.device_exit = refusal is None
        if not isinstance(hold_stops, (bool, np.bool_)):
            raise TypeError(f"hold_stops must be a bool, got {type(hold_stops).__name__} {hold_stops!r}")
        if hold_stops and device_exit is False:
            raise ValueError("hold_stops=True needs device_exit=True or 'auto': a fixed-M burst reads no stop request")
        self.hold_stops = bool(hold_stops) and self.device_exit
        if not isinstance(ladder, (bool, np.bool_)):
            raise TypeError(f"ladder must be a bool, got {type(ladder).__name__} {ladder!r}")
        if ladder and device_exit is True:
            raise ValueError("ladder=True stands in for a device-exit burst where none can be built; with "
                             "device_exit=True there is nothing for it to stand in for")
        #: the ladder's burst lengths (one fixed length, m_rounds, without a ladder)
        self.ladder = bool(ladder) and not self.device_exit
        self.rungs = ladder_rungs(decoder.m_rounds) if self.ladder else (decoder.m_rounds,)
        self.last_rounds = None  # rounds the last drained burst ran
        self.last_exit_reason = None  # why a device-exit burst ended: "m_max", "idle" or "flag"
        bufs = decoder.bufs
        # Pinned copies of bufs.out_block ([B*R + 4B] int32), one per graph, viewed as
        # (ring, acc, pos_ctr, budget).
        self._host_blocks = [self.backend.host_buffer(bufs.out_block.shape) for _ in range(self.n_graphs)]
        self._host_views = [split_out_block(h, bufs.output_shapes) for h in self._host_blocks]
        self._host_addrs = [h.ctypes.data for h in self._host_blocks]  # for the decoder's C drain (host_ops.c)
        self.last_acc = np.zeros((decoder.batch, 2), np.int32)  # accept counters as of the last drained burst
        self._events = [self._new_event() for _ in range(self.n_graphs)]
        if self.device_exit:
            self.round_exit = decoder.round_exit
            # Pinned copies of the loop state ([EXIT_WORDS] int32: rounds, go, ack, reason), one per graph
            self._host_exit = [self.backend.host_buffer((EXIT_WORDS,)) for _ in range(self.n_graphs)]
            # The stream the WHILE body is captured on (capture only: the body runs in the graph)
            self._body_stream = self.backend.new_stream()
        self._pending: deque[int] = deque()  # the graph in rotation of each burst in flight, oldest first
        self._pending_rounds: deque[int] = deque()  # and its rounds (a ladder's rung)
        self._next_graph = 0
        self.captures = 0
        self.capture()

    # ------------------------------------------------------------------ capture

    def _new_event(self):
        if self.backend.is_gpu:
            with self.backend.device():
                return self.backend.xp.cuda.Event(disable_timing=True)
        return HostEvent()

    def _program(self, graph_index: int, rounds: int | None = None) -> list[Call]:
        return self.dec.burst_calls(rounds) + [self._outputs_call(graph_index)]

    def _outputs_call(self, graph_index: int) -> Call:
        copy = functools.partial(self.backend.copy_to_host, self._host_blocks[graph_index], self.dec.bufs.out_block)
        return Call("outputs_to_host", copy)

    def _tail(self, graph_index: int) -> list[Call]:
        """A device-exit graph's copies to the host: the output block, then the loop state."""
        copy = functools.partial(self.backend.copy_to_host, self._host_exit[graph_index], self.round_exit.state)
        return [self._outputs_call(graph_index), Call("exit_state_to_host", copy)]

    def _while_parts(self, graph_index: int):
        """``parts(handle) -> (head, body, tail)`` of graph ``graph_index``'s device-exit burst."""
        tail = self._tail(graph_index)

        def parts(handle: int):
            head, body = self.dec.device_exit_calls(handle=handle, hold=self.hold_stops)
            return head, body, tail

        return parts

    def _while_capture(self, graph_index: int):
        """Capture a device-exit burst: head, a WHILE node over one round, tail (conditional.py)."""
        rt = self.backend.xp.cuda.runtime
        mode = rt.streamCaptureModeGlobal if self.capture_mode == "global" else rt.streamCaptureModeThreadLocal
        stream, tail = self.dec.stream, self._tail(graph_index)
        with self.backend.device():
            stream.begin_capture(mode=mode)
            call = None
            try:
                # The handle belongs to the graph being captured, so the calls that name it are bound
                # here; binding them is Python work only (partials over fixed buffers).
                handle = conditional.create_handle(stream)
                head, body = self.dec.device_exit_calls(handle=int(handle), hold=self.hold_stops)
                for call in head:
                    call(stream)
                call = None
                conditional.capture_while(stream, self._body_stream, handle, body, on_error=_capture_failed)
                for call in tail:
                    call(stream)
            except CaptureError:
                conditional.discard_capture(stream)
                raise
            except Exception as exc:  # noqa: BLE001 - reported with the failing node's name
                conditional.discard_capture(stream)
                _capture_failed(call, exc)
            return stream.end_capture()

    def _capture_one(self, graph_index: int, rounds: int | None = None):
        """Graph ``graph_index``'s program (of ``rounds`` rounds: a ladder's rung) as a graph (cupy) or a
        recorded program (numpy), uploaded."""
        if self.device_exit:
            if self.backend.is_gpu and self._torch is not None:
                with self.backend.device():
                    graph = self._torch.capture_while(self._while_parts(graph_index), self.dec.stream,
                                                      self._body_stream, _capture_failed)
            elif self.backend.is_gpu:
                graph = self._while_capture(graph_index)
            else:
                head, body = self.dec.device_exit_calls(hold=self.hold_stops)
                graph = LoopProgram(head, body, self._tail(graph_index), self.round_exit)
            with self.backend.device():
                graph.upload(self.dec.stream)
            return graph
        program = self._program(graph_index, rounds)
        if not self.backend.is_gpu:
            graph = RecordedProgram(program)
        elif self._torch is not None:
            with self.backend.device():
                graph = self._torch.capture(program, self.dec.stream, _capture_failed)
        else:
            graph = self._stream_capture(program)
        with self.backend.device():
            graph.upload(self.dec.stream)
        return graph

    def _stream_capture(self, program: list[Call]):
        rt = self.backend.xp.cuda.runtime
        mode = rt.streamCaptureModeGlobal if self.capture_mode == "global" else rt.streamCaptureModeThreadLocal
        stream = self.dec.stream
        with self.backend.device():
            stream.begin_capture(mode=mode)
            call = None
            try:
                for call in program:
                    call(stream)
            except Exception as exc:  # noqa: BLE001 - reported with the failing node's name
                _abort_capture(stream)
                _capture_failed(call, exc)
            return stream.end_capture()

    def _baked_buffers(self) -> tuple[dict, list]:
        """Getters for every buffer the program bakes in, and the objects that hold them."""
        dec = self.dec
        getters = {f"bufs.{name}": (lambda n=name: getattr(dec.bufs, n)) for name in (*dec.bufs.arrays(), "out_block")}
        getters["rollback table"] = lambda: dec.table.ptrs
        if self.device_exit:
            getters["round_exit.state"] = lambda: self.round_exit.state
        holders = [dec, dec.bufs, dec.table]
        for role in ("target", "draft"):
            model = getattr(dec, role)
            holders.append(model)
            cache = model.cache
            holders.append(cache)
            for i, layer in enumerate(cache.layers):
                if layer is None:
                    continue
                holders.append(layer)
                getters[f"{role}.cache.layers[{i}].length"] = lambda c=cache, i=i: c.layers[i].length
                getters[f"{role}.cache.layers[{i}].storage"] = lambda c=cache, i=i: c.layers[i].storage
            for name in hook(model, "graph_buffers")():
                getters[f"{role}.{name}"] = lambda m=model, n=name: hook(m, "graph_buffers")()[n]
            holders += list(hook(model, "watched")())
        return getters, [h for h in holders if hasattr(h, "watch")]

    def capture(self) -> None:
        """Warm up, then capture (or, on numpy, record) the burst program once per graph."""
        if self._pending or self.dec.outstanding:
            raise RuntimeError("drain every enqueued burst before capturing")
        if self.backend.is_gpu:
            _warm_up(self.backend.device_id)
            if self._torch is not None:
                _warm_up_models(self.dec)
                if self.device_exit:
                    _warm_up_models(self.dec, self._body_stream)
        getters, holders = self._baked_buffers()
        guard = AddressGuard(getters, holders, self.backend.address)
        with COLLECTOR_PAUSE:  # per graph in rotation, one graph per rung (_graph_of finds it)
            graphs = [self._capture_one(i, r) for i in range(self.n_graphs) for r in self.rungs]
        # Only a complete capture replaces the old graphs and their guard: after a failed
        # recapture the old guard still reports what refresh_tables() moved.
        self.guard, self._graphs = guard, graphs
        self.captures += 1

    def recapture(self) -> None:
        """Rebuild the pointer tables from the current caches and capture again."""
        self.dec.refresh_tables()
        self.capture()

    # ------------------------------------------------------------------ replay

    def replay(self, *, rounds: int | None = None, timing_events=None) -> None:
        """Launch one burst: a single graph launch, no host sync.

        Parameters
        ----------
        rounds : int, optional
            A ladder's burst length: the shortest rung of at least ``rounds`` (capped at the
            longest) is launched. None (and always without a ladder): ``m_rounds``.
        timing_events : (Event, Event), optional
            Recorded on the stream just before and after the launch, for
            measuring replay time and the GPU's idle gap between bursts.

        Raises
        ------
        StaleGraphError
            A baked buffer was reallocated or released since capture.
        CapacityError
            The burst could write past a KV cache's capacity.
        """
        rung = self.rung_for(rounds)
        self.guard.check()
        self.dec.begin_burst(max_outstanding=self.n_graphs)
        i, stream = self._next_graph, self.dec.stream
        if timing_events is not None:
            timing_events[0].record(stream)
        self._graph_of(i, rung).launch(stream)
        if timing_events is not None:
            timing_events[1].record(stream)
        self._events[i].record(stream)
        self._pending.append(i)
        self._pending_rounds.append(rung)
        self._next_graph = (i + 1) % self.n_graphs

    def drain(self) -> BurstTokens:
        """Committed tokens of the oldest undrained burst, per sequence (the one host sync).

        With ``gapless`` this waits on that burst's event only, so a burst enqueued
        after it keeps the GPU busy meanwhile.
        """
        if not self._pending:
            raise RuntimeError("no burst to drain: replay() first")
        i, rung = self._pending.popleft(), self._pending_rounds.popleft()
        self._events[i].synchronize()
        if self.device_exit:
            self.last_rounds, self.last_exit_reason = rounds_and_reason(self._host_exit[i])
        else:
            self.last_rounds = rung
        # Read now: the next launch of graph i rewrites its block.
        if self.dec.host_mirror is not None:  # in one C call (host_ops.c)
            tokens = self.dec.finish_block(self._host_addrs[i])
            self.last_acc = tokens.acc
        else:
            ring, acc, pos, budget = self._host_views[i]
            tokens = split_ring(ring)
            self.last_acc = acc.copy()
            self.dec.finish_burst(tokens, mirror=(pos, budget))
        if self.device_exit or self.ladder:
            tokens.rounds = self.last_rounds
        return tokens

    def rung_for(self, rounds: int | None) -> int:
        """The rung :meth:`replay` launches for ``rounds``: the shortest of at least ``rounds``, capped at the
        longest (``m_rounds``); None, or a graph without a ladder: ``m_rounds``."""
        if rounds is None or not self.ladder:
            return self.dec.m_rounds
        for rung in self.rungs:
            if rung >= rounds:
                return rung
        return self.rungs[-1]

    @property
    def rounds_in_flight(self) -> int:
        """Rounds of the bursts launched and not yet drained (at most; a device-exit burst may run fewer)."""
        return sum(self._pending_rounds)

    def _graph_of(self, graph_index: int, rounds: int):
        """The captured graph of rotation slot ``graph_index`` and burst length ``rounds`` (a rung)."""
        return self._graphs[graph_index * len(self.rungs) + self.rungs.index(rounds)]

    def request_stop(self) -> None:
        """End the device-exit burst in flight at its next round boundary (or make the next one run
        zero rounds): :meth:`SpecDecoder.request_stop`. One store to mapped host memory."""
        if not self.device_exit:
            raise RuntimeError("request_stop needs a device-exit graph (BurstGraph(..., device_exit=True))")
        self.dec.request_stop()

    def answer_stop(self) -> None:
        """With ``hold_stops``: answer the stop requests made so far, in stream order behind what is
        enqueued now (:meth:`SpecDecoder.answer_stop`)."""
        if not self.hold_stops:
            raise RuntimeError("answer_stop needs a graph that holds stops (BurstGraph(..., device_exit=True, "
                               "hold_stops=True))")
        self.dec.answer_stop()

    def run(self) -> BurstTokens:
        """Replay one burst and drain it."""
        self.replay()
        return self.drain()

    # ------------------------------------------------------------------ introspection

    @property
    def nodes_per_round(self) -> int:
        """Kernel launches one round enqueues (one graph node each; with ``device_exit`` the WHILE
        body's nodes, the condition included)."""
        return len(self.dec.round_calls(first_round=False)) + (1 if self.device_exit else 0)

    @property
    def nodes_total(self) -> int:
        """Nodes of one burst graph, counted from what the program launches (with ``device_exit``:
        the top level, the WHILE node counting one)."""
        if self.device_exit:
            return len(self.dec.device_exit_calls()[0]) + 1 + len(self._tail(0))
        return len(self._program(0))

    host_syncs_per_burst = 1

    @property
    def nbytes(self) -> int:
        """Bytes of the device buffers baked into the graph, plus the pinned host copies."""
        return self.guard.nbytes + sum(int(h.nbytes) for h in self._host_blocks)

    def graph_node_count(self) -> int | None:
        """Node count read back from the CUDA graph (None without cuda.bindings or on numpy)."""
        if not self.backend.is_gpu:
            return None
        graph = self._graph_of(0, self.dec.m_rounds)
        if self._torch is not None:
            return graph.node_count()
        return graph_node_count(graph.graph)

    def info(self) -> dict:
        """Counts a user checks before adopting the graph."""
        return {
            "backend": self.backend.name,
            "capture_api": self.capture_api,
            "m_rounds": self.dec.m_rounds,
            "k": self.dec.k,
            "batch": self.dec.batch,
            "nodes_per_round": self.nodes_per_round,
            "nodes_total": self.nodes_total,
            "graph_nodes_confirmed": self.graph_node_count(),
            "host_syncs_per_burst": self.host_syncs_per_burst,
            "buffer_bytes": self.nbytes,
            "gapless": self.gapless,
            "depth": self.n_graphs,
            "captures": self.captures,
            "device_exit": self.device_exit,
            "device_exit_probe": self.device_exit_probe,
            "ladder": list(self.rungs) if self.ladder else None,
        }

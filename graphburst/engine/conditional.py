"""A conditional WHILE node inside a CuPy stream capture, through cuda.bindings, and its probe.

CuPy has no public conditional-node API, so a device-exit burst graph is built as NVIDIA
NeMo builds its decoding loops (``../shared/notes/cupy-graphs.md`` has the recipe that ran on
the H200). With the decoder's stream capturing:

1. ``cudaStreamGetCaptureInfo`` gives the graph being captured;
   ``cudaGraphConditionalHandleCreate`` makes the loop's handle in it;
2. the head (the burst's seed and the first condition, which sets the handle) is enqueued;
3. the body (one round and the condition after it) is captured once on a second stream into
   a graph of its own and destroyed: a call that cannot be captured fails there, before the
   main graph holds a WHILE node (ending a capture whose WHILE body failed crashes the driver);
   ``cudaStreamGetCaptureInfo`` again gives the capture's current dependencies;
   ``cudaGraphAddNode`` adds a WHILE node after them; ``cudaStreamUpdateCaptureDependencies``
   makes the node the stream's only dependency, so what follows runs after the loop;
4. ``cudaStreamBeginCaptureToGraph`` captures the second stream into the node's body graph,
   where the body is enqueued again; ``cudaStreamEndCapture`` ends it;
5. the tail (copies to the host) is enqueued on the main stream and CuPy ends the capture.

cuda.bindings is imported lazily: it is on GPU images, not on every machine. Its signatures
moved between 12.x and 13.x (edge data joined several calls), so the calls here accept both.
"""

from __future__ import annotations

import contextlib
import functools

from .collector import COLLECTOR_PAUSE

#: the driver and cuda.bindings versions conditional WHILE nodes with the runtime's
#: ``cudaGraphAddNode`` and ``cudaStreamBeginCaptureToGraph`` need (CUDA 12.4)
MIN_CUDA_VERSION = 12040


class ConditionalUnavailable(RuntimeError):
    """Conditional WHILE nodes cannot be built here; the message says what was missing."""


def _cudart():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as exc:
        raise ConditionalUnavailable(f"cuda-python (cuda.bindings) is not installed ({exc})") from exc
    return cudart


def _ok(result, what: str):
    """The values of a cuda.bindings call after its error code; raises ConditionalUnavailable on an error."""
    if not isinstance(result, tuple):
        result = (result,)
    err = result[0]
    if int(err) != 0:
        raise ConditionalUnavailable(f"{what} failed: {err}")
    rest = result[1:]
    return rest[0] if len(rest) == 1 else rest


def _stream(cudart, stream):
    return cudart.cudaStream_t(init_value=int(stream.ptr))


def capture_info(cudart, stream) -> tuple:
    """(graph, dependencies) of the capture under way on ``stream`` (12.x: 6 values, 13.x: 7)."""
    values = _ok(cudart.cudaStreamGetCaptureInfo(_stream(cudart, stream)), "cudaStreamGetCaptureInfo")
    status = values[0]
    if status != cudart.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive:
        raise ConditionalUnavailable(f"the stream is not capturing ({status})")
    graph, deps = values[2], values[3]
    return graph, list(deps or [])


def create_handle(stream):
    """A conditional handle (a ``cudaGraphConditionalHandle``; ``int()`` of it is the kernel
    argument) in the graph ``stream`` is capturing into: default 0, not reassigned at launch,
    since the head's condition kernel always sets it."""
    cudart = _cudart()
    graph, _ = capture_info(cudart, stream)
    return _ok(cudart.cudaGraphConditionalHandleCreate(graph, 0, 0), "cudaGraphConditionalHandleCreate")


def _add_node(cudart, graph, deps, params):
    try:  # 13.x: (graph, dependencies, edge data, count, params)
        return _ok(cudart.cudaGraphAddNode(graph, deps, None, len(deps), params), "cudaGraphAddNode")
    except TypeError:  # 12.x: (graph, dependencies, count, params)
        return _ok(cudart.cudaGraphAddNode(graph, deps, len(deps), params), "cudaGraphAddNode")


def _set_dependencies(cudart, stream, nodes):
    flag = cudart.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies
    s = _stream(cudart, stream)
    try:  # 13.x: (stream, dependencies, edge data, count, flags)
        _ok(cudart.cudaStreamUpdateCaptureDependencies(s, nodes, None, len(nodes), flag),
            "cudaStreamUpdateCaptureDependencies")
    except TypeError:  # 12.x: (stream, dependencies, count, flags)
        _ok(cudart.cudaStreamUpdateCaptureDependencies(s, nodes, len(nodes), flag),
            "cudaStreamUpdateCaptureDependencies")


def capture_while(stream, body_stream, handle, body, *, on_error) -> None:
    """Append to ``stream``'s capture a WHILE node on ``handle`` whose body is ``body`` (a list
    of ``Call``) captured on ``body_stream``.

    ``on_error(call, exc)`` must raise: it is called with the body's failing call (the body's
    capture is ended first; the caller ends the main capture).
    """
    cudart = _cudart()
    _trial_capture(cudart, body_stream, body, on_error)  # before the node exists: see there
    graph, deps = capture_info(cudart, stream)
    params = cudart.cudaGraphNodeParams()
    params.type = cudart.cudaGraphNodeType.cudaGraphNodeTypeConditional
    try:
        params.conditional.handle = handle
    except TypeError:  # a binding that wants its own handle type
        params.conditional.handle = cudart.cudaGraphConditionalHandle(int(handle))
    params.conditional.type = cudart.cudaGraphConditionalNodeType.cudaGraphCondTypeWhile
    params.conditional.size = 1
    node = _add_node(cudart, graph, deps, params)
    body_graph = params.conditional.phGraph_out[0]
    _set_dependencies(cudart, stream, [node])
    mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
    bs = _stream(cudart, body_stream)
    _ok(cudart.cudaStreamBeginCaptureToGraph(bs, body_graph, None, None, 0, mode), "cudaStreamBeginCaptureToGraph")
    call = None
    try:
        for call in body:
            call(body_stream)
    except Exception as exc:  # noqa: BLE001 - reported with the failing call's name
        cudart.cudaStreamEndCapture(bs)
        on_error(call, exc)
    _ok(cudart.cudaStreamEndCapture(bs), "cudaStreamEndCapture (WHILE body)")


def _trial_capture(cudart, body_stream, body, on_error) -> None:
    """Capture ``body`` once into a graph of its own on ``body_stream``, then destroy it.

    A call that cannot be captured (an allocation, a host sync) fails here, while the main
    graph holds no conditional node yet: ending a capture whose WHILE node's body capture
    failed crashes the driver (in ``cudaStreamEndCapture``), ending one without is an ordinary
    failed capture. The calls are partials over fixed buffers, so capturing them twice only
    costs host time at capture."""
    mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
    bs = _stream(cudart, body_stream)
    _ok(cudart.cudaStreamBeginCapture(bs, mode), "cudaStreamBeginCapture (WHILE body trial)")
    call = None
    try:
        for call in body:
            call(body_stream)
    except Exception as exc:  # noqa: BLE001 - reported with the failing call's name
        _end_and_destroy(cudart, bs)
        on_error(call, exc)
    _end_and_destroy(cudart, bs)


def _end_and_destroy(cudart, s) -> None:
    """End the capture on the raw stream ``s`` and destroy its graph, never instantiating it;
    errors are not reported (a capture's own failure is the one to report)."""
    result = cudart.cudaStreamEndCapture(s)
    err, graph = (result[0], result[1]) if isinstance(result, tuple) and len(result) > 1 else (result, None)
    if int(err) == 0 and graph is not None and int(graph) != 0:
        cudart.cudaGraphDestroy(graph)


def discard_capture(stream) -> None:
    """End the capture under way on ``stream`` (a CuPy stream) and destroy the graph it built
    without instantiating it: what a failed device-exit capture does with its main stream, which
    ending returns to normal use."""
    cudart = _cudart()
    _end_and_destroy(cudart, _stream(cudart, stream))


def versions() -> dict:
    """The driver's and cuda.bindings' CUDA versions (e.g. 13000), for reports; raises
    ConditionalUnavailable without cuda.bindings."""
    cudart = _cudart()
    driver = int(_ok(cudart.cudaDriverGetVersion(), "cudaDriverGetVersion"))
    runtime = int(_ok(cudart.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion"))
    return {"driver": driver, "bindings_runtime": runtime}


@functools.cache
def probe(device_id: int) -> tuple[bool, str]:
    """Whether a device-exit burst graph can be built on this device: ``(True, what was found)``
    or ``(False, what was missing)``. Cached per device.

    It checks that cuda.bindings imports; that the driver and the bindings are CUDA 12.4 or
    newer; that the condition kernel (``round_exit.cu``) compiles and loads; that a stop flag
    (mapped pinned memory) can be made; and, last, builds and runs a real WHILE graph under a
    CuPy capture, with the same builder and kernel as a burst, over a 3-round budget, and
    checks the loop ran 3 rounds, then 0 rounds with a stop request pending.
    """
    try:
        found = versions()
        for name, v in found.items():
            if v < MIN_CUDA_VERSION:
                return False, f"{name} CUDA version {v} is older than {MIN_CUDA_VERSION} (conditional WHILE nodes)"
        rounds, variant = _trial(device_id)
    except ConditionalUnavailable as exc:
        return False, str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure of the trial is a reason to refuse, reported whole
        return False, f"{type(exc).__name__}: {exc}"
    if rounds != (3, 0):
        return False, f"the trial WHILE graph ran {rounds} rounds, expected (3, 0)"
    return True, (f"driver {found['driver']}, cuda.bindings {found['bindings_runtime']}, condition kernel compiled "
                  f"({variant}), trial WHILE graph ran 3 rounds, then 0 with a stop pending")


def _trial(device_id: int) -> tuple[tuple[int, int], str]:
    """Build, launch and read a WHILE graph of the condition kernel alone (see :func:`probe`)."""
    import cupy

    from ..backend import Backend
    from ..buffers import StreamBufs
    from ..constants import EXIT_ROUNDS
    from ..kernels import round_exit_cuda
    from .round_exit import RoundExit

    backend = Backend("cupy", device_id)
    variant = round_exit_cuda.warm_up(device_id)
    stream, body_stream = backend.new_stream(), backend.new_stream()
    bufs = StreamBufs(1, 1, 3, backend)  # M_max = 3
    backend.order_after_current(stream)  # the buffers were zeroed on the current stream
    with backend.device(), stream:
        bufs.budget[...] = 1000  # a slot with budget: only M_max ends the loop
    rx = RoundExit(bufs, backend, stream)

    def failed(call, exc):
        raise ConditionalUnavailable(f"the trial body failed in {getattr(call, 'name', 'start')}: {exc}") from exc

    with backend.device(), COLLECTOR_PAUSE:
        stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeGlobal)
        try:
            handle = create_handle(stream)
            rx.call(begin=True, handle=int(handle))(stream)
            capture_while(stream, body_stream, handle, [rx.call(begin=False, handle=int(handle))], on_error=failed)
        except Exception:
            with contextlib.suppress(Exception):  # the first error is the one to report
                stream.end_capture()
            raise
        graph = stream.end_capture()
        graph.upload(stream)
        graph.launch(stream)
        first = int(rx.read(stream)[EXIT_ROUNDS])
        rx.request_stop()
        graph.launch(stream)
        second = int(rx.read(stream)[EXIT_ROUNDS])
    return (first, second), variant

"""Torch-driven capture of a burst program, for models that run torch ops.

When either model declares ``capture_api = "torch"``, torch must own the capture:

* torch's caching allocator then hands the model's temporaries out of the graph's
  private memory pool. Under a CuPy-driven capture it hands out ordinary blocks, which
  torch may give to unrelated work after capture while the graph still writes them.
* graphburst's CuPy kernels are launched on the same CUDA stream (the decoder's stream
  is a ``cupy.cuda.ExternalStream`` over the torch stream), so they land in the same
  graph, in program order.

``torch.cuda.CUDAGraph.replay()`` launches on torch's *current* stream, so every launch
here names the decoder's torch stream explicitly: replay and drain must share a stream
(``../shared/notes/torch-in-the-burst.md`` records the wrong tokens seen otherwise).
"""

from __future__ import annotations

from ..protocol import hook


def capture_api(target, draft) -> str:
    """``"torch"`` when either model runs torch ops, else ``"cupy"`` (``check_pair`` has
    already rejected any other value)."""
    return "torch" if "torch" in (hook(target, "capture_api"), hook(draft, "capture_api")) else "cupy"


def stream_pair(backend, stream=None):
    """A (cupy stream, torch stream) pair over one CUDA stream of ``backend``'s device.

    With no ``stream`` a new torch stream is made and wrapped for CuPy (the order seen
    to work on the H200); a caller's CuPy stream is wrapped for torch instead.
    """
    import torch

    device = torch.device("cuda", backend.device_id)
    if stream is None:
        ts = torch.cuda.Stream(device=device)
        return _cupy_view(backend, ts), ts
    return stream, torch.cuda.ExternalStream(stream.ptr, device=device)


def _cupy_view(backend, ts):
    """CuPy's handle on a torch stream: ``Stream.from_external`` (the CUDA stream protocol)
    where CuPy has it, else the older ``ExternalStream`` over the raw handle."""
    from_external = getattr(backend.xp.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(ts, "__cuda_stream__"):
        return from_external(ts)
    return backend.xp.cuda.ExternalStream(ts.cuda_stream, backend.device_id)


def graph_node_count(handle: int) -> int | None:
    """Nodes of the CUDA graph ``handle`` (a ``cudaGraph_t`` as an int), through cuda.bindings.

    Returns None when cuda.bindings is not installed (the count is informational).
    """
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return None
    err, _, count = cudart.cudaGraphGetNodes(cudart.cudaGraph_t(init_value=int(handle)), 0)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaGraphGetNodes failed: {err}")
    return int(count)


class TorchGraph:
    """A captured burst as a ``torch.cuda.CUDAGraph``, with a CuPy graph's face.

    Parameters
    ----------
    graph : torch.cuda.CUDAGraph
    torch_stream : torch.cuda.Stream
        The stream it was captured on; every replay is launched on it.
    """

    def __init__(self, graph, torch_stream):
        self.graph = graph
        self.torch_stream = torch_stream

    def upload(self, stream) -> None:
        """Instantiate now, so the first replay costs what every later one does."""
        self.graph.instantiate()

    def launch(self, stream) -> None:
        import torch

        with torch.cuda.stream(self.torch_stream):
            self.graph.replay()

    def node_count(self) -> int | None:
        """Nodes of the captured graph, read back through cuda.bindings (None if unavailable)."""
        return graph_node_count(self.graph.raw_cuda_graph())


class TorchCapturer:
    """Captures programs with torch; gapless mode's graphs share one memory pool.

    Parameters
    ----------
    torch_stream : torch.cuda.Stream
        The decoder's stream as torch sees it.
    """

    def __init__(self, torch_stream):
        import torch

        self.torch_stream = torch_stream
        self.pool = torch.cuda.graph_pool_handle()  # one pool for every graph of this BurstGraph

    def capture(self, program, stream, on_error) -> TorchGraph:
        """Capture ``program`` (a list of ``Call``) on ``stream``; ``on_error(call, exc)`` must raise."""
        import torch

        graph = torch.cuda.CUDAGraph(keep_graph=True)  # keep_graph: raw_cuda_graph() for node counts
        # Capture outside the ``torch.cuda.graph`` context manager: if its capture_end
        # raises, it never restores the current stream. Here both always unwind.
        torch.cuda.synchronize(self.torch_stream.device)
        call = None
        with torch.cuda.stream(self.torch_stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="global")
            try:
                for call in program:
                    call(stream)
                graph.capture_end()  # an invalidated capture raises here, and is reported the same way
            except Exception as exc:  # noqa: BLE001 - re-raised by on_error with the node's name
                end_capture_quietly(graph, self.torch_stream.device)
                on_error(call, exc)
        return TorchGraph(graph, self.torch_stream)

    def capture_while(self, parts, stream, body_stream, on_error) -> TorchGraph:
        """Capture a device-exit burst under torch: ``parts(handle) -> (head, body, tail)``, the body
        in a conditional WHILE node (:func:`conditional.capture_while`) captured on ``body_stream``.

        Torch's allocator serves a capture's temporaries from the graph's pool only on streams its
        filter names: the capturing stream's capture, which the body's capture is not. From the head
        on, this thread's allocations go to the pool instead (:func:`thread_to_pool`), the body's
        included, so its temporaries belong to the graph as the rest of the burst's do.
        """
        import torch

        from . import conditional

        graph = torch.cuda.CUDAGraph(keep_graph=True)
        device = self.torch_stream.device
        torch.cuda.synchronize(device)
        call = None
        with torch.cuda.stream(self.torch_stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="global")
            routed = False
            try:
                handle = conditional.create_handle(stream)
                head, body, tail = parts(int(handle))
                for call in head:
                    call(stream)
                call = None
                thread_to_pool(device, self.pool)
                routed = True
                conditional.capture_while(stream, body_stream, handle, body, on_error=on_error)
                for call in tail:
                    call(stream)
                graph.capture_end()  # ends this thread's routing too: it is the pool's one entry now
            except Exception as exc:  # noqa: BLE001 - re-raised by on_error with the node's name
                end_capture_quietly(graph, device)
                if routed:
                    end_routing(device, self.pool)
                on_error(call, exc)
            finally:
                if routed:
                    release_extra_use(device, self.pool)
        return TorchGraph(graph, self.torch_stream)


def thread_to_pool(device, pool) -> None:
    """Send every allocation of this thread to ``pool`` from now on, in place of the capture's own
    stream filter: torch may refuse a second filter on one pool, so the capture's is ended first (its capture
    stream is on this thread, so its allocations still go to the pool). ``CUDAGraph.capture_end``
    ends the thread's filter, the pool's one entry then. Torch's conditional-node support swaps its
    filter for a child stream's the same way."""
    import torch

    index = torch.device(device).index
    torch._C._cuda_endAllocateToPool(index, pool)
    torch._C._cuda_beginAllocateCurrentThreadToPool(index, pool)


def end_routing(device, pool) -> None:
    """After a failed capture: end every allocation filter of ``pool`` still in force (the
    capture's ``capture_end`` may have stopped before ending its own)."""
    import torch

    index = torch.device(device).index
    for _ in range(4):  # at most the capture's and this thread's; a bound, not a loop on an error
        try:
            torch._C._cuda_endAllocateToPool(index, pool)
        except RuntimeError:
            return


def release_extra_use(device, pool) -> None:
    """Give back the use of ``pool`` that :func:`thread_to_pool`'s begin added (torch counts a
    pool's users; the graph's reset gives back its own), so the pool is freed with its graphs."""
    import torch

    torch._C._cuda_releasePool(torch.device(device).index, pool)


def end_capture_quietly(graph, device) -> None:
    # Ending the capture returns the stream to normal use; the half-built graph, or the
    # error saying it was invalidated, is discarded. An invalidated capture makes torch's
    # capture_end raise before it ends the RNG generator's capture (capture_epilogue),
    # and every later random op then fails ("Offset increment outside graph capture
    # encountered unexpectedly"). A fresh clone of the generator's state (same seed and
    # offset, not capturing) put back with graphsafe_set_state repairs that.
    import torch

    for step in (graph.capture_end, graph.reset):
        try:
            step()
        except Exception:  # noqa: BLE001 - the original capture error is the one to report
            pass
    gen = torch.cuda.default_generators[torch.device(device).index]
    gen.graphsafe_set_state(gen.clone_state())


def probe_while(device_id: int) -> dict:
    """Whether device-exit bursts work for torch models on ``device_id``: a WHILE graph captured by
    :meth:`TorchCapturer.capture_while`, whose body runs a torch op that allocates a temporary
    (``y = x * 2; x.copy_(y)``) and the device-exit condition (3 rounds), replayed once.

    Returns ``{"ok", "x", "body_temps_in_graph_pool", "why"}``: ok when the capture worked, x is 8
    (the body ran 3 times on x = 1) and the temporary's segment is in the graph's pool (torch's
    allocator would otherwise hand that memory to other work while the graph still writes it).
    Raises nothing: a failure is the reason it reports. Run outside any capture.
    """
    out = {"ok": False, "x": None, "body_temps_in_graph_pool": None, "why": None}
    try:
        import torch

        from ..backend import Backend
        from ..buffers import StreamBufs
        from ..kernels import round_exit_cuda
        from . import conditional
        from .program import Call
        from .round_exit import RoundExit

        backend = Backend("cupy", device_id)
        round_exit_cuda.warm_up(device_id)
        cs, ts = stream_pair(backend)
        body_cs = backend.new_stream()
        dev = ts.device
        bufs = StreamBufs(1, 1, 3, backend)  # M_max = 3
        with backend.device():
            bufs.budget[...] = 1000
            backend.xp.cuda.Device(device_id).synchronize()
        rx = RoundExit(bufs, backend, cs)
        x = torch.ones(1024, device=dev)
        body_ts = torch.cuda.ExternalStream(body_cs.ptr, device=dev)
        with torch.cuda.stream(body_ts):
            _ = x * 2  # torch's lazy work on the body's stream outside the capture
        torch.cuda.synchronize(dev)
        temps = []

        def body_op(*, stream):  # a Call's function: enqueued with stream=
            with torch.cuda.stream(body_ts):
                y = x * 2  # the temporary whose pool is the question
                x.copy_(y)
                temps.append(y.data_ptr())

        def parts(handle):
            head = [rx.call(begin=True, handle=handle)]
            return head, [Call("torch_body", body_op), rx.call(begin=False, handle=handle)], []

        def failed(call, exc):
            raise RuntimeError(f"capture failed in {getattr(call, 'name', 'start')}: {exc}") from exc

        capturer = TorchCapturer(ts)
        with backend.device():
            graph = capturer.capture_while(parts, cs, body_cs, failed)
            graph.upload(cs)
            graph.launch(cs)
        torch.cuda.synchronize(dev)
        out["x"] = float(x[0].item())
        pool = list(graph.graph.pool())
        seg_pool = None
        for seg in torch.cuda.memory._snapshot()["segments"]:
            if temps and seg["address"] <= temps[-1] < seg["address"] + seg["total_size"]:
                seg_pool = list(seg.get("segment_pool_id", ()))
        out["body_temps_in_graph_pool"] = None if seg_pool is None else seg_pool == pool
        if out["x"] != 8.0:
            out["why"] = f"the trial WHILE graph's torch body left x = {out['x']}, expected 8.0 (3 rounds)"
        elif not out["body_temps_in_graph_pool"]:
            out["why"] = (f"the WHILE body's torch temporaries were served from pool {seg_pool}, not the graph's "
                          f"{pool}")
        else:
            out["ok"] = True
    except Exception as exc:  # noqa: BLE001 - any failure is the reason to refuse, reported whole
        out["why"] = f"{type(exc).__name__}: {exc}"
    return out

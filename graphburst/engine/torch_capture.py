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

"""Does torch's capture allocator serve a WHILE body's temporaries from the graph's private pool?

Device-exit bursts are refused for torch models (graphburst/engine/conditional.py,
``TORCH_REFUSAL``). This probe is the evidence for or against that refusal: under
``torch.cuda.CUDAGraph`` capture on a torch stream, it adds a conditional WHILE node with the
same builder as a device-exit burst (``conditional.capture_while``), whose body, captured on a
second torch stream, runs a torch op that allocates a temporary (``y = x * 2; x.copy_(y)``) and
the device-exit condition (3 rounds). It then replays the graph and reports, as one JSON line:

* ``capture``: "ok" or the error the capture raised;
* ``x``: x[0] after one replay (8.0 when the body ran 3 times on x = 1);
* ``temp_pool`` / ``graph_pool``: the memory pool of the segment holding the body's temporary, and
  the graph's private pool; equal only if torch's allocator served the body from the graph's pool;
* ``body_temps_in_graph_pool``: that comparison (null when it could not be made).

Run it in a process of its own (a failed capture may leave torch's allocator in capture state):

    PYTHONPATH=. python3 tools/torch_while_probe.py
"""

from __future__ import annotations

import json
import traceback


def main() -> dict:
    import cupy
    import torch

    from graphburst.backend import Backend
    from graphburst.buffers import StreamBufs
    from graphburst.engine import conditional
    from graphburst.engine.round_exit import RoundExit
    from graphburst.engine.torch_capture import end_capture_quietly
    from graphburst.kernels import round_exit_cuda

    result = {"torch": torch.__version__, "capture": None, "x": None, "temp_pool": None, "graph_pool": None,
              "body_temps_in_graph_pool": None,
              "torch_has_while_node_api": hasattr(torch.cuda.CUDAGraph, "begin_capture_to_while_loop_node")}
    backend = Backend("cupy")
    dev = torch.device("cuda", backend.device_id)
    ts, body_ts = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    cs = cupy.cuda.ExternalStream(ts.cuda_stream, backend.device_id)
    body_cs = cupy.cuda.ExternalStream(body_ts.cuda_stream, backend.device_id)
    round_exit_cuda.warm_up(backend.device_id)
    bufs = StreamBufs(1, 1, 3, backend)
    with backend.device():
        bufs.budget[...] = 1000
        cupy.cuda.Device(backend.device_id).synchronize()
    rx = RoundExit(bufs, backend, cs)
    x = torch.ones(1024, device=dev)
    _ = x * 2  # torch's lazy work outside the capture
    torch.cuda.synchronize(dev)
    temps = []

    def body_op(_stream):
        with torch.cuda.stream(body_ts):
            y = x * 2  # the temporary whose pool is the question
            x.copy_(y)
            temps.append(y.data_ptr())

    def failed(call, exc):
        raise RuntimeError(f"body failed in {getattr(call, 'name', call)}: {exc}") from exc

    pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(ts):
        graph.capture_begin(pool=pool, capture_error_mode="global")
        try:
            handle = conditional.create_handle(cs)
            rx.call(begin=True, handle=int(handle))(cs)
            body = [_Named("torch_body", body_op), rx.call(begin=False, handle=int(handle))]
            conditional.capture_while(cs, body_cs, handle, body, on_error=failed)
            graph.capture_end()
            result["capture"] = "ok"
        except Exception as exc:  # noqa: BLE001 - the finding to report
            end_capture_quietly(graph, dev)
            result["capture"] = f"{type(exc).__name__}: {exc}"
            return result
    with torch.cuda.stream(ts):
        graph.replay()
    torch.cuda.synchronize(dev)
    result["x"] = float(x[0].item())
    result["graph_pool"] = list(graph.pool())
    if temps:
        for seg in torch.cuda.memory._snapshot()["segments"]:
            if seg["address"] <= temps[0] < seg["address"] + seg["total_size"]:
                result["temp_pool"] = list(seg.get("segment_pool_id", ()))
        if result["temp_pool"] is not None:
            result["body_temps_in_graph_pool"] = result["temp_pool"] == result["graph_pool"]
    return result


class _Named:
    """A body step with a name, as ``capture_while`` reports a failing step by it."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __call__(self, stream):
        self.fn(stream)


if __name__ == "__main__":
    try:
        out = main()
    except Exception as exc:  # noqa: BLE001 - reported, not raised: this is a probe
        out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=4)}
    print("TORCH_WHILE_PROBE " + json.dumps(out))

"""Can torch models run inside a device-exit burst's WHILE body here? One JSON line.

Device-exit bursts of torch models are captured by torch, the rounds in a conditional WHILE node
whose body is captured on a second stream (``TorchCapturer.capture_while``,
graphburst/engine/torch_capture.py). Torch's allocator serves a capture's temporaries from the
graph's private pool only on the streams its filter names, so the body's capture routes this
thread's allocations to the pool. This runs the same check ``BurstGraph(..., device_exit=True)``
runs before it captures a torch pair (``torch_capture.probe_while``): a torch op that allocates in a
3-round WHILE body, replayed once. It reports

* ``ok``: the capture worked, the body ran 3 times, its temporary came from the graph's pool;
* ``x``: x[0] after the replay (8.0 when the body ran 3 times on x = 1);
* ``body_temps_in_graph_pool``: whether the temporary's segment is in the graph's pool;
* ``why``: what failed, when something did.

Run it in a process of its own (a failed capture may leave torch's allocator in capture state):

    PYTHONPATH=. python3 tools/torch_while_probe.py
"""

from __future__ import annotations

import json


def main() -> dict:
    import torch

    from graphburst.engine.torch_capture import probe_while

    return {"torch": torch.__version__, **probe_while(torch.cuda.current_device())}


if __name__ == "__main__":
    print("TORCH_WHILE_PROBE " + json.dumps(main()))

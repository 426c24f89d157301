"""Host microseconds per burst of the serving loop at B=64 on the numpy backend.

The numpy "graph" runs the model on the host, so this subtracts the time spent inside
the recorded program's launch (the stand-in for GPU work) from each ``ServeLoop.step``:
what is left is the host path a GPU would wait on (drain bookkeeping, delivery,
admission checks, launch overhead). Usage: ``python scripts/serve_host_bench.py``.
"""

from __future__ import annotations

import sys
import time

import numpy as np

sys.path.insert(0, ".")
from graphburst.bench.common import stub_models  # noqa: E402
from graphburst.capture import RecordedProgram  # noqa: E402
from graphburst.serve import Request, ServeLoop  # noqa: E402


def main(batch=64, k=4, m=8, new_tokens=2048, repeats=3) -> None:
    in_launch = [0.0]
    real_launch = RecordedProgram.launch

    def timed_launch(self, stream):
        t = time.perf_counter()
        real_launch(self, stream)
        in_launch[0] += time.perf_counter() - t

    RecordedProgram.launch = timed_launch  # measurement only: the program still runs
    try:
        best = _measure(batch, k, m, new_tokens, repeats, in_launch)
    finally:
        RecordedProgram.launch = real_launch
    print(f"host path per burst at B={batch}, k={k}, M={m} (numpy, steady state, best of {repeats}): {best:.1f} µs")


def _measure(batch, k, m, new_tokens, repeats, in_launch) -> float:
    best = None
    for _ in range(repeats):
        target, draft = stub_models(_numpy(), batch=batch, capacity=64 + new_tokens + m * (k + 1))
        loop = ServeLoop(target, draft, k=k, m_rounds=m)
        rng = np.random.default_rng(0)
        for i in range(batch):
            loop.submit(Request(rng.integers(0, 32000, 16).tolist(), new_tokens, options={"seed": i}))
        loop.step()  # admission + the first bursts: not the steady state
        in_launch[0], steps, t0 = 0.0, 0, time.perf_counter()
        while loop.active == batch:
            loop.step()
            steps += 1
        host = (time.perf_counter() - t0 - in_launch[0]) / steps * 1e6
        best = host if best is None else min(best, host)
    return best


def _numpy():
    from graphburst.backend import get_backend

    return get_backend("numpy")


if __name__ == "__main__":
    main()

"""Auto admission's coalescing limit against the old rule (a due boundary waits at most one burst),
interleaved in one process so a lease's drifting host speed falls on both alike.

The ``refill`` workload of ``scripts/admit_profile.py`` (256 requests of 16 prompt and 256 new
tokens through 64 slots of zero-cost stubs, k=4, depth 4) at each M, per repeat the old rule
then this code's (``LoopAdmission._coalesce_limit``: about as many bursts as one typical
admission's host time covers, at most depth - 1). The old rule is this code's limit capped at 1,
set for its runs by replacing the method on the class (a benchmark's switch, not a library one).
Every request must get all its tokens. Reports GPU idle, wall ms, bursts and deferred boundaries.

Usage: ``PYTHONPATH=. python scripts/coalesce_ab.py [--repeats 6] [-m 8 16 32] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

sys.path.insert(0, ".")
from graphburst.backend import get_backend  # noqa: E402
from graphburst.bench.common import VOCAB, stub_models  # noqa: E402
from graphburst.serving.admit import LoopAdmission  # noqa: E402
from graphburst.serving.loop import Request, ServeLoop  # noqa: E402

LIMIT = LoopAdmission._coalesce_limit
RULES = {"one": lambda self: min(1, LIMIT(self)), "auto": LIMIT}  # the old rule; this code's


def run(backend, m: int, rule: str, *, depth: int = 4, k: int = 4, batch: int = 64, new: int = 256) -> dict:
    LoopAdmission._coalesce_limit = RULES[rule]
    try:
        rng = np.random.default_rng(0)
        target, draft = stub_models(backend, batch=batch, capacity=64 + new + m * (k + 1))
        reqs = [Request(rng.integers(0, VOCAB, 16).tolist(), new, options={"seed": i}) for i in range(256)]
        loop = ServeLoop(target, draft, k=k, m_rounds=m, depth=depth)
        loop.submit(Request([1, 2, 3], m * (k + 1)))
        loop.run_until_idle()  # compiles kernels, captures the graph
        clock = loop.pipeline.clock
        busy0, idle0 = clock.overall.busy_ms, clock.overall.idle_ms
        states = [loop.submit(r) for r in reqs]
        t0 = time.perf_counter()
        loop.run_until_idle()
        wall = (time.perf_counter() - t0) * 1e3
    finally:
        LoopAdmission._coalesce_limit = LIMIT
    bad = [s.request.id for s in states if s.error or len(s.tokens) != new]
    assert not bad, f"requests without all their tokens: {bad[:5]}"
    busy, idle = clock.overall.busy_ms - busy0, clock.overall.idle_ms - idle0
    return {"m": m, "rule": rule, "depth": depth, "wall_ms": wall, "busy_ms": busy, "idle_ms": idle,
            "idle": idle / (busy + idle) if backend.is_gpu else None, "bursts": loop.bursts,
            "deferred": loop.deferred_boundaries}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=("auto", "cupy", "numpy"))
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("-m", type=int, nargs="+", default=[8, 16, 32], help="rounds per burst")
    p.add_argument("--json")
    a = p.parse_args(argv)
    backend = get_backend(a.backend)
    out = []
    for rep in range(a.repeats):
        for m in a.m:
            for rule in RULES:
                r = run(backend, m, rule)
                out.append(r | {"rep": rep})
                idle = "-" if r["idle"] is None else f"{100 * r['idle']:5.1f}%"
                print(f"rep {rep} M={m} {rule:4s}: idle {idle} wall {r['wall_ms']:7.2f} ms bursts {r['bursts']} "
                      f"deferred {r['deferred']}", flush=True)
    for m in a.m:
        for rule in RULES:
            rs = [r for r in out if r["m"] == m and r["rule"] == rule]
            idle = "-" if rs[0]["idle"] is None else f"{100 * np.median([r['idle'] for r in rs]):.1f}%"
            print(f"M={m} {rule}: idle median {idle}, wall median {np.median([r['wall_ms'] for r in rs]):.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

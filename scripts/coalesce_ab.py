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
import pathlib
import sys

import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import graphburst  # noqa: E402
from graphburst.serving.admit import LoopAdmission  # noqa: E402
from version_ab import run as run_workload  # noqa: E402 (the workload, shared)

LIMIT = LoopAdmission._coalesce_limit
RULES = {"one": lambda self: min(1, LIMIT(self)), "auto": LIMIT}  # the old rule; this code's


def run(backend_name: str, m: int, rule: str, *, depth: int = 4) -> dict:
    """The workload once under ``rule`` (set on the class for the run, then put back)."""
    LoopAdmission._coalesce_limit = RULES[rule]
    try:
        row = run_workload(graphburst, backend_name, m, depth)
    finally:
        LoopAdmission._coalesce_limit = LIMIT
    return {k: row[k] for k in ("m", "depth", "wall_ms", "busy_ms", "idle_ms", "idle", "bursts", "deferred")} | {
        "rule": rule}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=("auto", "cupy", "numpy"))
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("-m", type=int, nargs="+", default=[8, 16, 32], help="rounds per burst")
    p.add_argument("--json")
    a = p.parse_args(argv)
    out = []
    for rep in range(a.repeats):
        for m in a.m:
            for rule in RULES:
                r = run(a.backend, m, rule)
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

"""How fast each of this machine's CPUs runs Python right now: a fixed loop pinned to each in turn.

A benchmark whose host work per burst is close to the burst's GPU time (the zero-cost serving
workload at M=8) idles in proportion to the host's speed. On a shared cloud host a vCPU's speed
can change from one second to the next (an H200 lease, 2026-12-01: the same vCPU took 6.9, 13.2 and
7.3 ms for the same loop, one pass after another), so print this beside such figures: it tells a
slow phase of the host from a slow change of the code.

Prints one line per CPU: its id and the best of ``--tries`` timings (ms) in each of ``--passes``
passes. Linux only (``os.sched_setaffinity``); the process's own affinity is restored after.

Usage: ``python scripts/host_speed.py [--iterations 200000] [--passes 3] [--tries 3] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import time


def loop_ms(iterations: int) -> float:
    """Wall milliseconds of a fixed integer loop (the interpreter's speed, no memory traffic)."""
    t0 = time.perf_counter()
    x = 0
    for i in range(iterations):
        x += i & 7
    return (time.perf_counter() - t0) * 1e3


def probe(iterations: int = 200_000, passes: int = 3, tries: int = 3) -> dict[int, list[float]]:
    """``cpu -> [best of tries ms per pass]``, each CPU of this process's affinity in turn, pass by pass."""
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("needs os.sched_setaffinity (Linux)")
    cpus = sorted(os.sched_getaffinity(0))
    out: dict[int, list[float]] = {c: [] for c in cpus}
    try:
        for _ in range(passes):
            for c in cpus:
                os.sched_setaffinity(0, {c})
                loop_ms(iterations // 10)  # settle on the CPU
                out[c].append(min(loop_ms(iterations) for _ in range(tries)))
    finally:
        os.sched_setaffinity(0, set(cpus))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=200_000)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--tries", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args(argv)
    result = probe(a.iterations, a.passes, a.tries)
    for cpu, times in result.items():
        print(cpu, " ".join(f"{t:.2f}" for t in times))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"iterations": a.iterations, "ms": {str(c): t for c, t in result.items()}}, f, indent=1)


if __name__ == "__main__":
    main()

"""Capture-issue measurements on the GPU: address-guard cost and the idle gap between bursts.

Usage: PYTHONPATH=. python3 scripts/capture_bench.py [--json OUT.json]
Correctness is checked before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rich.console import Console
from rich.table import Table

from graphburst import SpecDecoder, greedy_reference, stub_pair
from graphburst.backend import get_backend
from graphburst.capture import BurstGraph

VOCAB = 32000


def build(backend, batch=1, k=4, m=8, bursts=2000):
    target, draft = stub_pair(batch, VOCAB, 4, 1, 64 + bursts * m * (k + 1), accept_prob=0.7, backend=backend)
    dec = SpecDecoder(target, draft, k=k, m_rounds=m)
    dec.prefill([[1, 2, 3]] * batch)
    return dec


def guard_cost_ns(graph, n=200_000) -> float:
    check = graph.guard.check
    t0 = time.perf_counter_ns()
    for _ in range(n):
        check()
    return (time.perf_counter_ns() - t0) / n


def idle_gaps_us(backend, gapless: bool, bursts: int):
    """Median GPU idle time between consecutive bursts, and median burst time (µs)."""
    xp = backend.xp
    dec = build(backend, bursts=bursts + 10)
    g = BurstGraph(dec, gapless=gapless)
    events = [(xp.cuda.Event(), xp.cuda.Event()) for _ in range(bursts)]
    out = []
    for _ in range(5):  # warm-up
        out += g.run()[0].tolist()
    if gapless:
        g.replay(timing_events=events[0])
        for i in range(1, bursts):
            g.replay(timing_events=events[i])
            out += g.drain()[0].tolist()
        out += g.drain()[0].tolist()
    else:
        for i in range(bursts):
            g.replay(timing_events=events[i])
            out += g.drain()[0].tolist()
    dec.stream.synchronize()
    assert out == greedy_reference([1, 2, 3], len(out), VOCAB), "tokens differ from the greedy reference"
    gaps = [xp.cuda.get_elapsed_time(events[i][1], events[i + 1][0]) * 1e3 for i in range(bursts - 1)]
    busy = [xp.cuda.get_elapsed_time(e0, e1) * 1e3 for e0, e1 in events]
    return statistics.median(gaps), statistics.median(busy)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="capture_bench.json")
    ap.add_argument("--bursts", type=int, default=2000)
    args = ap.parse_args()
    backend = get_backend("cupy")
    dec = build(backend)
    g = BurstGraph(dec)
    rows = {"guard_check_ns": guard_cost_ns(g)}
    for gapless in (False, True):
        gap, busy = idle_gaps_us(backend, gapless, args.bursts)
        rows[f"idle_gap_us{'_gapless' if gapless else ''}"] = gap
        rows[f"burst_us{'_gapless' if gapless else ''}"] = busy
    table = Table(title="capture measurements (B=1, k=4, M=8, zero-cost stubs; medians)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, val in rows.items():
        table.add_row(key, f"{val:.3f}")
    Console().print(table)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

"""Where the serving loop's GPU idle sits: each burst's gap, by what the host did before its launch.

The zero-cost ``refill`` workload of ``scripts/admit_profile.py`` (256 requests of 16 prompt and
256 new tokens through 64 slots of stubs, k=4) runs through one loop. Every launch is tagged with
the requests admitted since the previous one, and every drained burst's gap (from the loop's burst
clock) is added to its launch's category: **admit** (the launch right after an admitting
boundary), **after** (the launch after that one) or **plain**; the first burst of a run has no
gap. Each request must get all its tokens before a run counts. A GPU is needed for the gaps (the
numpy backend has no device clock: the runs are checked and the categories counted, no idle).

Prints one ``rich`` row per run: idle, wall, bursts, the burst's GPU time, and per category the
launches and their summed gaps (µs), with the median and p90 plain gap.

Usage: ``PYTHONPATH=. python scripts/idle_gaps.py [-m 8] [--depth 4] [--repeats 4] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, ".")
from graphburst.backend import get_backend  # noqa: E402
from graphburst.bench.common import VOCAB, stub_models  # noqa: E402
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop

CATEGORIES = ("plain", "admit", "after")


def classify(admitted: list, gaps: list) -> dict:
    """Gaps by category. ``admitted[i]``: requests admitted before launch i; ``gaps[i]``: the GPU
    idle ms before burst i (None: not counted). Returns ``{category: (launches, idle µs)}`` and the
    plain gaps' median and p90 (µs)."""
    out = {c: [0, 0.0] for c in CATEGORIES}
    plain = []
    for i in range(1, min(len(admitted), len(gaps))):
        gap = gaps[i] or 0.0
        cat = "admit" if admitted[i] else ("after" if admitted[i - 1] else "plain")
        out[cat][0] += 1
        out[cat][1] += gap * 1e3
        if cat == "plain":
            plain.append(gap * 1e3)
    result = {c: (n, round(us, 1)) for c, (n, us) in out.items()}
    result["plain_p50_us"] = round(float(np.percentile(plain, 50)), 1) if plain else None
    result["plain_p90_us"] = round(float(np.percentile(plain, 90)), 1) if plain else None
    return result


def run(backend: str, m: int, depth: int, repeats: int, requests: int = 256, batch: int = 64, new: int = 256,
        k: int = 4) -> list:
    """``repeats`` runs of the workload through one warmed loop: one result dict each."""
    be = get_backend(backend)
    target, draft = stub_models(be, batch=batch, capacity=64 + new + m * (k + 1))
    loop = ServeLoop(target, draft, k=k, m_rounds=m, depth=depth)
    loop.submit(Request([1, 2, 3], m * (k + 1)))
    loop.run_until_idle()  # compiles kernels, captures the graphs
    admitted, gaps, since = [], [], [0]
    launch, record, group = loop.pipeline.launch, loop.pipeline.clock.record, loop._prefill_group

    def tagged_launch(steady):
        admitted.append(since[0])
        since[0] = 0
        return launch(steady)

    def tagged_record(busy_ms, gap_ms, steady, admission_ms=0.0):
        gaps.append((busy_ms, gap_ms))
        return record(busy_ms, gap_ms, steady, admission_ms)

    def tagged_group(entries, final):
        since[0] += len(entries) if final else 0
        return group(entries, final)

    # instance attributes over the methods: only this loop is observed
    loop.pipeline.launch, loop.pipeline.clock.record, loop._prefill_group = tagged_launch, tagged_record, tagged_group
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(repeats):
        admitted.clear(), gaps.clear()
        states = [loop.submit(Request(rng.integers(0, VOCAB, 16).tolist(), new, options={"seed": i}))
                  for i in range(requests)]
        t0 = time.perf_counter()
        loop.run_until_idle()
        wall = (time.perf_counter() - t0) * 1e3
        bad = [s for s in states if s.error or len(s.tokens) != new]
        if bad:
            raise RuntimeError(f"{len(bad)} requests did not get their {new} tokens ({bad[0].error})")
        busy = sum(b for b, _ in gaps)
        idle = sum(g or 0.0 for _, g in gaps)
        row = dict(wall_ms=round(wall, 2), bursts=len(admitted), timed=bool(gaps),
                   idle_pct=round(100 * idle / (busy + idle), 1) if busy + idle else None,
                   burst_us=round(1e3 * busy / len(gaps), 1) if gaps else None)
        row.update(classify(admitted, [g for _, g in gaps]) if gaps else {})
        rows.append(row)
    return rows


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=("auto", "cupy", "numpy"))
    p.add_argument("-m", type=int, default=8, help="rounds per burst")
    p.add_argument("--depth", type=int, default=4, help="bursts kept in flight")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new", type=int, default=256, help="new tokens per request")
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows = run(a.backend, a.m, a.depth, a.repeats, a.requests, a.batch, a.new)
    table = Table(title=f"GPU idle by what preceded each launch (M={a.m}, depth {a.depth})")
    for col in ("idle", "wall ms", "bursts", "burst µs", "plain: n, µs", "admit: n, µs", "after: n, µs",
                "plain gap p50 / p90 µs"):
        table.add_column(col, justify="right")
    for r in rows:
        if not r["timed"]:
            table.add_row("-", f"{r['wall_ms']:.2f}", str(r["bursts"]), "-", "-", "-", "-", "no GPU clock")
            continue
        table.add_row(f"{r['idle_pct']}%", f"{r['wall_ms']:.2f}", str(r["bursts"]), str(r["burst_us"]),
                      *(f"{r[c][0]}, {r[c][1]:.0f}" for c in CATEGORIES), f"{r['plain_p50_us']} / {r['plain_p90_us']}")
    Console().print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), runs=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()

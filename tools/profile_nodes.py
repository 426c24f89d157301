"""Per-kernel device time of one eager burst at the base config, for running under ncu.

Usage (GPU machine, from the repository root):
  PYTHONPATH=. ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
      python3 tools/profile_nodes.py > ncu.csv
  python3 tools/profile_nodes.py --summarize ncu.csv
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
from collections import defaultdict


def run() -> None:
    from graphburst import SpecDecoder, stub_pair
    from graphburst.backend import get_backend

    backend = get_backend("cupy")
    target, draft = stub_pair(1, 32000, 4, 1, 4096, accept_prob=0.7, backend=backend)
    dec = SpecDecoder(target, draft, k=4, m_rounds=8)
    dec.prefill([[1, 2, 3, 4, 5, 6, 7, 8]])
    for _ in range(3):
        dec.run_burst()


def summarize(path: str) -> None:
    with open(path) as f:
        text = f.read()
    start = text.find('"ID"')
    rows = csv.DictReader(io.StringIO(text[start:]))
    times = defaultdict(list)
    for row in rows:
        if row.get("Metric Name") == "gpu__time_duration.sum":
            unit = row["Metric Unit"]
            val = float(row["Metric Value"].replace(",", ""))
            scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit, 1.0)
            times[row["Kernel Name"].split("(")[0]].append(val * scale)
    print(f"{'kernel':28s} {'calls':>6s} {'median us':>10s}")
    for name, vals in sorted(times.items()):
        print(f"{name:28s} {len(vals):6d} {statistics.median(vals):10.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--summarize")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
    else:
        run()

"""What capturing the admission graphs when the loop is built saves, against capturing each at first use.

A decoder whose models prefill from device sizes admits through one captured graph per prompt-width
bucket (``graphburst/admission_graph.py``). ``ServeLoop`` captures every bucket a request can take at
construction (``SpecDecoder.warm_admission_graphs``); before, each was captured by the first
admission that needed it, while bursts were in flight. Two measurements:

* **capture**: host ms to capture each width bucket's graph (a decoder of zero-cost stubs, the
  graphs captured one width at a time, the device synchronized between them);
* **serving**: a mixed-width workload (``--requests`` prompts of 1 to ``--longest`` tokens drawn
  log-uniformly with a fixed seed, ``--new`` tokens each, through ``--batch`` slots, k=4) served by
  a loop built warm (the default) and one built cold (the warm-up skipped), alternately, each after
  a 3-token warm-up request. Every request must get all its tokens, and the two loops the same
  tokens, before a run counts. Reported: wall ms, GPU idle, time to first token p50/p99 and the
  graphs captured inside the timed window.

Prints one ``rich`` row per (kind) with medians over the runs; ``--json`` writes the rows and runs.
On the numpy backend the runs are checked and counted (no device clock, no idle figure).

Usage: ``PYTHONPATH=. python scripts/admission_warmup.py [--backend auto] [--repeats 5] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, ".")
from graphburst.admission_graph import widths_up_to  # noqa: E402
from graphburst.backend import get_backend  # noqa: E402
from graphburst.bench.common import VOCAB, stub_models  # noqa: E402
from graphburst.burst import SpecDecoder  # noqa: E402
from graphburst.serving.loop import Request, ServeLoop  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from version_ab import serve_checked  # noqa: E402 (the checked, timed pass, shared)

K = 4


class ColdLoop(ServeLoop):
    """The loop as it was: no admission graph captured at construction, each at its first use."""

    def _make_decoder(self, target, draft, **kw) -> SpecDecoder:
        dec = super()._make_decoder(target, draft, **kw)
        dec.warm_admission_graphs = lambda **_: 0  # an instance attribute: this loop's decoder only
        return dec


def capture_costs(be, batch: int, capacity: int) -> list:
    """Host ms to capture each width bucket's graph, narrowest first: ``[(width, ms)]``."""
    target, draft = stub_models(be, batch=batch, capacity=capacity)
    dec = SpecDecoder(target, draft, k=K, m_rounds=1)
    out = []
    for width in widths_up_to(capacity, capacity):
        dec.stream.synchronize()
        t0 = time.perf_counter()
        captured = dec.warm_admission_graphs(longest=width)
        ms = (time.perf_counter() - t0) * 1e3
        assert captured == 1, f"width {width}: {captured} graphs captured"
        out.append((width, round(ms, 3)))
    return out


def workload(requests: int, longest: int, seed: int = 0) -> list:
    """Prompts of 1 to ``longest`` tokens, lengths log-uniform."""
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(0, np.log(longest), requests)).astype(int).clip(1, longest)
    return [rng.integers(0, VOCAB, int(n)).tolist() for n in sizes]


def run(be, loop_cls, prompts: list, *, batch: int, capacity: int, new: int, m: int, depth: int) -> tuple:
    """One timed pass of ``prompts`` through a fresh loop: ``(figures, tokens per request)``."""
    target, draft = stub_models(be, batch=batch, capacity=capacity)
    loop = loop_cls(target, draft, k=K, m_rounds=m, depth=depth)
    loop.submit(Request([1, 2, 3], m * (K + 1)))
    loop.run_until_idle()  # compiles kernels, captures the burst graph (and, cold, the narrowest bucket)
    graphs = loop.dec.admission_graphs
    captures0 = graphs.captures
    states, wall, busy, idle = serve_checked(loop, [Request(p, new, options={"seed": i})
                                                    for i, p in enumerate(prompts)], new)
    ttft = [(s.first_token - s.submitted) * 1e3 for s in states]
    figures = {"wall_ms": round(wall, 3), "idle": idle / (busy + idle) if be.is_gpu and busy + idle > 0 else None,
               "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 3),
               "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 3),
               "captures_in_window": graphs.captures - captures0, "bursts": loop.bursts}
    return figures, [s.tokens for s in states]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--longest", type=int, default=3000, help="longest prompt (tokens)")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("-m", type=int, default=8)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.longest + args.new > args.capacity:
        p.error(f"--longest {args.longest} plus --new {args.new} exceeds --capacity {args.capacity}")
    be = get_backend(args.backend)
    prompts = workload(args.requests, args.longest)
    shape = dict(batch=args.batch, capacity=args.capacity, new=args.new, m=args.m, depth=args.depth)
    costs = capture_costs(be, args.batch, args.capacity)
    runs = []
    for _ in range(args.repeats):
        tokens = {}
        for kind, cls in (("warm", ServeLoop), ("cold", ColdLoop)):
            figures, tokens[kind] = run(be, cls, prompts, **shape)
            runs.append({"kind": kind, **figures})
        assert tokens["warm"] == tokens["cold"], "warm and cold loops gave different tokens"
    rows = []
    for kind in ("warm", "cold"):
        mine = [r for r in runs if r["kind"] == kind]
        idles = [r["idle"] for r in mine if r["idle"] is not None]
        rows.append({"kind": kind, "runs": len(mine),
                     **{f: statistics.median(r[f] for r in mine) for f in
                        ("wall_ms", "ttft_p50_ms", "ttft_p99_ms", "captures_in_window", "bursts")},
                     "idle": statistics.median(idles) if idles else None})
    table = Table(title=f"admission graphs captured at construction (warm) or first use (cold), {be.name}, "
                        f"{args.requests} prompts of 1-{args.longest} tokens, B={args.batch}, M={args.m}, "
                        f"depth {args.depth}; medians")
    for col in ("loop", "runs", "wall ms", "GPU idle", "TTFT p50 ms", "TTFT p99 ms", "captures in window", "bursts"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["kind"], str(r["runs"]), f"{r['wall_ms']:.2f}",
                      "-" if r["idle"] is None else f"{100 * r['idle']:.1f}%", f"{r['ttft_p50_ms']:.2f}",
                      f"{r['ttft_p99_ms']:.2f}", f"{r['captures_in_window']:g}", f"{r['bursts']:g}")
    console = Console()
    console.print(table)
    console.print("capture ms per width bucket: " + ", ".join(f"{w}: {ms:.3f}" for w, ms in costs))
    out = {"backend": be.name, "args": vars(args), "capture_ms": costs, "rows": rows, "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()

"""Serving benchmark: 64 concurrent requests at B=64, k=4, M=8, stub cost 0 and 100 µs,
through the captured graph (pipelined and not) and through eager bursts that sync
every round.

Usage: PYTHONPATH=. python3 scripts/serve_bench.py [--json FILE] [--new-tokens N]
Every request's tokens are checked against the greedy reference before figures count.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from graphburst import greedy_reference, stub_pair
from graphburst.backend import get_backend
from graphburst.serve import Request, ServeLoop, inter_token_latencies_us, percentiles

VOCAB = 32000


def run_one(backend, engine, pipelined, cost_us, n_req, new_tokens, batch=64, k=4, m=8):
    target, draft = stub_pair(batch, VOCAB, 4, 1, 64 + new_tokens + m * (k + 1), accept_prob=0.7,
                              cost_ns=int(cost_us * 1000), backend=backend)
    loop = ServeLoop(target, draft, k=k, m_rounds=m, engine=engine, pipelined=pipelined)
    engine = engine + (" pipelined" if loop.pipelined else "")
    rng = np.random.default_rng(0)
    reqs = [Request(rng.integers(0, VOCAB, 16).tolist(), new_tokens, seed=i) for i in range(n_req)]
    warm = loop.submit(Request([1, 2, 3], m * (k + 1)))  # one warm-up request through the same loop
    loop.run_until_idle()
    t0 = time.perf_counter()
    states = [loop.submit(r) for r in reqs]
    loop.run_until_idle()
    wall = time.perf_counter() - t0
    for s in states + [warm]:
        want = greedy_reference(s.request.prompt, s.request.max_new_tokens, VOCAB)
        assert s.tokens == want, f"{engine}: request {s.request.id} differs from the greedy reference"
    raw, amortised = inter_token_latencies_us(states)
    stats = loop.stats()
    return dict(engine=engine, cost_us=cost_us, tokens=sum(len(s.tokens) for s in states), wall_s=wall,
                tokens_per_s=sum(len(s.tokens) for s in states) / wall, itl_amortised_us=percentiles(amortised),
                delivery_gap_us=percentiles(raw), ttft_ms=percentiles([s.stats()["ttft_ms"] for s in states]),
                gpu_idle_fraction=stats["gpu_idle_fraction"], bursts=stats["bursts"] - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="serve_bench.json")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=64)
    args = ap.parse_args()
    backend = get_backend("auto")
    label = "GPU" if backend.is_gpu else "CPU REFERENCE (numpy backend, not a GPU timing)"
    engines = (("graph", True), ("graph", False), ("eager_sync", False))
    rows = [run_one(backend, engine, pipelined, cost, args.requests, args.new_tokens)
            for cost in (0, 100) for engine, pipelined in engines]
    table = Table(title=f"serve: {args.requests} requests x {args.new_tokens} tokens, B=64, k=4, M=8; {label}")
    for col in ("engine", "stub µs/call", "tokens/s", "ITL p50 µs", "ITL p99 µs", "delivery gap p50 µs",
                "delivery gap p99 µs", "TTFT p50 ms", "GPU idle", "bursts"):
        table.add_column(col, justify="right")
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    for r in rows:
        table.add_row(r["engine"], str(r["cost_us"]), f(r["tokens_per_s"], ".0f"), f(r["itl_amortised_us"]["p50"], ".2f"),
                      f(r["itl_amortised_us"]["p99"], ".2f"), f(r["delivery_gap_us"]["p50"], ".1f"),
                      f(r["delivery_gap_us"]["p99"], ".1f"), f(r["ttft_ms"]["p50"], ".2f"),
                      f(r["gpu_idle_fraction"], ".1%"), str(r["bursts"]))
    Console(width=200).print(table)
    with open(args.json, "w") as f:
        json.dump(dict(date=datetime.date.today().isoformat(), label=label, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()

"""``graphburst bench capture``: the address guard's per-replay cost and the GPU's idle gap
between bursts, with and without the gapless drain (B=1, k=4, M=8, zero-cost stubs).

Each timed run first replays and checks a few bursts against the greedy reference; the
timed tokens are checked again afterwards. The idle gap needs CUDA events, so on the
numpy backend only the guard cost is measured.
"""

from __future__ import annotations

import statistics
import time

from rich.console import Console

from ..capture import BurstGraph
from ..cli_args import TOKEN_BYTES, check_kv_memory, check_memory, int_in, writable_file
from .common import check_greedy, label, new_table, write_results, build_decoder

CFG = dict(batch=1, k=4, m=8, layers=4, accept=0.7, cost_us=0)
PROMPT = [1, 2, 3]
CHECK_BURSTS = 5


def _capacity(bursts: int) -> int:
    return 64 + bursts * CFG["m"] * (CFG["k"] + 1)


def _decoder(backend, bursts):
    return build_decoder(backend, CFG, _capacity(bursts), prompts=[PROMPT] * CFG["batch"])


def guard_cost_ns(graph, n=200_000) -> float:
    check = graph.guard.check
    t0 = time.perf_counter_ns()
    for _ in range(n):
        check()
    return (time.perf_counter_ns() - t0) / n


def idle_gaps_us(backend, gapless: bool, bursts: int) -> tuple[float, float]:
    """Median GPU idle time between consecutive bursts, and median burst time (µs)."""
    xp = backend.xp
    dec = _decoder(backend, bursts + CHECK_BURSTS + 5)
    g = BurstGraph(dec, gapless=gapless)
    out = []
    for _ in range(CHECK_BURSTS):  # checked, and warm, before anything is timed
        out += g.run()[0].tolist()
    check_greedy(f"capture gapless={gapless} (before timing)", [PROMPT], [out])
    events = [(xp.cuda.Event(), xp.cuda.Event()) for _ in range(bursts)]
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
    check_greedy(f"capture gapless={gapless} (timed bursts)", [PROMPT], [out])
    gaps = [xp.cuda.get_elapsed_time(events[i][1], events[i + 1][0]) * 1e3 for i in range(bursts - 1)]
    busy = [xp.cuda.get_elapsed_time(e0, e1) * 1e3 for e0, e1 in events]
    return statistics.median(gaps), statistics.median(busy)


def add_parser(sub) -> None:
    p = sub.add_parser("capture", help="address-guard cost and the idle gap between bursts")
    p.add_argument("--backend", choices=("auto", "cupy", "numpy"), default="auto",
                   help="cupy (GPU), numpy (CPU reference: the guard cost only) or auto")
    p.add_argument("--json", type=writable_file, default="capture_bench.json", help="results file (JSON)")
    p.add_argument("--bursts", type=int_in(1, 1_000_000), default=2000,
                   help="timed bursts per idle-gap run (GPU only), after the checked warm-up bursts")


def check_args(args) -> None:
    """The KV caches and kept tokens the timed bursts need must fit before anything runs."""
    tokens = _capacity(args.bursts + CHECK_BURSTS + 5)
    check_kv_memory(CFG["batch"], tokens, CFG["layers"] + 1, flags=("--bursts",))
    check_memory(tokens * TOKEN_BYTES, f"{tokens} kept tokens", ("--bursts",))


def run(args, console: Console, backend) -> int:
    dec = _decoder(backend, CHECK_BURSTS)
    g = BurstGraph(dec)
    out = []
    for _ in range(CHECK_BURSTS):
        out += g.run()[0].tolist()
    check_greedy("capture (before timing)", [PROMPT], [out])
    rows = {"guard_check_ns": guard_cost_ns(g)}
    if backend.is_gpu:
        for gapless in (False, True):
            gap, busy = idle_gaps_us(backend, gapless, args.bursts)
            rows[f"idle_gap_us{'_gapless' if gapless else ''}"] = gap
            rows[f"burst_us{'_gapless' if gapless else ''}"] = busy
    table = new_table(f"capture measurements (B=1, k=4, M=8, zero-cost stubs; medians); {label(backend)}",
                      ["metric", "value"])
    for key, val in rows.items():
        table.add_row(key, f"{val:.3f}")
    if not backend.is_gpu:
        table.add_row("idle_gap_us", "skipped (needs CUDA events)")
    write_results(console, args.json, backend=backend, tables=[table], results=rows, bursts=args.bursts)
    return 0

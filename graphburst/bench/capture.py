"""``graphburst bench capture``: the address guard's per-replay cost and the GPU's idle gap
between bursts, with and without the gapless drain (B=1, k=4, M=8, zero-cost stubs); and the
device-exit burst against the fixed-M one (every round runs, so the difference per round is the
condition's cost), with the cost of a burst that a pending stop request ends before its first round;
and the fixed-M burst with draft caps (per-request k and the batch-size switch: one more launch a
round), whose difference per round is the cap kernel's cost.

Each timed run first replays and checks a few bursts against the greedy reference; the
timed tokens are checked again afterwards. The idle gap needs CUDA events, so on the
numpy backend only the guard cost is measured.
"""

from __future__ import annotations

import statistics
import time

from rich.console import Console

from ..capture import BurstGraph, device_exit_refusal
from ..cli_args import TOKEN_BYTES, check_kv_memory, check_memory, int_in, writable_file
from .common import check_greedy, label, new_table, write_results, build_decoder

CFG = dict(batch=1, k=4, m=8, layers=4, accept=0.7, cost_us=0)
PROMPT = [1, 2, 3]
CHECK_BURSTS = 5


def _capacity(bursts: int) -> int:
    return 64 + bursts * CFG["m"] * (CFG["k"] + 1)


def _decoder(backend, bursts, draft_caps=False):
    return build_decoder(backend, CFG, _capacity(bursts), prompts=[PROMPT] * CFG["batch"], draft_caps=draft_caps)


def _checked_burst_tokens(graph) -> list[int]:
    """The tokens of the first ``CHECK_BURSTS`` bursts of ``graph`` (B = 1), for the checks before timing."""
    out = []
    for _ in range(CHECK_BURSTS):
        out += graph.run()[0].tolist()
    return out


def guard_cost_ns(graph, n=200_000) -> float:
    check = graph.guard.check
    t0 = time.perf_counter_ns()
    for _ in range(n):
        check()
    return (time.perf_counter_ns() - t0) / n


def idle_gaps_us(backend, gapless: bool, bursts: int, device_exit: bool = False,
                 draft_caps: bool = False) -> tuple[float, float]:
    """Median GPU idle time between consecutive bursts, and median burst time (µs)."""
    xp = backend.xp
    dec = _decoder(backend, bursts + CHECK_BURSTS + 5, draft_caps=draft_caps)
    g = BurstGraph(dec, gapless=gapless, device_exit=device_exit)
    out = []
    for _ in range(CHECK_BURSTS):  # checked, and warm, before anything is timed
        out += g.run()[0].tolist()
        if device_exit and g.last_rounds != CFG["m"]:
            raise AssertionError(f"a device-exit burst with budget left ran {g.last_rounds} of {CFG['m']} rounds")
    what = f"capture gapless={gapless} device_exit={device_exit} draft_caps={draft_caps}"
    check_greedy(f"{what} (before timing)", [PROMPT], [out])
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
    check_greedy(f"{what} (timed bursts)", [PROMPT], [out])
    gaps = [xp.cuda.get_elapsed_time(events[i][1], events[i + 1][0]) * 1e3 for i in range(bursts - 1)]
    busy = [xp.cuda.get_elapsed_time(e0, e1) * 1e3 for e0, e1 in events]
    return statistics.median(gaps), statistics.median(busy)


def zero_round_burst_us(backend, bursts: int) -> float:
    """Median GPU time (µs) of a device-exit burst that a stop request made before its launch ends
    at its first boundary: the head, the WHILE node and the copies, with no round."""
    xp = backend.xp
    dec = _decoder(backend, CHECK_BURSTS + 5)
    g = BurstGraph(dec, device_exit=True)
    before = dec.positions().copy()
    events = [(xp.cuda.Event(), xp.cuda.Event()) for _ in range(bursts)]
    for e in events:
        g.request_stop()
        g.replay(timing_events=e)
        if g.drain().total != 0 or g.last_rounds != 0:
            raise AssertionError(f"a burst with a stop pending ran {g.last_rounds} rounds")
    if (dec.positions() != before).any():
        raise AssertionError("a zero-round burst moved a position")
    return statistics.median(xp.cuda.get_elapsed_time(e0, e1) * 1e3 for e0, e1 in events)


def device_exit_rows(backend, bursts: int) -> dict:
    """The device-exit rows: on numpy, the rounds the checked bursts ran; on the GPU, burst time and
    idle gap against the fixed-M graph, the condition's cost per round and a zero-round burst's time;
    where device exit is refused, the reason."""
    dec = _decoder(backend, CHECK_BURSTS)
    refusal, _ = device_exit_refusal(dec)
    if refusal is not None:
        return {"device_exit_refused": refusal}
    g = BurstGraph(dec, device_exit=True)
    check_greedy("capture device_exit (before timing)", [PROMPT], [_checked_burst_tokens(g)])
    rows = {"device_exit_rounds": g.last_rounds}
    if backend.is_gpu:
        gap, busy = idle_gaps_us(backend, False, bursts, device_exit=True)
        rows["idle_gap_us_device_exit"] = gap
        rows["burst_us_device_exit"] = busy
        rows["burst_us_device_exit_zero_rounds"] = zero_round_burst_us(backend, min(bursts, 500))
    return rows


def draft_caps_rows(backend, bursts: int, plain_tokens: list[int]) -> dict:
    """The draft-caps rows: on numpy, the tokens of the checked bursts (all k drafts allowed, so
    ``plain_tokens``, those of the same bursts without caps); on the GPU, the fixed-M burst's time
    with the cap launch in every round."""
    capped = _decoder(backend, CHECK_BURSTS, draft_caps=True)
    if capped.caps is None:
        raise AssertionError("a decoder built with draft_caps=True has no caps")
    out_capped = _checked_burst_tokens(BurstGraph(capped))
    check_greedy("capture draft_caps (before timing)", [PROMPT], [out_capped])
    if out_capped != plain_tokens:  # a cap of k changes nothing: the same rounds commit the same tokens
        raise AssertionError("bursts with draft caps at k committed other tokens than without")
    rows = {"draft_caps_tokens": len(out_capped)}
    if backend.is_gpu:
        rows["burst_us_draft_caps"] = idle_gaps_us(backend, False, bursts, draft_caps=True)[1]
    return rows


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
    out = _checked_burst_tokens(g)
    check_greedy("capture (before timing)", [PROMPT], [out])
    rows = {"guard_check_ns": guard_cost_ns(g)}
    if backend.is_gpu:
        for gapless in (False, True):
            gap, busy = idle_gaps_us(backend, gapless, args.bursts)
            rows[f"idle_gap_us{'_gapless' if gapless else ''}"] = gap
            rows[f"burst_us{'_gapless' if gapless else ''}"] = busy
    rows.update(device_exit_rows(backend, args.bursts))
    if "burst_us_device_exit" in rows:  # every round runs in both: the difference is the condition's
        rows["device_exit_cost_per_round_us"] = (rows["burst_us_device_exit"] - rows["burst_us"]) / CFG["m"]
    rows.update(draft_caps_rows(backend, args.bursts, out))
    if "burst_us_draft_caps" in rows:
        rows["draft_caps_cost_per_round_us"] = (rows["burst_us_draft_caps"] - rows["burst_us"]) / CFG["m"]
    table = new_table(f"capture measurements (B=1, k=4, M=8, zero-cost stubs; medians); {label(backend)}",
                      ["metric", "value"])
    for key, val in rows.items():
        table.add_row(key, val if isinstance(val, str) else f"{val:.3f}")
    if not backend.is_gpu:
        table.add_row("idle_gap_us", "skipped (needs CUDA events)")
    write_results(console, args.json, backend=backend, tables=[table], results=rows, bursts=args.bursts)
    return 0

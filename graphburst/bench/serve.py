"""``graphburst bench serve``: 64 concurrent requests at B=64, k=4, M=8 (``--batch``, ``-k``,
``-m``), stub cost 0 and 100 µs, through the captured graph (pipelined and not) and through eager bursts that
sync every round. A warm-up request through each loop is checked against the greedy
reference before the timed requests start; every timed request is checked after.
``--http`` adds the HTTP server under real concurrent streaming clients (.serve_http).
``--model ... --http`` runs the open-loop load benchmark over a real model instead (.load).
``--profile`` shows where the host's time and the GPU's idle go in the refill workload
instead (.serve_profile).

Two GPU idle figures per row: **all** counts every gap between bursts while a request
held a slot (the figure reported before; the short default workload is mostly ramp-up
and ramp-down), **steady** only the gaps before bursts launched with every batch slot
running. The ``refill`` workload (``--refill-requests``, 4x the slots by default) keeps
the slots refilling at burst boundaries, so its steady window is long and includes the
cost of admission."""

from __future__ import annotations

import argparse
import time

import numpy as np
from rich.console import Console

from ..engine.mode import BurstMode
from ..cli_args import TOKEN_BYTES, DeprecatedAlias, FlagError, check_kv_memory, check_memory, int_in, writable_file
from ..constants import MAX_DEPTH
from ..serving.request import Request
from ..serving.loop import ServeLoop
from ..serving.timing import inter_token_latencies_us, percentiles
from . import load, serve_profile
from .real_args import MODEL_NAMES
from .common import VOCAB, check_greedy, fmt, label, new_table, stub_models, write_results

ENGINES = ((BurstMode.GRAPH, True), (BurstMode.GRAPH, False), (BurstMode.PER_ROUND_SYNC, False))
COSTS_US = (0, 100)
BATCH = 64
STUB_LAYERS = 4  # common.stub_models' default target KV layers
SERVE_JSON, PROFILE_JSON = "serve_bench.json", "serve_profile.json"  # --json's defaults
PROFILE_REPEATS = 3
#: open-loop flags --profile takes too (the rest are refused, as without --model)
PROFILE_TAKES = ("--admission",)


def _request(prompt, max_new_tokens, seed=None) -> Request:
    # The stub draft's per-request agreement seed: the one place a benchmark sets a model option.
    return Request(prompt, max_new_tokens, options=None if seed is None else {"seed": seed})


def _capacity(new_tokens: int, k: int = 4, m: int = 8) -> int:
    return 64 + new_tokens + m * (k + 1)


def run_one(backend, engine, pipelined, cost_us, n_req, new_tokens, batch=BATCH, k=4, m=8, workload="burst",
            depth=2) -> dict:
    target, draft = stub_models(backend, batch=batch, capacity=_capacity(new_tokens, k, m), cost_us=cost_us)
    loop = ServeLoop(target, draft, k=k, m_rounds=m, engine=engine, pipelined=pipelined, depth=depth)
    name = str(engine) + (" pipelined" if loop.pipelined else "") + (f" depth {depth}" if depth != 2 else "")
    warm = loop.submit(_request([1, 2, 3], m * (k + 1)))  # one checked warm-up request through the same loop
    loop.run_until_idle()
    warm_bursts = loop.stats()["bursts"]  # the timed figures below count only the timed run's bursts
    check_greedy(f"{name} warm-up", [warm.request.prompt], [warm.tokens])
    rng = np.random.default_rng(0)
    reqs = [_request(rng.integers(0, VOCAB, 16).tolist(), new_tokens, seed=i) for i in range(n_req)]
    t0 = time.perf_counter()
    states = [loop.submit(r) for r in reqs]
    loop.run_until_idle()
    wall = time.perf_counter() - t0
    check_greedy(name, [s.request.prompt for s in states], [s.tokens for s in states])
    raw, amortised = inter_token_latencies_us(states)
    stats = loop.stats()
    tokens = sum(len(s.tokens) for s in states)
    return dict(engine=name, workload=workload, requests=n_req, cost_us=cost_us, tokens=tokens, wall_s=wall,
                tokens_per_s=tokens / wall, itl_amortised_us=percentiles(amortised), delivery_gap_us=percentiles(raw),
                ttft_ms=percentiles([s.stats()["ttft_ms"] for s in states]),
                # Both idle figures include the warm-up request's few bursts (never steady: one slot of 64).
                gpu_idle_fraction=stats["gpu_idle_fraction"], gpu_idle_fraction_steady=stats["gpu_idle_fraction_steady"],
                gpu_admission_fraction=stats["gpu_admission_fraction"],
                steady_bursts=stats["steady_bursts"], bursts=stats["bursts"] - warm_bursts)


REFILL_RUNS = 3  # the refill row is the run of median GPU idle: one run of ~60 bursts varies by 10+ points


def _median_refill(backend, cost_us, n_req, new_tokens, depth=2, **shape) -> dict:
    """The refill workload ``REFILL_RUNS`` times; the run of median idle, every run's idle beside it.
    ``shape``: ``batch``, ``k``, ``m`` for :func:`run_one`."""
    n_runs = REFILL_RUNS if backend.is_gpu else 1  # numpy: no device timing, nothing to rank
    runs = [run_one(backend, "graph", True, cost_us, n_req, new_tokens, workload="refill", depth=depth, **shape)
            for _ in range(n_runs)]
    if n_runs == 1:
        return runs[0]
    idle = [r["gpu_idle_fraction"] for r in runs]
    row = sorted(runs, key=lambda r: r["gpu_idle_fraction"])[len(runs) // 2]
    return row | {"gpu_idle_fraction_runs": idle}


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serving loop: tokens/s, inter-token latency, TTFT per engine (closed loop, stub "
                                     "models); --model ... --http: the real server under open-loop load")
    p.add_argument("--backend", choices=("auto", "cupy", "numpy"), default="auto",
                   help="cupy (GPU), numpy (CPU reference) or auto (cupy when a GPU is usable)")
    p.add_argument("--json", type=writable_file, default=None,
                   help=f"results file (JSON; default {SERVE_JSON}, with --profile {PROFILE_JSON})")
    p.add_argument("--new-tokens", type=int_in(1, 1_000_000), default=256, help="new tokens per request")
    # ``serve --requests`` is a file; here it is a count, hence --num-requests (the old spelling still works).
    p.add_argument("--num-requests", type=int_in(1, 1_000_000), default=64,
                   help="requests of the burst workload (and concurrent clients with --http)")
    p.add_argument("--requests", type=int_in(1, 1_000_000), dest="num_requests", action=DeprecatedAlias,
                   help=argparse.SUPPRESS)
    p.add_argument("--refill-requests", type=int_in(0, 1_000_000), default=None,
                   help="requests of the refill workload (graph pipelined, more requests than the --batch slots, so "
                        "slots refill at burst boundaries; default 4x --batch); 0 skips it")
    p.add_argument("--pipeline-depth", type=int_in(2, MAX_DEPTH), nargs="+", default=[2], metavar="N",
                   help="bursts kept in flight in the refill workload's rows, one row set per value (default 2)")
    p.add_argument("--http", action="store_true",
                   help="also run the HTTP server in a subprocess (127.0.0.1, ephemeral port) under --num-requests "
                        "concurrent streaming httpx clients, pipelined and not, stub cost 0; with --model: the "
                        "open-loop benchmark instead (below)")
    p.add_argument("--http-timeout", type=int_in(1, 3600), default=120,
                   help="seconds the HTTP clients of one run may take in all (open loop: after the last arrival)")
    p.add_argument("--profile", action="store_true",
                   help="instead: where the host's time and the GPU's idle go in the zero-cost refill workload "
                        "(a boundary's host time by phase, host µs per step by phase, GPU idle by what preceded "
                        "each launch), one run per --pipeline-depth and --repeats; --model SHAPE: a random-weight "
                        "shape of bench real instead of stubs")
    p.add_argument("--repeats", type=int_in(1, 100), default=None,
                   help=f"--profile: runs per view and depth (default {PROFILE_REPEATS})")
    load.add_flags(p)  # its --batch, -k and -m/--rounds also shape the stubs' loop here


def check_args(args) -> None:
    """Sizes against the memory they take; ``--http`` needs the server's packages and httpx.

    With ``--model`` the open-loop benchmark's checks (.load) instead; with ``--profile``, its own.
    """
    args.json = args.json or (PROFILE_JSON if args.profile else SERVE_JSON)
    if args.profile:
        _check_profile_args(args)
        return
    if args.repeats is not None:
        raise FlagError("--repeats", "applies to --profile only")
    if args.model is not None:
        load.check_args(args)
        return
    load.refuse_without_model(args)
    if args.refill_requests is None:
        args.refill_requests = 4 * args.batch
    # One loop's KV caches at the largest request, and every request's tokens kept to the end.
    check_kv_memory(args.batch, _capacity(args.new_tokens, args.k, args.rounds), STUB_LAYERS + 1,
                    flags=("--batch", "--new-tokens", "--rounds"))
    n_req = max(args.num_requests, args.refill_requests)
    check_memory(n_req * args.new_tokens * TOKEN_BYTES, f"{n_req} requests x {args.new_tokens} new tokens",
                 ("--num-requests" if args.num_requests >= args.refill_requests else "--refill-requests",
                  "--new-tokens"))
    if not args.http:
        return
    import importlib.util

    missing = [m for m in ("aiohttp", "prometheus_client", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        raise FlagError("--http", f"needs {', '.join(missing)} (pip install \"graphburst[serve]\")")


def _check_profile_args(args) -> None:
    """``--profile``: the refill workload (or a shape's), no HTTP, no open-loop flag but :data:`PROFILE_TAKES`."""
    if args.http:
        raise FlagError("--http", "the profile runs the loop in process; drop --http or --profile")
    if args.model is not None and args.model not in MODEL_NAMES:
        raise FlagError("--model", f"--profile takes a random-weight shape ({', '.join(MODEL_NAMES)}), got "
                                   f"{args.model!r}")
    for flag in load.ONLY_WITH_MODEL:
        if flag not in PROFILE_TAKES and getattr(args, flag[2:].replace("-", "_")) is not None:
            raise FlagError(flag, "applies to the open-loop benchmark only (--model ... --http), not to --profile")
    if args.refill_requests is None:
        args.refill_requests = 4 * args.batch
    if args.refill_requests == 0:
        raise FlagError("--refill-requests", "--profile runs the refill workload: give it at least one request")
    args.repeats = args.repeats or PROFILE_REPEATS
    if args.model is None:
        check_kv_memory(args.batch, _capacity(args.new_tokens, args.k, args.rounds), STUB_LAYERS + 1,
                        flags=("--batch", "--new-tokens", "--rounds"))
        check_memory(args.refill_requests * args.new_tokens * TOKEN_BYTES,
                     f"{args.refill_requests} requests x {args.new_tokens} new tokens", ("--refill-requests",
                                                                                        "--new-tokens"))


def run(args, console: Console, backend) -> int:
    if args.profile:
        return serve_profile.run(args, console, backend)
    if args.model is not None:
        return load.run(args, console, backend)
    # The open-loop shape flags set the stubs' loop too (they were ignored here once: -m 16 ran M=8).
    shape = {"batch": args.batch, "k": args.k, "m": args.rounds}
    rows = [run_one(backend, engine, pipelined, cost, args.num_requests, args.new_tokens, **shape)
            for cost in COSTS_US for engine, pipelined in ENGINES]
    if args.refill_requests:
        rows += [_median_refill(backend, cost, args.refill_requests, args.new_tokens, depth, **shape)
                 for depth in args.pipeline_depth for cost in COSTS_US]
    for r in rows:
        r["transport"] = "in-process"
    if args.http:
        from .serve_http import run_http

        rows += [run_http(backend.name, pipelined=pipelined, cost_us=0, clients=args.num_requests,
                          new_tokens=args.new_tokens, timeout_s=args.http_timeout, **shape)
                 for pipelined in (True, False)]
    for r in rows:
        r.update(shape)
    table = new_table(f"serve: B={args.batch}, k={args.k}, M={args.rounds}, {args.new_tokens} tokens per request; burst: {args.num_requests} "
                      f"requests, refill: {args.refill_requests}; {label(backend)}",
                      ["transport", "workload", "engine", "stub µs/call", "tokens/s", "ITL p50 µs", "ITL p99 µs",
                       "delivery gap p50 µs", "delivery gap p99 µs", "TTFT p50 ms", "GPU idle (all)",
                       "of which admission", "GPU idle (steady)", "bursts (steady)"])
    for r in rows:
        table.add_row(r["transport"], r["workload"], r["engine"], str(r["cost_us"]), fmt(r["tokens_per_s"], 0),
                      fmt(r["itl_amortised_us"]["p50"]), fmt(r["itl_amortised_us"]["p99"]),
                      fmt(r["delivery_gap_us"]["p50"], 1), fmt(r["delivery_gap_us"]["p99"], 1),
                      fmt(r["ttft_ms"]["p50"]), _pct(r["gpu_idle_fraction"]), _pct(r.get("gpu_admission_fraction")),
                      _pct(r["gpu_idle_fraction_steady"]),
                      f"{r['bursts']} ({r['steady_bursts']})")
    write_results(console, args.json, backend=backend, tables=[table], results=rows,
                  requests=args.num_requests, refill_requests=args.refill_requests, new_tokens=args.new_tokens, **shape,
                  idle_note="gpu_idle_fraction: every gap while a request held a slot (the earlier figure); "
                            "gpu_idle_fraction_steady: gaps before bursts launched with every slot running")
    return 0


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"

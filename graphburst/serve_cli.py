"""``graphburst serve``: serve JSONL requests through one captured burst graph.

Each input line is ``{"id": "r1", "prompt": [12, 7, 99], "max_new_tokens": 64, "eos": 2}``
(``eos``, ``id``, ``accept_prob`` and ``seed`` optional). Each output line is the
request's record, with its ``id``, ``tokens`` and timings, or ``{"error": ..., "line": N}``
for a line that could not be served; the loop keeps serving the rest.
"""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.live import Live
from rich.table import Table

from .backend import BACKEND_NAMES, get_backend
from .models import stub_pair
from .serve import ENGINE_MODES, Request, ServeLoop

FIELDS = {"prompt", "max_new_tokens", "eos", "id", "accept_prob", "seed"}


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve JSONL requests (file or stdin) over one captured burst graph")
    p.add_argument("--requests", default="-", help="JSONL file, '-' for stdin")
    p.add_argument("--output", default="-", help="JSONL results, '-' for stdout")
    p.add_argument("--backend", choices=BACKEND_NAMES, default="auto")
    p.add_argument("--engine", choices=ENGINE_MODES, default="graph")
    p.add_argument("--batch", type=int, default=64, help="batch slots")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("-m", "--rounds", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--layers", type=int, default=4, help="target KV layers")
    p.add_argument("--capacity", type=int, default=4096, help="KV entries per slot")
    p.add_argument("--accept", type=float, default=0.7, help="default draft agreement probability")
    p.add_argument("--cost-us", type=float, default=0.0, help="emulated model time per call")
    p.add_argument("--no-pipeline", action="store_true",
                   help="graph engine: drain each burst before enqueueing the next")
    p.add_argument("--live", action="store_true", help="show the live view even when stderr is not a terminal")
    # --- HTTP mode (graphburst/http_server.py) ---
    h = p.add_argument_group("HTTP server (--http)")
    h.add_argument("--http", nargs="?", const="127.0.0.1:8000", default=None, metavar="[HOST:]PORT",
                   help="serve the OpenAI completions API over HTTP instead of JSONL (default 127.0.0.1:8000)")
    h.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    h.add_argument("--drain-timeout", type=float, default=10.0, help="seconds to finish requests on SIGTERM")
    h.add_argument("--tokenizer", default=None, metavar="DIR", help="model dir with tokenizer.json (text I/O)")
    h.add_argument("--served-model-name", default="graphburst-stub", help="the model name clients send")


def parse_line(text: str) -> Request:
    """A request from one JSONL line; raises ValueError/TypeError naming what is wrong."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"bad JSON: {exc.msg} at column {exc.colno}") from exc
    if not isinstance(obj, dict):
        raise TypeError(f"a request must be a JSON object, got {type(obj).__name__}")
    missing = [f for f in ("prompt", "max_new_tokens") if f not in obj]
    if missing:
        raise ValueError(f"missing field(s): {', '.join(missing)}")
    req = Request(**{k: v for k, v in obj.items() if k in FIELDS})
    if req.id is not None:
        req.id = str(req.id)
    return req


def _record(state) -> dict:
    req = state.request
    if state.cancelled:
        reason = "cancelled"
    elif req.eos is not None and state.tokens and state.tokens[-1] == req.eos:
        reason = "eos"
    else:
        reason = "length"
    return {"id": req.id, "tokens": state.tokens, "finish_reason": reason, **state.stats()}


def _view(loop: ServeLoop) -> Table:
    s = loop.stats()
    table = Table(title="graphburst serve")
    for col in ("active slots", "queued", "bursts", "tokens", "tokens/s", "GPU idle"):
        table.add_column(col, justify="right")
    idle = "-" if s["gpu_idle_fraction"] is None else f"{s['gpu_idle_fraction']:.1%}"
    table.add_row(str(s["active_slots"]), str(s["queued"]), str(s["bursts"]), str(s["tokens"]),
                  f"{s['tokens_per_s']:.0f}", idle)
    return table


def run(args, console: Console) -> int:
    if args.http:  # --- HTTP mode: aiohttp and prometheus_client come with the [serve] extra ---
        try:
            from . import http_server
        except ImportError as exc:
            print(f"graphburst serve --http: {exc}; install graphburst[serve]", file=sys.stderr)
            return 2
        return http_server.run(args, console)
    backend = get_backend(args.backend)
    target, draft = stub_pair(args.batch, args.vocab, args.layers, 1, args.capacity, accept_prob=args.accept,
                              cost_ns=int(args.cost_us * 1000), backend=backend)
    loop = ServeLoop(target, draft, k=args.k, m_rounds=args.rounds, engine=args.engine,
                     pipelined=not args.no_pipeline)
    err = Console(stderr=True)
    if not backend.is_gpu:
        err.print("graphburst serve: no GPU in use; running the numpy reference backend")
    source = sys.stdin if args.requests == "-" else open(args.requests)  # noqa: SIM115 - closed below
    sink = sys.stdout if args.output == "-" else open(args.output, "w")  # noqa: SIM115
    states, n_err = [], 0
    try:
        for n, text in enumerate(source, start=1):
            if not text.strip():
                continue
            try:
                states.append(loop.submit(parse_line(text)))
            except (ValueError, TypeError) as exc:
                sink.write(json.dumps({"error": str(exc), "line": n}) + "\n")
                n_err += 1
        written = set()
        live = Live(_view(loop), console=err, refresh_per_second=4, transient=False,
                    auto_refresh=False) if (err.is_terminal or args.live) else None
        if live:
            live.start()
        try:
            while not loop.idle:
                loop.step()
                for s in states:
                    if s.done and id(s) not in written:
                        sink.write(json.dumps(_record(s)) + "\n")
                        written.add(id(s))
                if live:
                    live.update(_view(loop), refresh=True)
        finally:
            if live:
                live.stop()
    finally:
        if source is not sys.stdin:
            source.close()
        if sink is not sys.stdout:
            sink.close()
    stats = loop.stats()
    err.print(f"served {len(states)} requests ({n_err} rejected) in {stats['bursts']} bursts, "
              f"{stats['tokens']} tokens, {stats['tokens_per_s']:.0f} tokens/s")
    return 0

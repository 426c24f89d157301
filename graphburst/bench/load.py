"""``graphburst bench serve --model ... --http``: the open-loop load benchmark.

The server is the real one (``serving/http.py``'s ``run``, aiohttp on 127.0.0.1, a free
port) over the loop ``--model`` / ``--draft`` describe, in a child process
(:mod:`.load_server`). This process is the load: per rate, a Poisson stream of requests
plus an optional burst (:mod:`.load_schedule`), one asyncio task per request started on
the schedule's clock whatever has finished (open loop), each streaming its completion
over httpx (:mod:`.load_client`).

**Correctness before timing.** The child decodes ``CHECK_REQUESTS`` requests in-process
(no HTTP) and prints their tokens; the same requests are then sent over HTTP and must
come back token for token, or the run stops (exit 1) before anything is timed. Then a
warm-up of one request per slot, all at once, untimed. Every timed request must end with
``finish_reason`` ``"length"`` and exactly its ``max_tokens`` tokens, or it counts as an
error.

**Per rate** (:mod:`.load_stats` states the rules): offered and achieved requests/s,
output tokens/s, TTFT / ITL / TPOT / E2E p50 and p99, 429s, errors, the drafts accepted
per round and the GPU idle fraction of the run (the server's ``/metrics`` busy and idle
seconds, read before and after), and TTFT split into the wait for a batch slot, the prefill,
the hand-out and the client's side (the server's access log, joined on request ids). One
table row per rate, the JSON beside it, a plot (:mod:`.load_report`). ``--rates auto``
doubles from 1 request/s until throughput grows by less than ``AUTO_GROWTH`` or latency
blows up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import sys
import tempfile
import time

from rich.console import Console

from ..cli_args import FlagError, add_ngram_flags, check_ngram_flags, int_in, real_in, writable_file
from ..constants import MAX_K
from ..models.ngram import NGRAM_DRAFT
from ..serving.admit import ADMISSION_MODES
from ..serving.factory import DEVICE_EXIT_FLAGS, TINY_RANDOM, ConfigError, ServeConfig
from .common import float_list, write_results
from .load_schedule import DIST_KINDS, LengthDist, schedule
from .real_args import MODEL_NAMES

CHECK_REQUESTS = 2
DEFAULT_RATES = "2,4,8,16"
DEFAULT_EPS = 0.01  # the 1b pair accepts about 0.83 of its drafts at k=4 (docs/benchmarks.md, serving under load)
DEFAULT_LENGTHS = {"prompt": (128.0, 16, 512), "output": (128.0, 16, 512)}  # mean, min, max
AUTO_START, AUTO_STEPS = 1.0, 10  # --rates auto: 1, 2, 4, ... requests/s, at most this many rates
AUTO_GROWTH = 1.05  # stop when output tokens/s grows by less than 5% ...
AUTO_BLOWUP = 10.0  # ... or E2E p99 passes this many times the first rate's
START_TIMEOUT_S = 900.0  # a cold GPU: model build, capture, the check requests
SERVER_MODULE = "graphburst.bench.load_server"
#: how long a run's last access-log lines may trail its last [DONE], and the re-read period
ACCESS_LOG_WAIT_S, ACCESS_LOG_POLL_S = 2.0, 0.05


def add_flags(p) -> None:
    """The open-loop flags of ``graphburst bench serve`` (used with ``--model``)."""
    g = p.add_argument_group("open-loop load (--model ... --http: the real server under Poisson arrivals)")
    g.add_argument("--model", default=None, metavar="NAME|DIR",
                   help=f"a checkpoint directory, {TINY_RANDOM!r}, or a random-weight shape of bench real "
                        f"({', '.join(MODEL_NAMES)}; a shape name wins over a directory of that name)")
    g.add_argument("--draft", default=None, metavar="DIR|ngram",
                   help=f"the draft checkpoint (with a --model DIR), or {NGRAM_DRAFT!r} (prompt lookup, any model); "
                        "a shape and tiny-random build their own draft")
    add_ngram_flags(g)
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights and KV (default float32 for a directory and tiny-random, as serve; bfloat16 for a "
                        "shape, as bench real)")
    g.add_argument("--eps", type=real_in(0.0, 1.0), default=None,
                   help=f"a shape's acceptance knob ε, as bench real's (default {DEFAULT_EPS})")
    g.add_argument("--batch", type=int_in(1, 65536), default=64, help="batch slots")
    g.add_argument("-k", type=int_in(1, MAX_K), default=4, help="drafts per round")
    g.add_argument("-m", "--rounds", type=int_in(1, 1024), default=8, help="rounds per burst")
    g.add_argument("--capacity", type=int_in(1, 2**31 - 1), default=None,
                   help="KV entries per slot (default --prompt-max + --output-max)")
    g.add_argument("--prefill-chunk", type=int_in(1, 2**31 - 1), default=None, metavar="N",
                   help="the server prefills at most N prompt tokens per burst boundary (default: whole prompts)")
    g.add_argument("--prefill-warmup", type=int_in(0, 65536), default=None, metavar="ROWS",
                   help="the server captures its prefill buckets of up to ROWS prompts before the runs (default: "
                        "serve's; 0: off, to see a cold server)")
    g.add_argument("--admission", choices=ADMISSION_MODES, default=None,
                   help="the server's --admission (before or after refilling the queue of bursts; default auto)")
    g.add_argument("--device-exit", choices=tuple(DEVICE_EXIT_FLAGS), default=None,
                   help="the server's --device-exit (bursts that end at the round where a request arrives; default off)")
    g.add_argument("--max-queue", type=int_in(1, 1_000_000), default=256,
                   help="requests waiting for a slot before the server answers 429")
    g.add_argument("--rates", default=None,
                   help="comma list of Poisson rates (requests/s), or 'auto': 1, 2, 4, ... until output tokens/s "
                        f"grows < 5%% or E2E p99 passes 10x the first rate's (default {DEFAULT_RATES})")
    g.add_argument("--duration", type=real_in(0.1, 3600.0), default=20.0, help="seconds of arrivals per rate")
    g.add_argument("--burst", type=int_in(0, 100_000), default=0, help="extra requests sent at once in each run")
    g.add_argument("--burst-prompt", type=int_in(1, 1_000_000), default=None, metavar="N",
                   help="the burst's requests have N-token prompts (default: drawn like the others), e.g. 8192 "
                        "to see long prefills arrive while the other streams decode (pair with --prefill-chunk)")
    g.add_argument("--burst-at", type=real_in(0.0, 3600.0), default=None,
                   help="seconds into each run the burst is sent (default half of --duration)")
    g.add_argument("--length-dist", choices=DIST_KINDS, default="lognormal",
                   help="prompt and output lengths: uniform in [min, max], or lognormal of the given mean, "
                        "clipped to [min, max]")
    g.add_argument("--length-sigma", type=real_in(1e-3, 10.0), default=0.5, help="lognormal shape (sigma of log)")
    for which, (mean, lo, hi) in DEFAULT_LENGTHS.items():
        g.add_argument(f"--{which}-mean", type=real_in(1.0, 1e6), default=None,
                       help=f"lognormal mean {which} tokens (default {mean:g}; not with uniform)")
        g.add_argument(f"--{which}-min", type=int_in(1, 1_000_000), default=lo, help=f"fewest {which} tokens")
        g.add_argument(f"--{which}-max", type=int_in(1, 1_000_000), default=hi, help=f"most {which} tokens")
    g.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0, help="the schedule's and a shape's weights' seed")
    g.add_argument("--plot", type=writable_file, default=None, metavar="FILE.png",
                   help="latency against throughput, one point per rate (needs matplotlib: graphburst[bench])")


def _dist(args, which: str) -> LengthDist:
    mean = getattr(args, f"{which}_mean")
    if args.length_dist == "uniform" and mean is not None:
        raise FlagError(f"--{which}-mean", "a uniform length has mean (min + max) / 2; drop it or use "
                                           "--length-dist lognormal")
    if args.length_dist == "lognormal" and mean is None:
        mean = DEFAULT_LENGTHS[which][0]
    try:
        return LengthDist(args.length_dist, getattr(args, f"{which}_min"), getattr(args, f"{which}_max"),
                          mean, args.length_sigma)
    except ValueError as exc:
        raise FlagError(f"--{which}-min" if "min <= max" in str(exc) else f"--{which}-mean", str(exc)) from None


def _rates(text: str) -> list[float] | None:
    if text == "auto":
        return None
    try:
        rates = float_list(text)
    except ValueError:
        rates = []
    if not rates or not all(0 < r < 1e6 for r in rates):
        raise FlagError("--rates", f"a comma list of rates > 0 (requests/s) or 'auto', got {text!r}")
    return rates


#: open-loop flags with no default, refused without --model (each would be dropped)
ONLY_WITH_MODEL = ("--draft", "--dtype", "--eps", "--capacity", "--rates", "--burst-at", "--prompt-mean",
                   "--output-mean", "--plot", "--ngram-min", "--ngram-max", "--prefill-warmup", "--admission",
                   "--device-exit")


def refuse_without_model(args) -> None:
    """The closed-loop benchmark (no ``--model``) takes none of :data:`ONLY_WITH_MODEL`."""
    for flag in ONLY_WITH_MODEL:
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise FlagError(flag, "applies to the open-loop benchmark only (--model ... --http)")


def check_args(args) -> None:
    """The open-loop flags, before any work (FlagError names the flag); fills ``args.load``."""
    if not args.http:
        raise FlagError("--model", "the open-loop benchmark runs over HTTP; add --http")
    missing = [m for m in ("aiohttp", "prometheus_client", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        raise FlagError("--http", f"needs {', '.join(missing)} (pip install \"graphburst[serve]\")")
    if args.plot:
        try:
            import matplotlib  # noqa: F401 - only whether it imports
        except ImportError:
            raise FlagError("--plot", "needs matplotlib, which is not installed (pip install \"graphburst[bench]\")") \
                from None
    check_ngram_flags(args)
    prompt, output = _dist(args, "prompt"), _dist(args, "output")
    rates = _rates(DEFAULT_RATES if args.rates is None else args.rates)
    need = max(prompt.hi, args.burst_prompt or 0) + output.hi
    capacity = need if args.capacity is None else args.capacity
    if capacity < need:
        longest = "--burst-prompt" if (args.burst_prompt or 0) > prompt.hi else "--prompt-max"
        raise FlagError("--capacity", f"{capacity} KV entries cannot hold {longest} {need - output.hi} + --output-max "
                                      f"{output.hi} = {need}")
    burst_at = args.duration / 2 if args.burst_at is None else args.burst_at
    if args.burst and burst_at > args.duration:
        raise FlagError("--burst-at", f"{burst_at:g} s is past --duration {args.duration:g} s")
    shape = args.model in MODEL_NAMES
    if args.eps is not None and not shape:
        raise FlagError("--eps", f"sets a random shape's acceptance ({', '.join(MODEL_NAMES)}), not {args.model!r}")
    if shape and args.draft not in (None, NGRAM_DRAFT):
        raise FlagError("--draft", f"a shape builds its own draft (or use {NGRAM_DRAFT!r}), got {args.draft!r}")
    server = dict(model=args.model, draft=args.draft, shape=shape, backend=args.backend, batch=args.batch, k=args.k,
                  m=args.rounds, capacity=capacity, max_queue=args.max_queue, ngram_min=args.ngram_min,
                  ngram_max=args.ngram_max, prefill_chunk=args.prefill_chunk, prefill_warmup=args.prefill_warmup,
                  admission=args.admission, device_exit=args.device_exit or "off", dtype=args.dtype or ("bfloat16" if shape else "float32"),
                  eps=(DEFAULT_EPS if args.eps is None else args.eps) if shape else None, seed=args.seed,
                  checks=CHECK_REQUESTS,
                  prompt=dataclasses.asdict(prompt), output=dataclasses.asdict(output),
                  served_name=f"random-{args.model}" if shape else None)
    if not shape:  # the ServeConfig the child builds, checked here so a bad field is one line naming its flag
        try:
            ServeConfig(backend=args.backend, batch=args.batch, k=args.k,
                        rounds=args.rounds, capacity=capacity, max_queue=args.max_queue, model=args.model,
                        draft=args.draft, dtype=server["dtype"], ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                        prefill_chunk=args.prefill_chunk, prefill_warmup=args.prefill_warmup,
                        admission=args.admission or "auto", device_exit=args.device_exit or "off",
                        http="127.0.0.1:0")
        except ConfigError as exc:
            flag = {"rounds": "--rounds", "k": "-k"}.get(exc.field, "--" + exc.field.replace("_", "-"))
            raise FlagError(flag, exc.why) from None
    burst_prompt = None if args.burst_prompt is None else LengthDist("uniform", args.burst_prompt, args.burst_prompt)
    args.load = dict(server=server, rates=rates, prompt=prompt, output=output, burst_at=burst_at,
                     burst_prompt=burst_prompt)


def run_rate(url: str, rate: float, vocab: int, args, load: dict) -> dict:
    """One open-loop run at ``rate``: its table row."""
    from .load_stats import server_window, summarize
    from .load_client import run_open_loop
    from .serve_http import scrape

    arrivals = schedule(rate=rate, duration=args.duration, burst=args.burst, burst_at=load["burst_at"],
                        prompt=load["prompt"], output=load["output"], vocab=vocab, seed=args.seed,
                        burst_prompt=load["burst_prompt"])
    before = scrape(url)
    records, wall, lag = asyncio.run(run_open_loop(url, arrivals, deadline_s=args.duration + args.http_timeout))
    after = scrape(url)
    return summarize(records, rate=rate, duration=args.duration, wall=wall) | server_window(before, after) | dict(
        burst=args.burst, client_lag_ms=lag * 1e3) | split_of(records, load["access_log"])


def split_of(records: list, path: str) -> dict:
    """TTFT's parts of ``records`` from the server's access log at ``path`` (load_stats.ttft_split).

    The server writes a request's line just after its last chunk went out, so a client can see
    the end of a stream a moment before its line is there: read again for a short while.
    """
    from .load_stats import read_access_log, ttft_split

    want = sum(1 for r in records if r.ok)
    deadline = time.monotonic() + ACCESS_LOG_WAIT_S
    while True:
        split = ttft_split(records, read_access_log(path))
        if split["ttft_split_requests"] >= want or time.monotonic() > deadline:
            return split
        time.sleep(ACCESS_LOG_POLL_S)


def check_over_http(url: str, check: list, timeout_s: float) -> list[str]:
    """The check requests ``[[prompt, max_tokens, in-process tokens], ...]`` over HTTP: the mismatches."""
    from .load_client import run_requests
    from .load_schedule import Arrival

    # One at a time, as load_server.check_in_process decodes them: a request prefilled alone on
    # both sides, so the comparison is exact in bf16 too (a prefill's numerics depend on the rows
    # prefilled with it: they set its padded length and GEMM shapes, which can flip a near-tie).
    records = [asyncio.run(run_requests(url, [Arrival(0.0, p, n, False)], timeout_s=timeout_s))[0]
               for p, n, _ in check]
    return mismatches(records, [want for _, _, want in check])


def mismatches(records: list, expected: list) -> list[str]:
    """One line per check request whose HTTP answer failed or differs from the in-process tokens."""
    bad = []
    for i, (rec, want) in enumerate(zip(records, expected, strict=True)):
        if rec.error is not None:
            bad.append(f"check request {i}: {rec.error}")
        elif rec.tokens != want:
            at = next((j for j, (a, b) in enumerate(zip(rec.tokens, want)) if a != b), min(len(rec.tokens), len(want)))
            bad.append(f"check request {i}: HTTP tokens differ from the in-process loop's at token {at} "
                       f"({len(rec.tokens)} vs {len(want)} tokens)")
    return bad


def warm_up(url: str, vocab: int, args, load: dict) -> str | None:
    """Fill every slot once, untimed (prefills of many lengths, every slot's first tenant); None or what failed."""
    from .load_client import run_open_loop
    from .load_schedule import warmup

    arrivals = warmup(min(args.batch, args.max_queue), prompt=load["prompt"], output=load["output"], vocab=vocab,
                      seed=args.seed)
    records, _, _ = asyncio.run(run_open_loop(url, arrivals, deadline_s=args.http_timeout))
    failed = [r.error for r in records if not r.ok]
    return f"{len(failed)} of {len(records)} requests: {failed[0]}" if failed else None


def _sweep(url: str, vocab: int, args, load: dict, console: Console) -> tuple[list[dict], str | None]:
    """The rows of every rate run, and why the sweep stopped early (None: it did not)."""
    import httpx

    rows, rates = [], load["rates"]
    rate = rates[0] if rates else AUTO_START
    while True:
        try:
            row = run_rate(url, rate, vocab, args, load)
        except httpx.HTTPError as exc:  # /metrics unreachable: the server is gone; keep the rates measured
            return rows, f"the server stopped answering at rate {rate:g}/s: {type(exc).__name__}: {exc}"
        rows.append(row)
        console.print(f"rate {rate:g}/s: {row['completed']}/{row['requests']} requests, "
                      f"{row['output_tokens_per_s']:.0f} output tokens/s, client lag {row['client_lag_ms']:.1f} ms")
        if rates is not None:
            if len(rows) == len(rates):
                return rows, None
            rate = rates[len(rows)]
            continue
        if len(rows) == AUTO_STEPS or _saturated(rows):
            return rows, None
        rate *= 2


def _saturated(rows: list[dict]) -> bool:
    """``--rates auto``'s stop: throughput grew < 5%, latency blew up, or requests failed."""
    last = rows[-1]
    if last["errors"] or last["rejected_429"]:
        return True
    if len(rows) > 1 and (last["output_tokens_per_s"] or 0) < AUTO_GROWTH * (rows[-2]["output_tokens_per_s"] or 0):
        return True
    first = rows[0]["e2e_ms"]["p99"]
    return first is not None and last["e2e_ms"]["p99"] is not None and last["e2e_ms"]["p99"] > AUTO_BLOWUP * first


def _fail(why: str) -> int:
    print(f"graphburst bench serve: {' '.join(why.split())}", file=sys.stderr)
    return 1


def run(args, console: Console, backend) -> int:
    """Start the server, check it, warm it up, sweep the rates; write the table, JSON and plot."""
    import json

    from .load_report import plot, table
    from .load_server import CHECK_PREFIX
    from .serve_http import Server

    load = args.load
    # The server's access log: TTFT's parts per request (run_rate), read from this file
    fd, access_log = tempfile.mkstemp(prefix="graphburst-bench-access-", suffix=".jsonl")
    os.close(fd)
    load = dict(load, access_log=access_log)
    server = dict(load["server"], backend=backend.name)
    try:
        srv = Server([], argv=[SERVER_MODULE, json.dumps(dict(server, access_log=access_log))],
                     start_timeout=START_TIMEOUT_S)
    except RuntimeError as exc:
        os.unlink(access_log)
        return _fail(str(exc))
    try:
        line = next((x for x in srv.preamble if x.startswith(CHECK_PREFIX)), None)
        if line is None:
            return _fail(f"the server printed no check line: {srv.preamble[-3:]}")
        info = json.loads(line[len(CHECK_PREFIX):])
        bad = check_over_http(srv.url, info["check"], args.http_timeout)
        if bad:
            return _fail("FAILED correctness (nothing timed): " + "; ".join(bad))
        bad = warm_up(srv.url, info["vocab"], args, load)
        if bad:
            return _fail(f"the warm-up failed (nothing timed): {bad}")
        rows, stopped = _sweep(srv.url, info["vocab"], args, load, console)
    finally:
        rc = srv.stop()
        os.unlink(access_log)
    title = _title(args, load, backend)
    checked = sum(len(t) for _, _, t in info["check"])
    # Written whatever happened to the server: the rates measured are kept, and the meta says what went wrong.
    write_results(console, args.json, backend=backend, tables=[table(rows, title)], results=rows,
                  mode="open-loop", server=server, rates=load["rates"] or "auto", duration_s=args.duration,
                  burst=args.burst, burst_at_s=load["burst_at"], prompt_lengths=load["prompt"].describe(),
                  output_lengths=load["output"].describe(), vocab=info["vocab"],
                  check=f"{len(info['check'])} requests ({checked} tokens) over HTTP equal the in-process loop's",
                  warmup=f"{min(args.batch, args.max_queue)} requests at once, untimed", stopped=stopped,
                  server_exit=rc,
                  rules="ITL: a chunk's gap once, its other tokens 0; TPOT: (last - first token) / (tokens - 1); "
                        "GPU idle: idle / (busy + idle) seconds of the run, gaps while a request held a slot")
    if args.plot and rows:
        plot(rows, args.plot, title)
        console.print(f"plot written to {args.plot}")
    if stopped:
        return _fail(stopped)
    if rc != 0:
        return _fail(f"the server exited with {rc} after SIGTERM")
    return 0


def _shape_draft(s) -> str:
    """How a random shape's draft is made: its first blocks, or a draft of its own shape."""
    if s["shape"]:
        from .real_models import MODELS  # torch: only for a random shape

        spec = MODELS[s["model"]]
        return "self-draft" if spec.draft_cfg is None else f"a {spec.draft_cfg.hidden_size}-wide draft of its own"
    return "self-draft" if s["model"] == TINY_RANDOM else "?"


def _title(args, load, backend) -> str:
    s = load["server"]
    draft = s["draft"] or _shape_draft(s)
    where = "GPU" if backend.is_gpu else "CPU reference"
    model = os.path.basename(os.path.normpath(s["model"]))
    return (f"open loop: {model} + {draft}, {s['dtype']}, B={s['batch']}, k={s['k']}, M={s['m']}; "
            f"Poisson {args.duration:g} s per rate" + (f" + burst of {args.burst} at {load['burst_at']:g} s" if
                                                        args.burst else "")
            + f"; prompts {load['prompt'].describe()}, outputs {load['output'].describe()}; {where}")

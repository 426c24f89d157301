"""``graphburst serve``: serve JSONL requests through one captured burst graph.

Each input line is ``{"id": "r1", "prompt": [12, 7, 99], "max_new_tokens": 64, "eos": 2}``
(``eos`` and ``id`` optional; ``temperature``, ``top_k``, ``top_p`` and ``seed`` are the
request's sampling settings, temperature > 0 needing ``--sampling``; any other key is a
per-request model option, such as the stub draft's ``accept_prob``, and a key no model
claims is an error). Input is served as it arrives:
a reader thread hands lines over one at a time, so a request from a pipe starts before
EOF, and its record is written as soon as it finishes. Every non-blank line yields
exactly one output line carrying its ``line`` number: the request's record (``id``,
``tokens``, ``finish_reason``, timings, and ``error`` if the loop had to give up on it),
or ``{"error": ..., "line": N}`` for a line that could not be served. A bad line
(bad JSON or UTF-8, nesting too deep, a duplicate id in flight...) costs only itself.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from .backend import BACKEND_NAMES, get_backend
from .cli_args import FlagError, check_backend, check_kv_memory, int_in, readable_file, real_in, same_file, \
    writable_file
from .constants import MAX_K
from .models.stubs import stub_pair
from .serving.loop import ENGINE_MODES, LOG_RETIRED, Request, ServeLoop
from .validate import parse_json

STUB_DEFAULTS = {"vocab": 32000, "layers": 4, "accept": 0.7, "cost_us": 0.0}
TINY_RANDOM = "tiny-random"  # --model value: checkpoint.tiny_random_pair, no files
SAMPLING_FIELDS = {"temperature", "top_k", "top_p", "seed"}  # Request's sampling settings, not model options
FIELDS = {"prompt", "max_new_tokens", "eos", "id"} | SAMPLING_FIELDS  # every other key is a model option
MAX_ERROR_CHARS = 300  # an error record stays one short line, whatever the input was
LIVE_PERIOD_S = 0.25  # the rich Live view is redrawn at most this often (not once per burst)
READ_CHUNK = 1 << 16  # bytes per read of the requests
STOP_POLL_S = 0.5  # an idle JSONL loop wakes this often to see a stop signal (a blocking get would not)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve JSONL requests (file or stdin) over one captured burst graph")
    p.add_argument("--requests", type=readable_file, default="-", help="JSONL file, '-' for stdin")
    p.add_argument("--output", type=writable_file, default="-", help="JSONL results, '-' for stdout")
    p.add_argument("--backend", choices=BACKEND_NAMES, default="auto",
                   help="cupy (GPU), numpy (CPU reference) or auto (cupy when a GPU is usable)")
    p.add_argument("--engine", choices=ENGINE_MODES, default="graph",
                   help="graph: one captured burst graph per burst; eager_sync: eager bursts with a host sync "
                        "per round (for comparison)")
    p.add_argument("--batch", type=int_in(1, 65536), default=64, help="batch slots")
    p.add_argument("-k", type=int_in(1, MAX_K), default=4, help="drafts per round")
    p.add_argument("-m", "--rounds", type=int_in(1, 1024), default=8, help="rounds per burst")
    p.add_argument("--capacity", type=int_in(1, 2**31 - 1), default=4096, help="KV entries per slot")
    # Stub-only flags default to None so that giving one with --model can be refused.
    s = p.add_argument_group("stub models (the default; not with --model)")
    s.add_argument("--vocab", type=int_in(2, 2**31 - 1), default=None, help=f"default {STUB_DEFAULTS['vocab']}")
    s.add_argument("--layers", type=int_in(1, 4096), default=None,
                   help=f"target KV layers (default {STUB_DEFAULTS['layers']})")
    s.add_argument("--accept", type=real_in(0.0, 1.0), default=None,
                   help=f"default draft agreement probability (default {STUB_DEFAULTS['accept']})")
    s.add_argument("--cost-us", type=real_in(0.0, 1e6), default=None,
                   help=f"emulated model time per call (default {STUB_DEFAULTS['cost_us']})")
    m = p.add_argument_group("Llama models (graphburst.models.checkpoint)")
    m.add_argument("--model", default=None, metavar="DIR",
                   help=f"target checkpoint directory (Hugging Face Llama), or {TINY_RANDOM!r} (a small random "
                        "pair built in memory)")
    m.add_argument("--draft", default=None, metavar="DIR", help="draft checkpoint directory (with a --model DIR)")
    m.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="weights and KV (default float32)")
    m.add_argument("--p-min", type=real_in(0.0, 1.0), default=None,
                   help="draft: stop drafting below this probability (default 0)")
    p.add_argument("--sampling", action="store_true",
                   help="decode with speculative rejection sampling, so requests may set temperature > 0")
    p.add_argument("--no-pipeline", action="store_true",
                   help="graph engine: drain each burst before enqueueing the next")
    p.add_argument("--live", action="store_true", help="show the live view even when stderr is not a terminal")
    # --- HTTP mode (graphburst/http_server.py) ---
    h = p.add_argument_group("HTTP server (--http)")
    h.add_argument("--http", nargs="?", const="127.0.0.1:8000", default=None, metavar="[HOST:]PORT",
                   help="serve the OpenAI completions API over HTTP instead of JSONL (default 127.0.0.1:8000)")
    h.add_argument("--max-queue", type=int_in(1, 1_000_000), default=256, help="waiting requests before 429")
    h.add_argument("--drain-timeout", type=real_in(0.0, 3600.0), default=10.0,
                   help="seconds to finish requests on SIGTERM")
    h.add_argument("--header-timeout", type=real_in(0.1, 3600.0), default=30.0,
                   help="seconds a connection may stay idle, or take to send a whole request head")
    h.add_argument("--body-timeout", type=real_in(0.1, 3600.0), default=30.0,
                   help="seconds a request may take to send its body")
    h.add_argument("--tokenizer", default=None, metavar="DIR", help="model dir with tokenizer.json (text I/O)")
    h.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default graphburst-stub, or the --model directory's name)")
    # --- tensor-parallel serving (graphburst/parallel/serve_tp.py, docs/parallel.md) ---
    t = p.add_argument_group("tensor-parallel serving (torchrun --nproc_per_node N -m graphburst serve --tp N)")
    t.add_argument("--tp", type=int_in(1, 64), default=1,
                   help="tensor-parallel ranks: rank 0 serves, every rank steps in lockstep (--model only)")
    t.add_argument("--draft-mode", choices=("sharded", "replicated"), default="sharded",
                   help="the draft sharded like the target (default: the ranks agree by construction), or whole "
                        "on every rank (docs/parallel.md)")
    t.add_argument("--dist-timeout", type=real_in(1.0, 3600.0), default=60.0,
                   help="seconds before a collective, a plan broadcast or a drain gives up on another rank")


def check_args(args) -> None:
    """Checks across flags, before anything is opened (FlagError names the flag).

    Fills in the stub defaults without ``--model``; with it, a stub-only flag given
    explicitly is an error (the checkpoint decides the vocabulary and layers, and a real
    draft has no agreement probability or emulated cost).
    """
    check_backend(args.backend)
    if args.tp > 1:  # tensor-parallel serving (graphburst/parallel/serve_tp.py)
        from .parallel import serve_tp

        serve_tp.check_args(args)
    if same_file(args.requests, args.output):
        raise FlagError("--output", f"{args.output!r} is the --requests file; writing there would empty it")
    if args.model is None:
        for flag in ("--draft", "--dtype", "--p-min"):
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                raise FlagError(flag, "applies to --model only (the stub models are the default)")
        for name, value in STUB_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        check_kv_memory(args.batch, args.capacity, args.layers + 1)
        return
    for name in STUB_DEFAULTS:
        if getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            raise FlagError(flag, f"applies to the stub models only; with --model the checkpoint sets the model "
                                  f"(drop {flag})")
    if args.model == TINY_RANDOM:
        if args.draft is not None:
            raise FlagError("--draft", f"--model {TINY_RANDOM} builds its own draft; drop --draft")
    elif args.draft is None:
        raise FlagError("--draft", f"--model {args.model!r} needs --draft DIR (a smaller checkpoint with the same "
                                   "vocabulary)")
    else:
        for flag, path in (("--model", args.model), ("--draft", args.draft)):
            if not os.path.isdir(path):
                raise FlagError(flag, f"{path!r} is not a directory")
        if args.tokenizer is None and os.path.isfile(os.path.join(args.model, "tokenizer.json")):
            args.tokenizer = args.model  # the model directory's own tokenizer, unless told otherwise
    args.dtype = args.dtype or "float32"
    args.p_min = 0.0 if args.p_min is None else args.p_min


def model_name(args) -> str:
    """The name the model is served as: ``--served-model-name``, else taken from ``--model``."""
    if args.served_model_name is not None:
        return args.served_model_name
    if args.model is None:
        return "graphburst-stub"
    return TINY_RANDOM if args.model == TINY_RANDOM else os.path.basename(os.path.normpath(args.model))


def build_loop(args, backend) -> ServeLoop:
    """The models and the loop the serve flags describe; the one builder of JSONL and HTTP serving.

    Stubs by default; ``--model DIR --draft DIR`` loads a Llama pair with
    :func:`graphburst.models.checkpoint.load_pair` (torch on the backend's device: the GPU the
    cupy backend uses, else the CPU), ``--model tiny-random`` builds
    :func:`graphburst.models.checkpoint.tiny_random_pair`.

    Raises
    ------
    ValueError, OSError, ImportError
        A checkpoint that cannot be loaded (the message names the file or key).
    """
    if args.model is None:
        target, draft = stub_pair(args.batch, args.vocab, args.layers, 1, args.capacity, accept_prob=args.accept,
                                  cost_ns=int(args.cost_us * 1000), backend=backend)
    else:
        from .models import checkpoint  # torch and safetensors: only when a model is asked for

        kw = dict(batch=args.batch, capacity=args.capacity, backend=backend, dtype=args.dtype, p_min=args.p_min)
        if args.model == TINY_RANDOM:
            target, draft = checkpoint.tiny_random_pair(**kw)
        else:
            target, draft = checkpoint.load_pair(args.model, args.draft, **kw)
    return ServeLoop(target, draft, k=args.k, m_rounds=args.rounds, engine=args.engine,
                     pipelined=not args.no_pipeline, sampling=getattr(args, "sampling", False))


def parse_line(text: str) -> Request:
    """A request from one JSONL line; raises ValueError/TypeError naming what is wrong."""
    obj = parse_json(text)
    if not isinstance(obj, dict):
        raise TypeError(f"a request must be a JSON object, got {type(obj).__name__}")
    missing = [f for f in ("prompt", "max_new_tokens") if f not in obj]
    if missing:
        raise ValueError(f"missing field(s): {', '.join(missing)}")
    # Other keys are per-request model options, e.g. the stub draft's accept_prob and
    # seed; the models refuse any key they do not claim, so a typo is an error record.
    options = {k: v for k, v in obj.items() if k not in FIELDS}
    req = Request(**{k: v for k, v in obj.items() if k in FIELDS}, options=options or None)
    if req.id is not None and (not isinstance(req.id, (str, int)) or isinstance(req.id, bool)):
        raise TypeError(f"id must be a string or an integer, got {type(req.id).__name__}")
    return req  # an int id stays an int: 7 and "7" are two ids, written back as given


def _error_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, (ValueError, TypeError)):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _record(state) -> dict:
    rec = {"id": state.request.id, "line": state.line, "tokens": state.tokens,
           "finish_reason": state.finish_reason, **state.stats()}
    if state.error is not None:
        rec["error"] = state.error
    if state.sampling is not None and state.sampling.temperature > 0:
        rec["seed"] = state.sampling.seed  # drawn at random when the line had none: replays the request
    return rec


_EOF = object()


def _read_lines(fd: int, lines: queue.Queue) -> None:
    """Reader thread: put ``(line number, bytes)`` per line as it arrives, then _EOF.

    Reads the descriptor with ``os.read``, not through a buffered reader: a stop signal
    ends the server while this thread still waits on an open stdin, and a thread blocked
    inside a buffered reader holds its lock, which aborts the interpreter at exit.
    """
    n, tail = 0, b""
    try:
        while chunk := os.read(fd, READ_CHUNK):
            *whole, tail = (tail + chunk).split(b"\n")
            for raw in whole:
                n += 1
                lines.put((n, raw))
        if tail:
            lines.put((n + 1, tail))
    except Exception as exc:  # noqa: BLE001 - reported by the main thread
        lines.put(exc)
    finally:
        lines.put(_EOF)


def _view(loop: ServeLoop) -> Table:
    s = loop.stats()
    table = Table(title="graphburst serve")
    for col in ("active slots", "queued", "bursts", "tokens", "tokens/s", "GPU idle"):
        table.add_column(col, justify="right")
    idle = "-" if s["gpu_idle_fraction"] is None else f"{s['gpu_idle_fraction']:.1%}"
    table.add_row(str(s["active_slots"]), str(s["queued"]), str(s["bursts"]), str(s["tokens"]),
                  f"{s['tokens_per_s']:.0f}", idle)
    return table


def run(args, console: Console, loop: ServeLoop | None = None) -> int:
    """Serve JSONL or HTTP; ``loop``: one built by the caller (rank 0 of ``--tp``, parallel/serve_tp.py)."""
    if args.tp > 1 and loop is None:  # every rank of a tensor-parallel server; rank 0 comes back here
        from .parallel import serve_tp

        return serve_tp.run(args, console)
    if args.http:  # --- HTTP mode: aiohttp and prometheus_client come with the [serve] extra ---
        try:
            from .serving import http as http_server
        except ImportError as exc:
            print(f"graphburst serve --http: {exc}; install graphburst[serve]", file=sys.stderr)
            return 2
        return http_server.run(args, console, loop=loop)
    try:
        backend = get_backend(args.backend) if loop is None else loop.dec.backend
        loop = build_loop(args, backend) if loop is None else loop
    except (ValueError, TypeError, RuntimeError, OSError, ImportError) as exc:
        print(f"graphburst serve: {_error_text(exc)}", file=sys.stderr)
        return 2
    # A log file gets plain lines: rich would wrap them at 80 columns, mid-phrase.
    err = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, soft_wrap=True, highlight=False)
    if not backend.is_gpu:
        err.print("graphburst serve: no GPU in use; running the numpy reference backend")
    source = sys.stdin.buffer if args.requests == "-" else open(args.requests, "rb")  # noqa: SIM115 - closed below
    sink = sys.stdout if args.output == "-" else open(args.output, "w")  # noqa: SIM115
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(source.fileno(), lines), daemon=True,
                     name="graphburst-serve-reader").start()
    counts = {"lines": 0, "rejected": 0, "served": 0, "failed": 0}
    pending: list = []  # submitted, record not yet written

    def emit(rec: dict) -> None:
        sink.write(json.dumps(rec) + "\n")

    def take(n: int, raw: bytes) -> None:
        if not raw.strip():
            return
        counts["lines"] += 1
        try:
            pending.append(loop.submit(parse_line(raw.decode("utf-8")), line=n))
        except Exception as exc:  # noqa: BLE001 - a bad line costs only itself
            emit({"error": _error_text(exc), "line": n})
            counts["rejected"] += 1

    live = Live(_view(loop), console=err, refresh_per_second=4, transient=False,
                auto_refresh=False) if (err.is_terminal or args.live) else None
    if live:
        live.start()
    eof, read_error = False, None
    loop.log = []  # what each step retired: records are written only then
    next_view = 0.0
    stop = threading.Event()  # SIGTERM/SIGINT: read no more lines, finish every request already read
    restore = _stop_on_signals(stop)
    try:
        while True:
            if stop.is_set() and not eof:
                eof = True
                err.print(f"graphburst serve: stopping; finishing {len(pending)} request(s) already read "
                          f"(a second signal aborts)")
            block = loop.idle  # nothing to serve: wait for the next line
            # (a --tp rank 0 wakes every heartbeat_s to keep its followers' plan wait alive)
            wait = (getattr(loop, "heartbeat_s", None) or STOP_POLL_S) if block else None
            while not eof:
                try:
                    item = lines.get(block=block, timeout=wait)
                except queue.Empty:
                    break
                block = False
                if item is _EOF:
                    eof = True
                elif isinstance(item, Exception):
                    read_error = item
                else:
                    take(*item)
            if not loop.idle:
                loop.step()
            # Per burst only the loop's log is read: pending is scanned when something finished.
            if any(entry[0] is LOG_RETIRED for entry in loop.log):
                still = []
                for s in pending:
                    if s.done:
                        emit(_record(s))
                        counts["failed" if s.error else "served"] += 1
                    else:
                        still.append(s)
                pending[:] = still
                sink.flush()
            loop.log.clear()
            if live and time.monotonic() >= next_view:
                live.update(_view(loop), refresh=True)
                next_view = time.monotonic() + LIVE_PERIOD_S
            if eof and loop.idle and not pending:
                break
    finally:
        restore()
        if live:
            live.update(_view(loop), refresh=True)
            live.stop()
        if source is not sys.stdin.buffer:
            source.close()
        if sink is not sys.stdout:
            sink.close()
    stats = loop.stats()
    err.print(f"served {counts['served']} requests ({counts['rejected']} lines rejected, {counts['failed']} failed) "
              f"in {stats['bursts']} bursts, {stats['tokens']} tokens, {stats['tokens_per_s']:.0f} tokens/s")
    if read_error is not None:
        err.print(f"graphburst serve: reading the requests failed: {_error_text(read_error)}")
        return 1
    # Exit 1 when no line was served: every input line was rejected (or failed).
    return 1 if counts["lines"] and not counts["served"] else 0


def _stop_on_signals(stop: threading.Event):
    """Until the returned undo is called: the first SIGTERM or SIGINT sets ``stop`` (the JSONL
    loop then drains and exits 0), and puts the previous handlers back, so a second one acts
    as before (aborts). Only the main thread may install handlers; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def undo() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def on_signal(signum, frame) -> None:
        stop.set()
        undo()

    for sig in previous:
        signal.signal(sig, on_signal)
    return undo

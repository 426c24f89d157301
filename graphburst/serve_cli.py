"""``graphburst serve``: serve JSONL requests (or HTTP, or ``--tp`` ranks) through one captured burst graph.

This command only turns its flags into a :class:`~graphburst.serving.factory.ServeConfig`
(parse), builds the loop (:func:`~graphburst.serving.factory.build_loop`), runs it
(JSONL: :mod:`graphburst.serving.jsonl`, HTTP: :mod:`graphburst.serving.http`, tensor
parallel: :mod:`graphburst.parallel.serve_tp`) and reports. The JSONL format and the
signals are described in :mod:`graphburst.serving.jsonl` and docs/serving.md.
"""

from __future__ import annotations

import dataclasses
import sys

from rich.console import Console

from .backend import BACKEND_NAMES
from .cli_args import (AUTO, FlagError, add_decode_kernels_flag, add_ngram_flags, check_backend, check_decode_kernels,
                       check_kv_memory, check_ngram_flags, fraction, int_in, int_or_auto, readable_file, real_in,
                       same_file, writable_file)
from .models.ngram import NGRAM_DRAFT
from .constants import DEFAULT_K, MAX_DEPTH, MAX_K
from .models.capacity import DEFAULT_GPU_MEMORY_FRACTION
from .serving.admit import ADMISSION_MODES
from .models.named import NAMED_MODELS
from .serving.factory import DEVICE_EXIT_FLAGS, DEFAULT_PIPELINE_DEPTH, DEFAULT_PREFILL_WARMUP, MIN_CAPACITY, STUB_DEFAULTS, TINY_RANDOM, \
    ConfigError, ServeConfig, build_loop, check_tokenizer_vocab, resolve_capacity, startup_notes
from .serving.jsonl import error_text, stderr_console
from .serving.loop import ENGINE_MODES, ServeLoop

# ServeConfig fields whose flag is not "--" + the field's name with dashes
FIELD_FLAGS = {"k": "-k", "rounds": "--rounds", "pipelined": "--no-pipeline", "logits_fields": "--fields"}
#: What the smallest --capacity holds, said with its range.
CAPACITY_WHY = " (the smallest request: one prompt token plus one new token)"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve JSONL requests (file or stdin) over one captured burst graph")
    p.add_argument("--requests", type=readable_file, default="-", help="JSONL file, '-' for stdin")
    p.add_argument("--output", type=writable_file, default="-", help="JSONL results, '-' for stdout")
    p.add_argument("--backend", choices=BACKEND_NAMES, default="auto",
                   help="cupy (GPU), numpy (CPU reference) or auto (cupy when a GPU is usable)")
    p.add_argument("--engine", choices=ENGINE_MODES, default="graph",
                   help="graph: one captured burst graph per burst; per_round_sync: eager bursts "
                        "with a host sync per round (for comparison)")
    p.add_argument("--batch", type=int_in(1, 65536), default=64, help="batch slots")
    p.add_argument("-k", type=int_in(0, MAX_K), default=None,
                   help=f"drafts per round (default {DEFAULT_K}; 0: plain decoding, no draft, the default for a "
                        f"--model served with no --draft)")
    p.add_argument("-m", "--rounds", type=int_in(1, 1024), default=8, help="rounds per burst")
    p.add_argument("--capacity", type=int_or_auto(MIN_CAPACITY, 2**31 - 1, CAPACITY_WHY), default=4096,
                   help=f"KV entries per slot, at least {MIN_CAPACITY}, or {AUTO!r}: as many as fit the GPU's memory (--gpu-memory-fraction; "
                        "capped by the model's max_position_embeddings)")
    p.add_argument("--gpu-memory-fraction", type=fraction, default=None,
                   help=f"with --capacity {AUTO}: the share of the GPU's total memory this server may hold, in (0, 1] "
                        f"(default {DEFAULT_GPU_MEMORY_FRACTION})")
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
    m.add_argument("--model", default=None, metavar="MODEL",
                   help=f"target checkpoint: a Hugging Face directory, a .gguf file, a named model "
                        f"({', '.join(NAMED_MODELS)}), or {TINY_RANDOM!r} (a small random pair built in memory)")
    m.add_argument("--draft", default=None, metavar="MODEL",
                   help=f"draft checkpoint (a directory or .gguf file with the target's vocabulary), or "
                        f"{NGRAM_DRAFT!r}: prompt lookup, no draft model (with the stubs or any --model); none with --model: "
                        f"plain decoding, one token a round")
    add_ngram_flags(m)
    m.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="weights and KV (default float32)")
    m.add_argument("--p-min", type=real_in(0.0, 1.0), default=None,
                   help="draft: stop drafting below this probability (default 0)")
    add_decode_kernels_flag(m)
    p.add_argument("--prefill-chunk", type=int_in(1, 2**31 - 1), default=None, metavar="N",
                   help="prefill at most N prompt tokens per burst boundary, so a long prompt goes in chunks "
                        "while the other slots keep decoding (default: whole prompts)")
    p.add_argument("--prefill-warmup", type=int_in(0, 65536), default=None, metavar="ROWS",
                   help="before serving, capture the prefill graphs of every bucket of up to ROWS prompts, so no "
                        f"admission pays a bucket's first calls (default {DEFAULT_PREFILL_WARMUP} where prefill graphs "
                        "run: a GPU and Llama models; 0: off)")
    p.add_argument("--sampling", action="store_true",
                   help="decode with speculative rejection sampling, so requests may set temperature > 0")
    p.add_argument("--fields", dest="logits_fields", action="store_true",
                   help="with --sampling: apply the logits processing fields on the device, so requests may set "
                        "logit_bias, presence_penalty, frequency_penalty, repetition_penalty, min_p, min_tokens "
                        "and ignore_eos")
    p.add_argument("--no-pipeline", action="store_true",
                   help="graph engine: drain each burst before enqueueing the next")
    p.add_argument("--pipeline-depth", type=int_in(2, MAX_DEPTH), default=None, metavar="N",
                   help=f"graph engine: bursts kept in flight (default {DEFAULT_PIPELINE_DEPTH}); more gives the host longer to admit requests "
                        "between drains when bursts are short, and makes a new request wait for more queued bursts")
    p.add_argument("--admission", choices=ADMISSION_MODES, default="auto",
                   help="graph engine, pipelined: admit waiting requests before refilling the queue of bursts "
                        "(early: their first burst comes one burst sooner) or after it (late: the GPU keeps a full "
                        "queue while the host admits); auto: early once the queued bursts outlast 4 typical "
                        "admissions' host time, and while a burst is shorter than one, a boundary due within a few bursts "
                        "of an admission waits (up to a typical admission's worth of bursts, at most depth - 1)")
    p.add_argument("--device-exit", choices=tuple(DEVICE_EXIT_FLAGS), default="off",
                   help="graph engine: run each burst's rounds in a conditional WHILE node that ends at the round "
                        "where every slot is done or a request arrives, so a new request waits about one round for "
                        "its prefill instead of the bursts in flight (on: refuse to start where WHILE graphs cannot "
                        "be built; auto: a ladder there; ladder: fixed-length graphs of 1, 2, 4 ... M rounds, each "
                        "burst as long as the queue wants)")
    p.add_argument("--spec-max-batch", type=int_in(0, 65536), default=None, metavar="N",
                   help="switch speculation off (one token a round, no draft accepted) for the rounds in which more "
                        "than N requests are decoding, inside the same graph; requests may also ask for fewer drafts "
                        "(num_speculative_tokens over HTTP, a JSONL line's k). The graph still runs every draft "
                        "step and verifies k + 1 positions: this bounds what a round commits, not what it costs")
    p.add_argument("--live", action="store_true", help="show the live view even when stderr is not a terminal")
    # --- HTTP mode (graphburst/serving/http.py) ---
    h = p.add_argument_group("HTTP server (--http)")
    h.add_argument("--http", nargs="?", const="127.0.0.1:8000", default=None, metavar="[HOST:]PORT",
                   help="serve the OpenAI completions API over HTTP instead of JSONL (default 127.0.0.1:8000)")
    h.add_argument("--max-queue", type=int_in(1, 1_000_000), default=256,
                   help="requests waiting for a batch slot: HTTP answers 429 beyond it, JSONL reads no further ahead")
    h.add_argument("--drain-timeout", type=real_in(0.0, 3600.0), default=10.0,
                   help="seconds to finish requests on SIGTERM")
    h.add_argument("--header-timeout", type=real_in(0.1, 3600.0), default=30.0,
                   help="seconds a connection may stay idle, or take to send a whole request head")
    h.add_argument("--body-timeout", type=real_in(0.1, 3600.0), default=30.0,
                   help="seconds a request may take to send its body")
    h.add_argument("--write-timeout", type=real_in(0.1, 86400.0), default=300.0,
                   help="seconds a stream may wait for a client that does not read; then it is cancelled and closed")
    h.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="text I/O: a directory with tokenizer.json, or a .gguf file (default: the --model's own)")
    h.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default graphburst-stub, or the --model directory's name)")
    # --- HTTP serving on a network (graphburst/serving/network.py; docs/serving.md, "Serving on a network") ---
    n = p.add_argument_group("HTTP server on a network (--http)")
    n.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every /v1 route (repeatable; other processes can read "
                        "a command line: prefer --api-key-file or the GRAPHBURST_API_KEY environment variable)")
    n.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="API keys, one a line (blank lines and # comments skipped)")
    n.add_argument("--metrics-need-key", action="store_true", help="/metrics needs a key too (default: open)")
    n.add_argument("--ssl-certfile", default=None, metavar="FILE", help="PEM certificate chain: serve HTTPS")
    n.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="the certificate's PEM private key")
    n.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN",
                   help="CORS: a browser origin (https://app.example.com) that may call the API (repeatable; "
                        "default none)")
    n.add_argument("--access-log", default=None, metavar="FILE",
                   help="append the access log (one JSON line per request) to FILE (default stderr)")
    n.add_argument("--no-access-log", action="store_true", help="write no access log")
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

    The model rules (stub flags only without ``--model``, ``--draft`` with a checkpoint
    directory...) are the :class:`ServeConfig`'s; its ConfigError is turned into a
    FlagError naming the flag of the field.
    """
    check_backend(args.backend)
    if args.http:  # keys, TLS files, origins and the access log: refused before any group or model
        from .serving import network  # aiohttp: the --http server's own dependency

        try:
            network.check(args)
        except ValueError as exc:
            head, _, why = str(exc).partition(": ")
            flag, _, rest = head.partition(" ")
            raise FlagError(flag, f"{rest}: {why}" if rest else why) from None
    if args.tp > 1:  # tensor-parallel serving (graphburst/parallel/serve_tp.py)
        from .parallel import serve_tp

        serve_tp.check_args(args)
    if same_file(args.requests, args.output):
        raise FlagError("--output", f"{args.output!r} is the --requests file; writing there would empty it")
    if not args.http:  # started with <&- or >&-: say so now, not with a traceback later
        for flag, stream, name in (("--requests", sys.stdin, "input"), ("--output", sys.stdout, "output")):
            if getattr(args, flag[2:]) == "-" and stream is None:
                raise FlagError(flag, f"'-' is the standard {name}, which is closed; give {flag} FILE")
    check_ngram_flags(args, parallel=args.tp > 1)
    if args.pipeline_depth is not None and (args.no_pipeline or args.engine != "graph"):
        other = "--no-pipeline" if args.no_pipeline else f"--engine {args.engine}"
        raise FlagError("--pipeline-depth", f"sets the bursts in flight of the pipelined graph engine, which "
                                            f"{other} turns off; leave one of them out")
    config = parse(args)
    check_decode_kernels(config.decode_kernels, args.backend)
    if config.capacity == AUTO:
        from .backend import cuda_available

        if args.backend == "numpy" or not cuda_available():
            raise FlagError("--capacity", f"{AUTO} sizes the KV cache from the GPU's memory, and this run has no GPU "
                                          f"(--backend {args.backend}); give --capacity N")
    elif config.stubs:
        check_kv_memory(config.batch, config.capacity, config.layers + 1)
    try:
        check_tokenizer_vocab(config)
    except ConfigError as exc:
        raise FlagError("--tokenizer", exc.why) from None


def parse(args) -> ServeConfig:
    """The ServeConfig of the serve flags (FlagError naming the flag of a field it refuses)."""
    fields = {f.name for f in dataclasses.fields(ServeConfig)}
    values = {name: getattr(args, name) for name in fields if name != "pipelined"}
    try:
        return ServeConfig(**values, pipelined=not args.no_pipeline)
    except ConfigError as exc:
        flag = FIELD_FLAGS.get(exc.field, "--" + exc.field.replace("_", "-"))
        raise FlagError(flag, exc.why) from None


def build(config: ServeConfig, err: Console) -> ServeLoop | None:
    """The loop (None after a one-line error on stderr); ``--capacity auto`` says what it chose."""
    try:
        config, plan = resolve_capacity(config)
        if plan is not None:
            print(f"graphburst serve: {plan.describe()}", file=sys.stderr, flush=True)
        loop = build_loop(config, log=log_line)
    except (ValueError, TypeError, RuntimeError, OSError, ImportError) as exc:
        print(f"graphburst serve: {error_text(exc)}", file=sys.stderr)
        return None
    if not loop.dec.backend.is_gpu:
        err.print("graphburst serve: no GPU in use; running the numpy reference backend")
    for line in startup_notes(config, loop):
        log_line(line)
    return loop


def log_line(line: str) -> None:
    """One start-up line of the server on stderr."""
    print(f"graphburst serve: {line}", file=sys.stderr, flush=True)


def serve(config: ServeConfig, loop: ServeLoop | None, console: Console) -> int:
    """Run JSONL or HTTP serving over ``loop`` (HTTP builds its own when None); the exit status."""
    if config.http:  # --- HTTP mode: aiohttp and prometheus_client come with the [serve] extra ---
        try:
            from .serving import http as http_server
        except ImportError as exc:
            print(f"graphburst serve --http: {exc}; install graphburst[serve]", file=sys.stderr)
            return 2
        return http_server.run(config, console, loop=loop)
    from .serving import jsonl

    return jsonl.run(config, loop)


def run(args, console: Console) -> int:
    """``graphburst serve``: parse the flags, build the loop, serve, report through the exit status."""
    config = parse(args)
    if config.tp > 1:  # every rank of a tensor-parallel server builds its own loop and serves or follows
        from .parallel import serve_tp

        return serve_tp.run(config, console)
    if config.http:
        return serve(config, None, console)  # the HTTP server builds its loop after checking its own flags
    loop = build(config, stderr_console())
    return 2 if loop is None else serve(config, loop, console)

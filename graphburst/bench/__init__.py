"""The benchmark wing: ``graphburst bench {latency,serve,capture,real}``.

``add_parser(sub)`` adds the ``bench`` command to the CLI's subparsers and ``run(args,
console)`` runs the chosen benchmark. Every benchmark builds its models through
:mod:`.common` (one decoder factory), checks its tokens against the greedy reference
before it times anything, and writes its results through one writer (rich tables +
JSON). ``scripts/compare_latency.py``, ``scripts/serve_bench.py`` and
``scripts/capture_bench.py`` are thin entry points onto the same commands.
"""

from __future__ import annotations

from rich.console import Console

from ..backend import get_backend
from ..cli_args import check_backend
from . import capture
from . import latency
from . import ngram
from . import real
from . import serve

BENCHMARKS = {"latency": latency, "serve": serve, "capture": capture, "real": real, "ngram": ngram}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: latency of every burst mode, the serving loop, capture costs, real models, "
                                       "prompt lookup")
    kinds = p.add_subparsers(dest="benchmark", required=True, metavar="{latency,serve,capture,real,ngram}")
    for module in BENCHMARKS.values():
        module.add_parser(kinds)


def check_args(args) -> None:
    """Flag checks before any work (raise ``cli_args.FlagError``): the backend, then the benchmark's own."""
    check_backend(args.backend)
    own = getattr(BENCHMARKS[args.benchmark], "check_args", None)
    if own is not None:
        own(args)


def run(args, console: Console) -> int:
    return BENCHMARKS[args.benchmark].run(args, console, get_backend(args.backend))

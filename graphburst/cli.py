"""The graphburst command line: demo, bench and serve.

Speculative decoding with a whole M-round burst captured as one CUDA graph (the numpy
reference backend on a machine without a GPU). Each command has its own --help."""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console

from . import bench
from . import demo
from . import serve_cli
from .backend import cuda_available
from .cli_args import FlagError, Parser
from .models.llama_config import CheckpointError


def main(argv=None) -> int:
    parser = Parser(prog="graphburst", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(sub)
    bench.add_parser(sub)
    serve_cli.add_parser(sub)
    args = parser.parse_args(argv)
    commands = {"demo": (demo.check_args, demo.run), "bench": (bench.check_args, bench.run),
                "serve": (serve_cli.check_args, serve_cli.run)}
    check, run = commands[args.command]
    subparser = parser  # the innermost command's parser ("graphburst bench real"), which names it in errors
    while (subs := [a for a in subparser._actions if isinstance(a, argparse._SubParsersAction)]):
        subparser = subs[0].choices[getattr(args, subs[0].dest)]
    try:
        check(args)
    except FlagError as exc:
        subparser.flag_error(exc)
    if getattr(args, "backend", None) == "auto":
        # Resolved here: every command says itself when it runs on the CPU, so the library's
        # fallback RuntimeWarning (for Python callers) would say it a second time.
        args.backend = "cupy" if cuda_available() else "numpy"
    # Wide tables stay readable when the output is a log file rather than a terminal.
    console = Console() if sys.stdout.isatty() else Console(width=220)
    try:
        return run(args, console)
    except CheckpointError as exc:  # a checkpoint that cannot be loaded: one line naming the file and key
        print(f"graphburst {args.command}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (``| head -1``): stop quietly. Point stdout at devnull so
        # the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""The graphburst command line: demo, bench and serve.

Speculative decoding with a whole M-round burst captured as one CUDA graph (the numpy
reference backend on a machine without a GPU). Each command has its own --help."""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console

from . import bench, demo, serve_cli
from .backend import cuda_available
from .cli_args import FlagError, Parser
from .models.llama_config import CheckpointError


def cover_closed_streams() -> None:
    """Point each standard stream the process was started without (``<&-``, ``>&-``, ``2>&-``) at
    ``os.devnull``, so that no file opened later takes its number (a library writing to fd 2 would
    write into ``--output``'s records) and nothing fails writing to it.

    ``sys.stdin`` and ``sys.stdout`` stay None, so a command that needs one (``serve --requests -``,
    ``--output -``) can refuse in one line; ``sys.stderr`` becomes the null device, so start-up lines
    and errors go nowhere instead of failing (or landing on stdout, where ``print(file=None)`` writes).
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the process's stderr until it exits


def main(argv=None) -> int:
    cover_closed_streams()
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
    if sys.stdout is None:  # started with >&-: what the command shows goes nowhere, its work still runs
        console = Console(file=open(os.devnull, "w"), width=220)  # noqa: SIM115 - lives as long as the command
    else:
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
        os.dup2(devnull, 1)
        os.close(devnull)
        return 1


if __name__ == "__main__":
    sys.exit(main())

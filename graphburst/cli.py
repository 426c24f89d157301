"""The ``graphburst`` command line: ``demo``, ``bench`` and ``serve``."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from rich.console import Console
from rich.table import Table

from . import bench, serve_cli
from .backend import BACKEND_NAMES, get_backend
from .cli_args import FlagError, Parser, check_backend, check_kv_memory, int_in, real_in
from .constants import MAX_K
from .burst import MODES, SpecDecoder
from .digest import greedy_reference
from .stubs import stub_pair


def _demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="run a few bursts of the stub models and check them against greedy decoding")
    p.add_argument("--backend", choices=BACKEND_NAMES, default="auto")
    p.add_argument("--batch", type=int_in(1, 4096), default=4)
    p.add_argument("-k", type=int_in(1, MAX_K), default=4, help="drafts per round")
    p.add_argument("-m", "--rounds", type=int_in(1, 1024), default=8, help="rounds per burst")
    p.add_argument("--bursts", type=int_in(1, 10_000), default=4)
    p.add_argument("--layers", type=int_in(1, 4096), default=8, help="target KV layers (every third one absent)")
    p.add_argument("--accept", type=real_in(0.0, 1.0), default=0.7, help="draft agreement probability")
    p.add_argument("--p-min", type=real_in(0.0, 1.0), default=0.05)
    p.add_argument("--vocab", type=int_in(2, 2**31 - 1), default=32000)
    p.add_argument("--mode", choices=MODES + ("graph",), default="pre_issued")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)


def check_demo(args) -> None:
    """Checks across flags, before any work (FlagError names the flag)."""
    check_backend(args.backend)
    capacity = 64 + args.bursts * args.rounds * (args.k + 1)
    if capacity > 2**31 - 1:
        raise FlagError("--bursts", f"{args.bursts} bursts of up to {args.rounds * (args.k + 1)} tokens need "
                                    f"{capacity} KV entries per sequence, over 2**31 - 1")
    check_kv_memory(args.batch, capacity, args.layers + 1, flags=("--batch", "--bursts", "--rounds", "-k"))


def run_demo(args, console: Console) -> int:
    backend = get_backend(args.backend)
    label = "GPU (cupy)" if backend.is_gpu else "CPU numpy reference backend (no GPU used)"
    console.print(f"[bold]graphburst demo[/bold] on {label}")
    rng = np.random.default_rng(args.seed)
    layout = [i % 3 != 2 for i in range(args.layers)]
    capacity = 64 + args.bursts * args.rounds * (args.k + 1)
    target, draft = stub_pair(args.batch, args.vocab, layout, [True, False], capacity, accept_prob=args.accept,
                              p_min=args.p_min, seed=args.seed, backend=backend)
    dec = SpecDecoder(target, draft, k=args.k, m_rounds=args.rounds)
    prompts = [rng.integers(0, args.vocab, int(rng.integers(1, 33))).tolist() for _ in range(args.batch)]
    dec.prefill(prompts)
    runner = dec
    if args.mode == "graph":
        from .capture import BurstGraph

        runner = BurstGraph(dec)
    out = [[] for _ in prompts]
    for _ in range(args.bursts):
        if args.mode == "graph":
            runner.replay()
            tokens = runner.drain()
        else:
            tokens = dec.run_burst(mode=args.mode)
        for b, t in enumerate(tokens):
            out[b] += t.tolist()
    acc = dec.accept_counters()
    table = Table(title=f"k={args.k}, M={args.rounds}, {args.bursts} bursts, mode={args.mode}, backend={backend.name}")
    for col in ("seq", "committed", "accepted drafts", "rounds", "acceptance", "tokens/round", "matches greedy"):
        table.add_column(col, justify="right")
    all_ok = True
    for b in range(args.batch):
        ok = out[b] == greedy_reference(prompts[b], len(out[b]), args.vocab)
        all_ok &= ok
        rounds = int(acc[b, 1])
        table.add_row(str(b), str(len(out[b])), str(int(acc[b, 0])), str(rounds),
                      f"{acc[b, 0] / max(1, rounds * args.k):.2f}", f"{len(out[b]) / max(1, rounds):.2f}",
                      "[green]yes[/green]" if ok else "[red]NO[/red]")
    console.print(table)
    console.print(f"host syncs: {dec.host_syncs} over {dec.bursts} bursts "
                  f"({dec.host_syncs / max(1, dec.bursts):.1f} per burst)")
    return 0 if all_ok else 1


def main(argv=None) -> int:
    parser = Parser(prog="graphburst", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    bench.add_parser(sub)
    serve_cli.add_parser(sub)
    args = parser.parse_args(argv)
    commands = {"demo": (check_demo, run_demo), "bench": (bench.check_args, bench.run),
                "serve": (serve_cli.check_args, serve_cli.run)}
    check, run = commands[args.command]
    subparser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    try:
        check(args)
    except FlagError as exc:
        subparser.flag_error(exc)
    # Wide tables stay readable when the output is a log file rather than a terminal.
    console = Console() if sys.stdout.isatty() else Console(width=220)
    try:
        return run(args, console)
    except BrokenPipeError:
        # The reader went away (``| head -1``): stop quietly. Point stdout at devnull so
        # the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())

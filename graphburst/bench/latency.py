"""``graphburst bench latency``: one burst workload in every mode.

Modes (:class:`~graphburst.bench.modes.Mode`): eager with a host sync every round (a),
eager pre-issued (b), graph replay (c), graph with the gapless drain (d), the
PyTorch-ops peer captured with ``torch.cuda.graph`` (e), the floor: a graph of as many
dependent empty kernel nodes as (c) has (f), and (c) with empty model calls (g). Every
token-producing mode first proves its tokens equal the greedy reference; only then are
modes timed, in rotation (so drift hits all alike), with CUDA events plus host
``perf_counter``, and medians are reported. Without a GPU the numpy backend runs and
every figure is labelled as a CPU reference.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from rich.console import Console
from rich.progress import Progress

from ..engine.decoder import SpecDecoder
from ..cli_args import FlagError, check_kv_memory, int_in, writable_file
from .common import build_decoder, check_greedy, fmt, label, new_table, random_prompts, write_results
from .modes import LABELS, TIMING_ONLY, EmptyModel, Floor, Graph, Mode, Peer, burst_runner

BASE = dict(m=8, k=4, batch=1, layers=4, cost_us=0, accept=0.7)
SWEEPS = dict(m=[1, 2, 4, 8, 16, 32], k=[1, 2, 4, 8], batch=[1, 8, 64, 256], layers=[4, 32, 128, 512],
              cost_us=[0, 10, 100], accept=[0.3, 0.7, 0.95])
QUICK = dict(m=[1, 8, 32], batch=[1, 64], layers=[4, 512])
CHECK_BURSTS = 2  # bursts each mode runs, and checks, before any timing


@dataclasses.dataclass
class Sample:
    burst_us: list = dataclasses.field(default_factory=list)  # device interval, burst start to next start
    exec_us: list = dataclasses.field(default_factory=list)  # device time of the enqueued work alone
    host_us: list = dataclasses.field(default_factory=list)  # host time to enqueue a burst
    tokens: list = dataclasses.field(default_factory=list)  # tokens committed per burst, whole batch


def make_modes(backend, cfg, capacity, with_peer) -> dict:
    modes = {m: burst_runner(build_decoder(backend, cfg, capacity), m.burst_mode) for m in Mode if m.burst_mode}
    if with_peer:
        modes[Mode.TORCH_PEER] = Peer(build_decoder(backend, cfg, capacity))
    if backend.is_gpu:
        modes[Mode.FLOOR] = Floor(backend, modes[Mode.GRAPH].graph.nodes_total)
        stub = build_decoder(backend, cfg, capacity)
        empty = SpecDecoder(EmptyModel(stub.target), EmptyModel(stub.draft), k=cfg["k"], m_rounds=cfg["m"])
        empty.prefill([[1]] * cfg["batch"])
        modes[Mode.GRAPH_EMPTY_MODELS] = Graph(empty, gapless=False)
    return modes


def check_modes(modes, cfg, bursts=CHECK_BURSTS) -> None:
    """Every token-producing mode must continue every prompt greedily (before any timing)."""
    prompts = random_prompts(cfg["batch"])
    for mode, runner in modes.items():
        if mode in TIMING_ONLY:
            continue
        outs = [[] for _ in prompts]
        for _ in range(bursts):
            runner.enqueue()
            for b, t in enumerate(runner.finish()):
                outs[b] += t.tolist()
        check_greedy(f"mode ({mode.value}) {LABELS[mode]}", prompts, outs)


def time_chunk(runner, n, sample: Sample) -> None:
    """Run ``n`` bursts; append each burst's raw timings to ``sample``."""
    gpu = runner.backend.is_gpu
    xp = runner.backend.xp
    starts = [xp.cuda.Event() for _ in range(n + 1)] if gpu else []
    ends = [xp.cuda.Event() for _ in range(n)] if gpu else []
    wall = []
    pending = 0
    for i in range(n):
        if gpu:
            starts[i].record(runner.stream)
        t0 = time.perf_counter()
        runner.enqueue()
        sample.host_us.append((time.perf_counter() - t0) * 1e6)
        if gpu:
            ends[i].record(runner.stream)
        wall.append(t0)
        if runner.pipelined and pending == 0:
            pending = 1
            continue
        toks = runner.finish()
        if toks is not None:
            sample.tokens.append(toks.total)
    if runner.pipelined:
        sample.tokens.append(runner.finish().total)
    if gpu:
        starts[n].record(runner.stream)
        starts[n].synchronize()
        sample.burst_us += [xp.cuda.get_elapsed_time(starts[i], starts[i + 1]) * 1e3 for i in range(n)]
        sample.exec_us += [xp.cuda.get_elapsed_time(starts[i], ends[i]) * 1e3 for i in range(n)]
    else:
        wall.append(time.perf_counter())
        sample.burst_us += [(wall[i + 1] - wall[i]) * 1e6 for i in range(n)]


def measure(cfg, backend, reps, chunk, with_peer) -> dict:
    """Medians of every mode at one config, keyed by the mode letter."""
    ring = cfg["m"] * (cfg["k"] + 1)
    capacity = 16 + (reps * chunk + 8 + CHECK_BURSTS) * ring
    modes = make_modes(backend, cfg, capacity, with_peer)
    check_modes(modes, cfg)
    samples = {mode: Sample() for mode in modes}
    for runner in modes.values():  # warm-up
        time_chunk(runner, 3, Sample())
    for _ in range(reps):
        for mode, runner in modes.items():
            time_chunk(runner, chunk, samples[mode])
    out = {}
    for mode, s in samples.items():
        burst = statistics.median(s.burst_us)
        real = s.tokens and mode not in TIMING_ONLY
        tok = statistics.median([b / max(1, t) for b, t in zip(s.burst_us, s.tokens)]) if real else None
        per_seq_tokens = statistics.mean(s.tokens) / cfg["batch"] if real else None
        exec_us = statistics.median(s.exec_us) if s.exec_us else burst
        out[mode.value] = dict(burst_us=burst, exec_us=exec_us, round_us=burst / cfg["m"], token_us=tok,
                               host_us=statistics.median(s.host_us), syncs=modes[mode].syncs,
                               launches=modes[mode].launches,
                               accepted_per_round=(per_seq_tokens / cfg["m"] - 1) if per_seq_tokens else None)
    graph, floor = out[Mode.GRAPH.value], out.get(Mode.FLOOR.value)
    for r in out.values():
        r["x_graph"] = r["burst_us"] / graph["burst_us"]
        if floor:  # the floor compares device execution time of the same node count
            r["x_floor"] = r["exec_us"] / floor["exec_us"]
    out["_nodes"] = modes[Mode.GRAPH].graph.nodes_total
    return out


def configs(quick: bool):
    sweeps = QUICK if quick else SWEEPS
    seen = set()
    for dim, values in sweeps.items():
        for v in values:
            cfg = dict(BASE, **{dim: v})
            key = tuple(sorted(cfg.items()))
            if key not in seen:
                seen.add(key)
                yield dim, cfg


def sweep_tables(results, title_label, with_peer) -> list:
    shown = [m for m in Mode if m not in (Mode.GRAPH_EMPTY_MODELS,) and (m != Mode.TORCH_PEER or with_peer)]
    c, a, e = Mode.GRAPH.value, Mode.PER_ROUND_SYNC.value, Mode.TORCH_PEER.value
    by_dim = {}
    for r in results:
        by_dim.setdefault(r["sweep"], []).append(r)
    tables = []
    for dim, rows in by_dim.items():
        table = new_table(f"sweep over {dim} (base {BASE}); µs per committed token, medians. {title_label}",
                          [dim, *(f"({m.value}) {LABELS[m]}" for m in shown), "(g)/floor exec", "(c) µs/round",
                           "(c) host µs/burst", "(a)/(c)", "(e)/(c)", "(c) exec/floor"])
        for r in rows:
            res = r["result"]
            cells = [str(r["config"][dim])]
            for m in shown:
                if m.value not in res:
                    cells.append("skipped")
                elif m == Mode.FLOOR:
                    cells.append(f"{fmt(res[m.value]['exec_us'])} µs/burst")
                else:
                    cells.append(fmt(res[m.value]["token_us"]))
            g = res.get(Mode.GRAPH_EMPTY_MODELS.value)
            cells.append(fmt(g.get("x_floor")) if g else "-")
            cells += [fmt(res[c]["round_us"]), fmt(res[c]["host_us"]), fmt(res[a]["token_us"] / res[c]["token_us"]),
                      fmt(res[e]["token_us"] / res[c]["token_us"]) if e in res else "skipped",
                      fmt(res[c].get("x_floor"))]
            table.add_row(*cells)
        tables.append(table)
    return tables


def detail_table(result, title_label):
    table = new_table(f"every metric at the base config {BASE}; {title_label}",
                      ["mode", "µs/round", "µs/token", "burst exec µs", "host µs/burst", "syncs/burst",
                       "launches/burst", "accepted/round", "x graph", "exec x floor"])
    for m in Mode:
        name = f"({m.value}) {LABELS[m]}"
        r = result.get(m.value)
        if r is None:
            table.add_row(name, *(["skipped"] + ["-"] * 8))
            continue
        table.add_row(name, fmt(r["round_us"]), fmt(r["token_us"]), fmt(r["exec_us"]), fmt(r["host_us"]),
                      str(r["syncs"]), str(r["launches"]), fmt(r["accepted_per_round"]), fmt(r["x_graph"]),
                      fmt(r.get("x_floor")))
    return table


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="latency of every burst mode (rich tables + JSON)")
    p.add_argument("--backend", choices=("auto", "cupy", "numpy"), default="auto",
                   help="cupy (GPU), numpy (CPU reference) or auto (cupy when a GPU is usable)")
    p.add_argument("--quick", action="store_true", help="a few configs, under a minute")
    p.add_argument("--reps", type=int_in(1, 1000), default=None,
                   help="rotations over the modes per config (default 5 on a GPU, 1 on the numpy backend)")
    p.add_argument("--chunk", type=int_in(1, 10_000), default=None,
                   help="bursts per mode per rotation (default 20 on a GPU, 3 on the numpy backend)")
    p.add_argument("--json", type=writable_file, default="bench_results.json", help="raw results file")
    p.add_argument("--no-peer", action="store_true", help="skip the PyTorch-ops peer")
    p.add_argument("--sampling", action="store_true",
                   help="instead of the mode sweep: sampling against greedy per round (graph replay, k=4, M=8, "
                        "B=1 and 16; B=1 only on the numpy backend)")
    p.add_argument("--sampling-model", choices=("stub", "tiny", "small", "1b", "kernels"), default="stub",
                   help="with --sampling: the stub pair, a random-weight Llama pair of bench real's shapes, or "
                        "'kernels': each sampling op alone at vocab 32000 and 128256, B=1 and 16")
    p.add_argument("--fields", action="store_true",
                   help="with --sampling (stub pair): the cost per round of the logits processing fields "
                        "(logit_bias, penalties, min_p) in the sampling burst, after a token-for-token check")


def check_args(args) -> None:
    """The KV caches the sweep needs (sized from reps * chunk) must fit before anything runs."""
    reps, chunk = args.reps or 5, args.chunk or 20
    for _, cfg in configs(args.quick):
        capacity = 16 + (reps * chunk + 8 + CHECK_BURSTS) * cfg["m"] * (cfg["k"] + 1)
        if capacity > 2**31 - 1:
            raise FlagError("--reps", f"--reps {reps} x --chunk {chunk} bursts need {capacity} KV entries per "
                                      "sequence, over 2**31 - 1")
        check_kv_memory(cfg["batch"], capacity, cfg["layers"] + 2, flags=("--reps", "--chunk"))


def run_sampling(args, console: Console, backend) -> int:
    """``--sampling``: the sampling-against-greedy table (bench/sampling.py)."""
    from . import sampling

    reps = args.reps if args.reps is not None else (5 if backend.is_gpu else 1)
    bursts = args.chunk if args.chunk is not None else (20 if backend.is_gpu else 1)
    console.print(f"[bold]graphburst bench latency --sampling[/bold]: {label(backend)}")
    if args.sampling_model == "kernels":
        results, table = sampling.run_kernels(backend, reps=reps if backend.is_gpu else 1, label=label(backend),
                                              console=console)
    elif args.fields:
        if args.sampling_model != "stub":
            raise FlagError("--fields", "needs --sampling-model stub (the check decodes the stub target on the host)")
        results, table = sampling.run_fields(backend, reps=reps, bursts=bursts, label=label(backend))
    elif args.sampling_model == "stub":
        results, table = sampling.run_stub(backend, reps=reps, bursts=bursts, label=label(backend))
    else:
        results, table = sampling.run_llama(backend, args.sampling_model, reps=reps, bursts=bursts,
                                            label=label(backend))
    write_results(console, args.json, backend=backend, tables=[table], results=results, reps=reps, chunk=bursts,
                  mode="sampling")
    return 0


def run(args, console: Console, backend) -> int:
    if args.fields and not args.sampling:
        raise FlagError("--fields", "needs --sampling")
    if args.sampling:
        return run_sampling(args, console, backend)
    gpu = backend.is_gpu
    from .torch_peer import torch_available

    with_peer = gpu and not args.no_peer and torch_available()
    # The numpy reference is slow, so its defaults are small; values given on the
    # command line are honoured on either backend.
    reps = args.reps if args.reps is not None else (5 if gpu else 1)
    chunk = args.chunk if args.chunk is not None else (20 if gpu else 3)
    todo = list(configs(args.quick))
    if not gpu:  # the numpy reference is slow at large sizes; keep the fallback short
        todo = [(d, c) for d, c in todo if c["batch"] <= 8 and c["layers"] <= 32 and c["m"] <= 8][:4]
    console.print(f"[bold]graphburst bench latency[/bold]: {label(backend)}; torch peer: "
                  f"{'on' if with_peer else 'skipped (needs torch with CUDA)'}")
    results = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("configs", total=len(todo))
        for dim, cfg in todo:
            results.append(dict(sweep=dim, config=cfg, result=measure(cfg, backend, reps, chunk, with_peer)))
            progress.advance(task)
    base = next((r["result"] for r in results if r["config"] == BASE), results[0]["result"])
    tables = [detail_table(base, label(backend)), *sweep_tables(results, label(backend), with_peer)]
    write_results(console, args.json, backend=backend, tables=tables, results=results, reps=reps, chunk=chunk,
                  quick=bool(args.quick), torch_peer=with_peer, base=BASE)
    return 0

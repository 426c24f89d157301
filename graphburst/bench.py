"""Latency comparison of one burst workload in every mode (``graphburst bench``).

Modes: (a) eager with a host sync every round, (b) eager pre-issued, (c) graph replay,
(d) graph replay with the gapless drain, (e) the PyTorch-ops peer captured with
``torch.cuda.graph``, (f) the floor: a graph of as many dependent empty kernel nodes as
(c) has. Every mode first proves it emits the same tokens; then modes are timed in
rotation (so drift hits all alike) with CUDA events plus host ``perf_counter``, and
medians are reported. Without a GPU the numpy backend runs and every figure is
labelled as a CPU reference.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
import time

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .backend import get_backend
from .burst import SpecDecoder
from .capture import BurstGraph
from .cli_args import FlagError, check_backend, check_kv_memory, int_in, writable_file
from .models import stub_pair

VOCAB = 32000
BASE = dict(m=8, k=4, batch=1, layers=4, cost_us=0, accept=0.7)
SWEEPS = dict(m=[1, 2, 4, 8, 16, 32], k=[1, 2, 4, 8], batch=[1, 8, 64, 256], layers=[4, 32, 128, 512],
              cost_us=[0, 10, 100], accept=[0.3, 0.7, 0.95])
QUICK = dict(m=[1, 8, 32], batch=[1, 64], layers=[4, 512])
MODE_LABELS = {"a": "eager, sync every round", "b": "eager, pre-issued", "c": "graph replay",
               "d": "graph, gapless drain", "e": "torch-ops peer (graph)", "f": "floor: empty nodes",
               "g": "graph, model calls as empty nodes"}
TIMING_ONLY = ("f", "g")  # modes whose tokens are not meaningful


@dataclasses.dataclass
class Sample:
    burst_us: list = dataclasses.field(default_factory=list)  # device interval, burst start to next start
    exec_us: list = dataclasses.field(default_factory=list)  # device time of the enqueued work alone
    host_us: list = dataclasses.field(default_factory=list)  # host time to enqueue a burst
    tokens: list = dataclasses.field(default_factory=list)  # tokens committed per burst, whole batch


class _Mode:
    """One way of running bursts: ``enqueue()`` starts one, ``finish()`` returns its tokens (or None)."""

    launches = 1
    syncs = 1

    def __init__(self, backend):
        self.backend = backend
        self.stream = None

    def enqueue(self):
        raise NotImplementedError

    def finish(self):
        raise NotImplementedError


class _Eager(_Mode):
    def __init__(self, dec, mode):
        super().__init__(dec.backend)
        self.dec, self.mode, self.stream = dec, mode, dec.stream
        self.launches = len(dec.burst_calls())
        self.syncs = dec.m_rounds + 1 if mode == "per_round_sync" else 1

    def enqueue(self):
        self.dec.enqueue_burst(mode=self.mode)

    def finish(self):
        return self.dec.drain()


class _Graph(_Mode):
    def __init__(self, dec, gapless):
        super().__init__(dec.backend)
        self.graph, self.stream = BurstGraph(dec, gapless=gapless), dec.stream
        self.gapless = gapless

    def enqueue(self):
        self.graph.replay()

    def finish(self):
        return self.graph.drain()


class _Peer(_Mode):
    def __init__(self, dec):
        from .torch_peer import TorchPeer

        super().__init__(dec.backend)
        self.peer = TorchPeer(dec)
        self.stream = self.peer.cp_stream

    def enqueue(self):
        self.peer.enqueue()

    def finish(self):
        return self.peer.drain()


class _Floor(_Mode):
    """A graph of ``n_nodes`` dependent empty kernels; it commits no tokens."""

    syncs = 0

    def __init__(self, backend, n_nodes):
        super().__init__(backend)
        self.stream = backend.new_stream()
        rt = backend.xp.cuda.runtime
        backend.ops.empty_node(stream=self.stream)
        self.stream.synchronize()
        self.stream.begin_capture(mode=rt.streamCaptureModeGlobal)
        for _ in range(n_nodes):
            backend.ops.empty_node(stream=self.stream)
        self.graph = self.stream.end_capture()
        self.graph.upload(self.stream)

    def enqueue(self):
        self.graph.launch(self.stream)

    def finish(self):
        return None


class _EmptyModel:
    """Timing-only stand-in: one empty kernel per model call, over a stub's cache.

    Replacing the stub models by empty nodes isolates what the bookkeeping kernels cost
    against the floor of the same node count.
    """

    def __init__(self, inner):
        self.inner, self.cache, self.vocab, self.backend = inner, inner.cache, inner.vocab, inner.backend
        self.writes_verify_tokens = getattr(inner, "writes_verify_tokens", False)  # same node count as (c)

    def prefill(self, *args) -> None:
        self.inner.prefill(*args)

    def draft_step(self, bufs, step, stream):
        self.backend.ops.empty_node(stream=stream)

    def verify(self, bufs, stream):
        self.backend.ops.empty_node(stream=stream)


def build_decoder(backend, cfg, capacity):
    target, draft = stub_pair(cfg["batch"], VOCAB, cfg["layers"], 1, capacity, accept_prob=cfg["accept"],
                              p_min=0.0, seed=11, cost_ns=int(cfg["cost_us"] * 1000), backend=backend)
    dec = SpecDecoder(target, draft, k=cfg["k"], m_rounds=cfg["m"])
    rng = np.random.default_rng(5)
    dec.prefill([rng.integers(0, VOCAB, 8).tolist() for _ in range(cfg["batch"])])
    return dec


def make_modes(backend, cfg, capacity, with_peer):
    modes = {"a": _Eager(build_decoder(backend, cfg, capacity), "per_round_sync"),
             "b": _Eager(build_decoder(backend, cfg, capacity), "pre_issued"),
             "c": _Graph(build_decoder(backend, cfg, capacity), gapless=False),
             "d": _Graph(build_decoder(backend, cfg, capacity), gapless=True)}
    if with_peer:
        modes["e"] = _Peer(build_decoder(backend, cfg, capacity))
    if backend.is_gpu:
        modes["f"] = _Floor(backend, modes["c"].graph.nodes_total)
        stub = build_decoder(backend, cfg, capacity)
        empty = SpecDecoder(_EmptyModel(stub.target), _EmptyModel(stub.draft), k=cfg["k"], m_rounds=cfg["m"])
        empty.prefill([[1]] * cfg["batch"])
        modes["g"] = _Graph(empty, gapless=False)
    return modes


def check_identical(modes, bursts=2):
    """Every token-producing mode must emit the same tokens, burst for burst."""
    outs = {}
    for name, mode in modes.items():
        if name in TIMING_ONLY:
            continue
        if name == "e":
            mode.peer.enqueue()  # eager warm-up burst, then capture
            first = mode.finish()
            mode.peer.capture()
            rest = [_one(mode) for _ in range(bursts - 1)]
            outs[name] = [first] + rest
        else:
            outs[name] = [_one(mode) for _ in range(bursts)]
    ref = outs["c"]
    for name, out in outs.items():
        for i, (got, want) in enumerate(zip(out, ref)):
            for b, (g, w) in enumerate(zip(got, want)):
                if not np.array_equal(g, w):
                    raise AssertionError(f"mode {name} differs from graph replay in burst {i}, sequence {b}")


def _one(mode):
    mode.enqueue()
    return mode.finish()


def time_chunk(mode, n, sample: Sample) -> None:
    """Run ``n`` bursts; append per-burst medians' raw values to ``sample``."""
    gpu = mode.backend.is_gpu
    xp = mode.backend.xp
    starts = [xp.cuda.Event() for _ in range(n + 1)] if gpu else []
    ends = [xp.cuda.Event() for _ in range(n)] if gpu else []
    wall = []
    pipelined = isinstance(mode, _Graph) and mode.gapless
    pending = 0
    for i in range(n):
        if gpu:
            starts[i].record(mode.stream)
        t0 = time.perf_counter()
        mode.enqueue()
        sample.host_us.append((time.perf_counter() - t0) * 1e6)
        if gpu:
            ends[i].record(mode.stream)
        wall.append(t0)
        if pipelined and pending == 0:
            pending = 1
            continue
        toks = mode.finish()
        if toks is not None:
            sample.tokens.append(toks.total)
    if pipelined:
        toks = mode.finish()
        sample.tokens.append(toks.total)
    if gpu:
        starts[n].record(mode.stream)
        starts[n].synchronize()
        sample.burst_us += [xp.cuda.get_elapsed_time(starts[i], starts[i + 1]) * 1e3 for i in range(n)]
        sample.exec_us += [xp.cuda.get_elapsed_time(starts[i], ends[i]) * 1e3 for i in range(n)]
    else:
        end = time.perf_counter()
        wall.append(end)
        sample.burst_us += [(wall[i + 1] - wall[i]) * 1e6 for i in range(n)]


def measure(cfg, backend, reps, chunk, with_peer) -> dict:
    ring = cfg["m"] * (cfg["k"] + 1)
    capacity = 16 + (reps * chunk + 8) * ring
    modes = make_modes(backend, cfg, capacity, with_peer)
    check_identical(modes)
    samples = {name: Sample() for name in modes}
    for name, mode in modes.items():  # warm-up
        time_chunk(mode, 3, Sample())
    for _ in range(reps):
        for name, mode in modes.items():
            time_chunk(mode, chunk, samples[name])
    out = {}
    for name, s in samples.items():
        burst = statistics.median(s.burst_us)
        real = s.tokens and name not in TIMING_ONLY
        tok = statistics.median([b / max(1, t) for b, t in zip(s.burst_us, s.tokens)]) if real else None
        per_seq_tokens = statistics.mean(s.tokens) / cfg["batch"] if real else None
        exec_us = statistics.median(s.exec_us) if s.exec_us else burst
        out[name] = dict(burst_us=burst, exec_us=exec_us, round_us=burst / cfg["m"], token_us=tok,
                         host_us=statistics.median(s.host_us), syncs=modes[name].syncs,
                         launches=modes[name].launches,
                         accepted_per_round=(per_seq_tokens / cfg["m"] - 1) if per_seq_tokens else None)
    for name in out:
        out[name]["x_graph"] = out[name]["burst_us"] / out["c"]["burst_us"]
        if "f" in out:  # the floor compares device execution time of the same node count
            out[name]["x_floor"] = out[name]["exec_us"] / out["f"]["exec_us"]
    out["_nodes"] = modes["c"].graph.nodes_total
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


def _fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def render(console, results, label, with_peer):
    by_dim = {}
    for r in results:
        by_dim.setdefault(r["sweep"], []).append(r)
    for dim, rows in by_dim.items():
        table = Table(title=f"sweep over {dim} (base {BASE}); µs per committed token, medians. {label}")
        table.add_column(dim, justify="right")
        for m in "abcdef":
            if m == "e" and not with_peer:
                continue
            table.add_column(f"({m}) {MODE_LABELS[m]}", justify="right")
        table.add_column("(g)/floor exec", justify="right")
        table.add_column("(c) µs/round", justify="right")
        table.add_column("(c) host µs/burst", justify="right")
        table.add_column("(a)/(c)", justify="right")
        table.add_column("(e)/(c)", justify="right")
        table.add_column("(c) exec/floor", justify="right")
        for r in rows:
            res = r["result"]
            cells = [str(r["config"][dim])]
            for m in "abcdef":
                if m == "e" and not with_peer:
                    continue
                if m not in res:
                    cells.append("skipped")
                elif m == "f":
                    cells.append(f"{_fmt(res[m]['exec_us'])} µs/burst")
                else:
                    cells.append(_fmt(res[m]["token_us"]))
            cells.append(_fmt(res["g"].get("x_floor")) if "g" in res else "-")
            c = res["c"]
            cells += [_fmt(c["round_us"]), _fmt(c["host_us"]), _fmt(res["a"]["token_us"] / c["token_us"]),
                      _fmt(res["e"]["token_us"] / c["token_us"]) if "e" in res else "skipped",
                      _fmt(c.get("x_floor"))]
            table.add_row(*cells)
        console.print(table)


def render_detail(console, result, label):
    table = Table(title=f"every metric at the base config {BASE}; {label}")
    for col in ("mode", "µs/round", "µs/token", "burst exec µs", "host µs/burst", "syncs/burst",
                "launches/burst", "accepted/round", "x graph", "exec x floor"):
        table.add_column(col, justify="right")
    for m, label_m in MODE_LABELS.items():
        if m not in result:
            table.add_row(f"({m}) {label_m}", *(["skipped"] + ["-"] * 8))
            continue
        r = result[m]
        table.add_row(f"({m}) {label_m}", _fmt(r["round_us"]), _fmt(r["token_us"]), _fmt(r["exec_us"]),
                      _fmt(r["host_us"]),
                      str(r["syncs"]), str(r["launches"]), _fmt(r["accepted_per_round"]), _fmt(r["x_graph"]),
                      _fmt(r.get("x_floor")))
    console.print(table)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="latency comparison of every burst mode (rich tables + JSON)")
    p.add_argument("--backend", choices=("auto", "cupy", "numpy"), default="auto")
    p.add_argument("--quick", action="store_true", help="a few configs, under a minute")
    p.add_argument("--reps", type=int_in(1, 1000), default=None,
                   help="rotations over the modes per config (default 5 on a GPU, 1 on the numpy backend)")
    p.add_argument("--chunk", type=int_in(1, 10_000), default=None,
                   help="bursts per mode per rotation (default 20 on a GPU, 3 on the numpy backend)")
    p.add_argument("--json", type=writable_file, default="bench_results.json", help="raw results file")
    p.add_argument("--no-peer", action="store_true", help="skip the PyTorch-ops peer")


def check_args(args) -> None:
    """Checks before any work: the backend exists, and the KV caches the sweep needs fit."""
    check_backend(args.backend)
    reps, chunk = args.reps or 5, args.chunk or 20
    for _, cfg in configs(args.quick):  # measure() sizes the caches from reps * chunk
        capacity = 16 + (reps * chunk + 8) * cfg["m"] * (cfg["k"] + 1)
        if capacity > 2**31 - 1:
            raise FlagError("--reps", f"--reps {reps} x --chunk {chunk} bursts need {capacity} KV entries per "
                                      "sequence, over 2**31 - 1")
        check_kv_memory(cfg["batch"], capacity, cfg["layers"] + 2, flags=("--reps", "--chunk"))


def run(args, console: Console) -> int:
    backend = get_backend(args.backend)
    gpu = backend.is_gpu
    label = "GPU timings" if gpu else "CPU REFERENCE (numpy backend, not a GPU timing)"
    from .torch_peer import torch_available

    with_peer = gpu and not args.no_peer and torch_available()
    # The numpy reference is slow, so its defaults are small; values given on the
    # command line are honoured on either backend.
    reps = args.reps if args.reps is not None else (5 if gpu else 1)
    chunk = args.chunk if args.chunk is not None else (20 if gpu else 3)
    todo = list(configs(args.quick))
    if not gpu:  # the numpy reference is slow at large sizes; keep the fallback short
        todo = [(d, c) for d, c in todo if c["batch"] <= 8 and c["layers"] <= 32 and c["m"] <= 8][:4]
    console.print(f"[bold]graphburst bench[/bold]: {label}; torch peer: "
                  f"{'on' if with_peer else 'skipped (needs torch with CUDA)'}")
    results = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("configs", total=len(todo))
        for dim, cfg in todo:
            results.append(dict(sweep=dim, config=cfg, result=measure(cfg, backend, reps, chunk, with_peer)))
            progress.advance(task)
    base = next((r["result"] for r in results if r["config"] == BASE), results[0]["result"])
    render_detail(console, base, label)
    render(console, results, label, with_peer)
    meta = dict(date=datetime.date.today().isoformat(), backend=backend.name, label=label, reps=reps, chunk=chunk,
                quick=bool(args.quick), torch_peer=with_peer, base=BASE)
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=2)
    console.print(f"raw medians written to {args.json}")
    return 0

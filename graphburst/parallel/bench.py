"""Benchmark of parallel layouts: TP=1, TP=2 (replicated or sharded draft), PP=2 (docs/parallel.md).

One process per layout run (``tp1`` alone, the others under ``torchrun --nproc_per_node 2``),
each writing ``OUT/<layout>.json``; ``report --out OUT`` prints the table and writes
``OUT/parallel_bench_<shape>.json`` (docs/parallel.md gives the whole sequence).

Every run first decodes a short ragged batch on **fp32** weights of the same shape and
compares its tokens with ``tp1``'s (written by the ``tp1`` run, which goes first); a
mismatch stops the run before any timing. Timing then uses bf16 weights: µs per round and
tokens/s at each batch size, the model-only floor (a graph of just the draft steps and
verifies, collectives included) and the overhead over it, and the collectives per round.

``--shape tiny`` runs the same code on a small model (on CPU: gloo and the numpy backend,
a dry run of the orchestration, not a timing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from .dist import config_hash

LAYOUTS = {"tp1": (1, 1, "replicated"), "tp2": (2, 1, "replicated"), "tp2s": (2, 1, "sharded"),
           "pp2": (1, 2, "replicated")}
MODEL_CALLS = ("draft_step", "verify")  # the model-only floor keeps these calls of a round


def _shape(name: str):
    from .models import LLAMA_8B, TINY

    return {"8b": (LLAMA_8B, 2), "tiny": (TINY, 1)}[name]


def _prompts(batch: int, vocab: int, seed: int, lo: int = 8, hi: int = 33) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(lo, hi))).tolist() for _ in range(batch)]


class Run:
    """One layout on this process (and its peers): build, decode, time."""

    def __init__(self, args, layout_name: str):
        import torch

        from ..backend import Backend, cuda_available
        from .dist import Context, Layout, env_world, init, use_device

        self.args, self.name = args, layout_name
        tp, pp, self.draft_mode = LAYOUTS[layout_name]
        self.layout = Layout(tp=tp, pp=pp)
        self.gpu = cuda_available() and not args.cpu
        self.torch = torch
        if self.layout.world > 1:
            self.ctx = init(gpu=self.gpu, timeout_s=args.dist_timeout)
        else:
            rank, world, local = env_world()
            dev = torch.device("cuda", local) if self.gpu else torch.device("cpu")
            if self.gpu:
                use_device(local)
            self.ctx = Context(rank=0, world=1, local_rank=local, backend="nccl" if self.gpu else "gloo", device=dev,
                               timeout_s=args.dist_timeout)
        self.backend = Backend("cupy", self.ctx.local_rank) if self.gpu else Backend("numpy")
        self.cfg, self.draft_layers = _shape(args.shape)

    # ------------------------------------------------------------------ building

    def pair(self, dtype, batch: int, capacity: int):
        """This rank's (decoder, runner) of the layout on fresh random weights of ``dtype``."""
        import gc

        gc.collect()  # the last phase's models (sharded modules hold reference cycles through their hooks)
        if self.gpu:
            self.torch.cuda.empty_cache()
        from ..engine.decoder import SpecDecoder
        from ..models.checkpoint import wrap_pair
        from .models import random_pair
        from .runner import ParallelBurst, ParallelDecoder, build_pair, hash_parts

        a = self.args
        whole = self.layout.world == 1
        full_t, full_d = random_pair(self.cfg, draft_layers=self.draft_layers, batch=batch if whole else 1,
                                     capacity=capacity if whole else 16, device=self.ctx.device, dtype=dtype,
                                     seed=a.seed, residual_scale=a.eps)
        if whole:
            target, draft = wrap_pair(full_t, full_d, batch=batch, capacity=capacity, backend=self.backend)
            dec = SpecDecoder(target, draft, k=a.k, m_rounds=a.rounds)
            return dec, None
        self.ctx.agree_on("model and flags", *hash_parts(full_t, full_d, self.layout, k=a.k, m=a.rounds, batch=batch,
                                                         dtype=str(dtype), seed=a.seed, eps=a.eps))
        target, draft = build_pair(full_t, full_d, self.ctx, self.layout, batch=batch, capacity=capacity,
                                   backend=self.backend, draft_mode=self.draft_mode)
        del full_t, full_d
        if self.gpu:
            self.torch.cuda.empty_cache()
        return ParallelDecoder(target, draft, self.ctx, k=a.k, m_rounds=a.rounds), ParallelBurst

    def runner(self, dec, kind):
        from ..capture import BurstGraph

        return kind(dec) if kind is not None else BurstGraph(dec)

    def sync(self, dec):
        dec.stream.synchronize()

    # ------------------------------------------------------------------ the fp32 token check

    def check_tokens(self, out_dir: Path) -> dict:
        a = self.args
        batch, bursts = 3, 2
        cap = 64 + bursts * a.rounds * (a.k + 1)
        dec, kind = self.pair(self.torch.float32, batch, cap)
        dec.prefill(_prompts(batch, self.cfg.vocab_size, a.seed))
        run = self.runner(dec, kind)
        toks = [[] for _ in range(batch)]
        for _ in range(bursts):
            for b, t in enumerate(run.run()):
                toks[b] += t.tolist()
        if hasattr(run, "close"):
            run.close()
        # Keyed by everything that decides the tokens, so a tp1 run of other flags (or on
        # the other device kind: fp32 sums differ) is never taken as the reference.
        key = {"shape": a.shape, "seed": a.seed, "eps": a.eps, "k": a.k, "rounds": a.rounds, "batch": batch,
               "bursts": bursts, "dtype": "float32", "device": "gpu" if self.gpu else "cpu"}
        path = out_dir / f"check_tokens_{a.shape}_{config_hash(key):016x}.json"
        if self.name == "tp1":
            path.write_text(json.dumps({"key": key, "tokens": toks}))
            return {"tokens": sum(map(len, toks)), "equal_tp1": True}
        if not path.exists():
            raise RuntimeError(f"{path} missing: run the tp1 layout first with the same flags ({key})")
        ref = json.loads(path.read_text())["tokens"]
        return {"tokens": sum(map(len, toks)), "equal_tp1": toks == ref,
                "first_mismatch_seq": next((b for b in range(batch) if toks[b] != ref[b]), None)}

    # ------------------------------------------------------------------ timing

    def time_batch(self, batch: int) -> dict:
        a = self.args
        dtype = self.torch.bfloat16 if self.gpu else self.torch.float32
        cap = 64 + (a.bursts + a.warmup + 2 * a.bursts + 2) * a.rounds * (a.k + 1)
        dec, kind = self.pair(dtype, batch, cap)
        dec.prefill(_prompts(batch, self.cfg.vocab_size, a.seed + batch, lo=32, hi=33))
        calls0 = dict(self.ctx.calls)
        run = self.runner(dec, kind)  # on a GPU: one eager warm-up burst + the capture call each collective once
        for _ in range(a.warmup):
            run.run()
        self.sync(dec)
        t0 = time.perf_counter()
        total = 0
        for _ in range(a.bursts):
            total += run.run().total
        wall = time.perf_counter() - t0
        # Python issues a collective per call: twice per burst program on a GPU (warm-up, capture),
        # at every replay on numpy (the recorded program re-runs the calls).
        n_bursts = 2 if self.gpu else a.warmup + a.bursts
        per_round = {k: (v - calls0.get(k, 0)) / n_bursts / a.rounds for k, v in self.ctx.calls.items()}
        acc = dec.accept_counters()
        rounds = a.bursts * a.rounds
        # Model-only floor: the same draft steps and verifies, no bookkeeping, as one graph.
        program = [c for r in range(a.rounds) for c in dec.round_calls(first_round=r == 0)
                   if c.name.startswith(MODEL_CALLS)]
        floor_us = self._time_program(dec, program, a.bursts) / rounds * 1e6
        if hasattr(run, "close"):
            run.close()
        return {"batch": batch, "us_per_round": wall / rounds * 1e6, "tokens_per_s": total / wall,
                "tokens_per_round": total / rounds / batch, "acceptance": float(acc[:, 0].sum() / max(1, acc[:, 1].sum() * a.k)),
                "floor_us_per_round": floor_us, "overhead_over_floor": wall / rounds * 1e6 / floor_us - 1.0,
                "collectives_per_round": per_round, "host_syncs_per_burst": 1}

    def _time_program(self, dec, program, reps: int) -> float:
        """Seconds for ``reps`` launches of ``program`` as one graph; buffers and lengths restored after."""
        from ..capture import RecordedProgram, _capture_failed
        from ..engine.torch_capture import TorchCapturer

        arrays = [dec.bufs.out_block] + [getattr(dec.bufs, n) for n in dec.bufs.LAYOUT if n not in dec.bufs.OUTPUTS]
        arrays += [ly.length for m in (dec.target, dec.draft) for ly in m.cache.layers if ly is not None]
        with dec.backend.device(), dec.stream:
            saved = [x.copy() for x in arrays]
        if self.gpu:
            with dec.backend.device():
                graph = TorchCapturer(dec.torch_stream).capture(program, dec.stream, _capture_failed)
                graph.upload(dec.stream)
        else:
            graph = RecordedProgram(program)
        graph.launch(dec.stream)
        self.sync(dec)
        t0 = time.perf_counter()
        for _ in range(reps):
            graph.launch(dec.stream)
        self.sync(dec)
        secs = time.perf_counter() - t0
        with dec.backend.device(), dec.stream:
            for x, s in zip(arrays, saved):
                x[...] = s
        self.sync(dec)
        del graph
        return secs

    def all_reduce_cost(self, batch: int) -> float | None:
        """µs per all-reduce of ``[batch, k+1, hidden]`` bf16, from a graph of 32 (TP only, GPU only)."""
        if self.layout.tp == 1 or not self.gpu:
            return None
        torch = self.torch
        x = torch.zeros((batch, self.args.k + 1, self.cfg.hidden_size), dtype=torch.bfloat16, device=self.ctx.device)
        s = torch.cuda.Stream(self.ctx.device)
        with torch.cuda.stream(s):
            self.ctx.all_reduce_(x)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(32):
                self.ctx.all_reduce_(x)
        with torch.cuda.stream(s):
            g.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                g.replay()
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 320 * 1e6


def cmd_run(args) -> int:
    from . import dist

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = None
    ok = False
    try:
        run = Run(args, args.layout)
        res = {"layout": args.layout, "shape": args.shape, "k": args.k, "m_rounds": args.rounds,
               "world": run.layout.world, "device": "gpu" if run.gpu else "cpu",
               "draft": run.draft_mode if run.layout.tp > 1 else "replicated"}
        res["check"] = run.check_tokens(out)
        if not res["check"]["equal_tp1"]:
            print(f"parallel bench {args.layout}: rank {run.ctx.rank}: fp32 tokens differ from tp1 "
                  f"({res['check']}); not timing", file=sys.stderr, flush=True)
        else:
            res["batches"] = [run.time_batch(b) for b in args.batch]
            res["all_reduce_us"] = {str(b): run.all_reduce_cost(b) for b in args.batch}
        if run.ctx.rank == 0:
            (out / f"{args.layout}_{args.shape}.json").write_text(json.dumps(res, indent=1))
        ok = res["check"]["equal_tp1"]
    except Exception as exc:  # noqa: BLE001 - one line naming the rank, then a non-zero exit
        print(f"parallel bench {args.layout}: rank {os.environ.get('RANK', '0')}: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
    finally:
        if run is not None and run.layout.world > 1:
            dist.shutdown(run.ctx, ok=ok)
    return 0 if ok else 1


def cmd_report(args) -> int:
    from rich.console import Console
    from rich.table import Table

    out = Path(args.out)
    rows = {}
    for name in LAYOUTS:
        path = out / f"{name}_{args.shape}.json"
        if path.exists():
            rows[name] = json.loads(path.read_text())
    console = Console(width=200)
    table = Table(title=f"parallel layouts, {args.shape} shape (µs per round, one burst graph per GPU)")
    for col in ("layout", "draft", "fp32 tokens = tp1", "B", "µs/round", "tokens/s", "tokens/round/seq",
                "floor µs/round", "overhead", "collectives/round", "µs/all-reduce", "vs tp1"):
        table.add_column(col, justify="right")
    base = {b["batch"]: b["us_per_round"] for b in rows.get("tp1", {}).get("batches", [])}
    summary = {"layouts": rows}
    for name, r in rows.items():
        for b in r.get("batches", [{}]):
            if not b:
                table.add_row(name, r["draft"], str(r["check"]["equal_tp1"]), *["-"] * 9)
                continue
            ratio = b["us_per_round"] / base[b["batch"]] if b["batch"] in base else None
            coll = ", ".join(f"{k} {v:g}" for k, v in sorted(b["collectives_per_round"].items())) or "0"
            ar = (r.get("all_reduce_us") or {}).get(str(b["batch"]))
            table.add_row(name, r["draft"], str(r["check"]["equal_tp1"]), str(b["batch"]), f"{b['us_per_round']:.0f}",
                          f"{b['tokens_per_s']:,.0f}", f"{b['tokens_per_round']:.2f}", f"{b['floor_us_per_round']:.0f}",
                          f"{b['overhead_over_floor']:+.1%}", coll, "-" if ar is None else f"{ar:.1f}",
                          "-" if ratio is None else f"{ratio:.2f}x")
    for name in ("tp2", "tp2s"):
        one = [b for b in rows.get(name, {}).get("batches", []) if b["batch"] == 1]
        if one and 1 in base:
            ratio = one[0]["us_per_round"] / base[1]
            summary[f"{name}_over_tp1_b1"] = ratio
            console.print(f"{name} / tp1 per-round latency at B=1: {ratio:.2f}x (target <= 0.60x: "
                          f"{'met' if ratio <= 0.6 else 'NOT met'})")
    console.print(table)
    (out / f"parallel_bench_{args.shape}.json").write_text(json.dumps(summary, indent=1))
    bad = [n for n, r in rows.items() if not r["check"]["equal_tp1"]]
    return 1 if bad or not rows else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphburst.parallel.bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one layout (tp1 alone; the others under torchrun --nproc_per_node 2)")
    r.add_argument("--layout", choices=list(LAYOUTS), required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    r.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    r.add_argument("-k", type=int, default=4)
    r.add_argument("-m", "--rounds", type=int, default=8)
    r.add_argument("--bursts", type=int, default=5, help="timed bursts per batch size")
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--eps", type=float, default=0.1, help="scale of the later layers' o_proj/down_proj")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--cpu", action="store_true", help="numpy backend and gloo even with a GPU")
    r.add_argument("--dist-timeout", type=float, default=60.0)
    rep = sub.add_parser("report", help="the table and parallel_bench_<shape>.json from the runs' JSON")
    rep.add_argument("--out", required=True)
    rep.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    args = p.parse_args(argv)
    return cmd_run(args) if args.cmd == "run" else cmd_report(args)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # torchrun ranks: no interpreter teardown after the group is gone

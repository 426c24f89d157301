"""``torchrun --nproc_per_node N -m graphburst demo --model ... --tp N`` (or ``--pp N``).

Every rank runs this: the flags and the model config are checked before any process
group exists, the group comes up with a timeout, the ranks agree on a config hash, then
each builds its shard or stage, captures its burst graph and runs the bursts in
lockstep. Rank 0 prints. Any failure is one line on stderr naming the rank.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from ..backend import get_backend
from ..cli_args import FlagError
from ..models.parity import NEAR_TIE_TOL, compare_tokens, describe, teacher_forced_logits
from . import dist
from .dist import Layout

TINY_RANDOM = "tiny-random"


def model_configs(args):
    """(target cfg, draft cfg or None) of the demo's --model/--draft, read without loading weights."""
    from ..models.checkpoint import read_config
    from .models import TINY

    if args.model == TINY_RANDOM:
        return TINY, None
    return read_config(args.model), read_config(args.draft)


def check_args(args) -> None:
    """FlagError for a parallel demo that cannot run, before any process group."""
    layout = Layout(tp=args.tp, pp=args.pp)
    if args.model is None:
        raise FlagError("--tp" if args.tp > 1 else "--pp", f"needs --model {TINY_RANDOM} or --model DIR --draft DIR "
                                                           f"(the stub models are not split)")
    if args.mode != "graph":
        raise FlagError("--mode", f"a parallel demo runs graph replay only, got {args.mode!r}")
    _, world, _ = dist.env_world()
    flag = "--tp" if args.tp > 1 else "--pp"
    if world == 1:
        raise FlagError(flag, f"launch with torchrun --nproc_per_node {layout.world} -m graphburst demo ...")
    try:
        cfg, draft_cfg = model_configs(args)
        dist.check_layout(cfg, layout, world)
    except ValueError as exc:
        raise FlagError(flag, str(exc)) from None
    check_draft(draft_cfg, layout.tp, args.draft_mode)


def check_draft(draft_cfg, tp: int, draft_mode: str) -> None:
    """FlagError on ``--draft-mode`` when a sharded draft cannot be split ``tp`` ways.

    ``draft_cfg`` None: tiny-random's own draft (TINY, which every supported ``tp`` divides).
    """
    if draft_cfg is None or tp == 1 or draft_mode != "sharded":
        return
    try:
        dist.check_layout(draft_cfg, Layout(tp=tp))
    except ValueError as exc:
        raise FlagError("--draft-mode", f"the draft cannot be sharded: {exc}; pass --draft-mode replicated") from None


def run(args, console) -> int:
    """Every rank: build, run the bursts in lockstep, report on rank 0; 0 when every sequence passes."""
    layout = Layout(tp=args.tp, pp=args.pp)
    gpu = get_backend(args.backend).is_gpu
    ctx = None
    burst = None
    ok = False
    code = 1
    try:
        ctx = dist.init(gpu=gpu, timeout_s=args.dist_timeout)
        say = console.print if ctx.rank == 0 else (lambda *a, **k: None)
        say(f"[bold]graphburst demo[/bold] {layout.name} over {ctx.world} ranks ({ctx.backend}, "
            f"{'GPU' if gpu else 'CPU numpy reference backend'})")
        full_t, dec, prompts = _build(args, ctx, layout, gpu)
        burst, out, wall, syncs = _run_bursts(dec, args.bursts)
        code = 0
        if ctx.rank == 0:
            code = _report(args, console, layout, full_t, dec, prompts, out, wall, syncs)
        ok = True
    except Exception as exc:  # noqa: BLE001 - one line naming the rank, then a non-zero exit
        rank = ctx.rank if ctx is not None else dist.env_world()[0]
        print(f"graphburst demo: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    finally:
        if burst is not None and ok:  # after a failure a hung collective may hold the graphs: leave them
            burst.close()
        clean = dist.shutdown(ctx, ok=ok)
        if not clean and ok:
            print(f"graphburst demo: rank {ctx.rank}: process-group teardown did not finish in time",
                  file=sys.stderr, flush=True)
    return code


def _build(args, ctx, layout, gpu: bool):
    """(the whole target on this rank: the reference, a prefilled ParallelDecoder, the prompts)."""
    import torch

    from ..backend import Backend
    from .models import TINY, random_pair
    from .runner import ParallelDecoder, build_pair, hash_parts

    backend = Backend("cupy", ctx.local_rank) if gpu else Backend("numpy")
    capacity = 64 + args.bursts * args.rounds * (args.k + 1)
    dtype = getattr(torch, args.dtype)
    if args.model == TINY_RANDOM:
        full_t, full_d = random_pair(TINY, batch=1, capacity=capacity, device=ctx.device, dtype=dtype, seed=args.seed)
    else:
        from ..models.checkpoint import load_llama

        full_t = load_llama(args.model, batch=1, capacity=capacity, dtype=dtype, device=ctx.device)
        full_d = load_llama(args.draft, batch=1, capacity=16, dtype=dtype, device=ctx.device)
    ctx.agree_on("model and flags", *hash_parts(full_t, full_d, layout, k=args.k, m=args.rounds,
                                                batch=args.batch, dtype=args.dtype, seed=args.seed))
    target, draft = build_pair(full_t, full_d, ctx, layout, batch=args.batch, capacity=capacity,
                               backend=backend, p_min=args.p_min or 0.0, draft_mode=args.draft_mode)
    del full_d
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, target.vocab, int(rng.integers(1, 33))).tolist() for _ in range(args.batch)]
    dec = ParallelDecoder(target, draft, ctx, k=args.k, m_rounds=args.rounds)
    dec.prefill(prompts)
    return full_t, dec, prompts


def _run_bursts(dec, bursts: int):
    """Capture, then run ``bursts`` bursts in lockstep: (the burst, tokens per sequence, wall s, host syncs)."""
    from .runner import ParallelBurst

    burst = ParallelBurst(dec)
    syncs0 = dec.host_syncs
    out = [[] for _ in range(dec.batch)]
    t0 = time.perf_counter()
    for _ in range(bursts):
        for b, t in enumerate(burst.run()):
            out[b] += t.tolist()
    return burst, out, time.perf_counter() - t0, dec.host_syncs - syncs0


def compare_to_greedy(out, prompts, full_t, tol: float) -> list[dict]:
    """Each sequence against the whole target's greedy tokens on one rank, under the near-tie rule.

    TP reduces in another order than one GPU, so in bf16 a near-tie may flip a token and
    the continuations part there (:mod:`graphburst.models.parity`). The reference re-runs
    every prefix with no collectives; ``full_t``'s KV row 0 is overwritten.
    """
    return [compare_tokens(got, full_t.greedy(p, len(got)),
                           lambda prefix, p=p: teacher_forced_logits(full_t, p, prefix), tol)
            for got, p in zip(out, prompts)]


def _report(args, console, layout, full_t, dec, prompts, out, wall, syncs) -> int:
    """Rank 0: the table, the throughput line, and one line per failure; the exit code."""
    from rich.table import Table

    tol = NEAR_TIE_TOL[args.dtype]
    checks = compare_to_greedy(out, prompts, full_t, tol)
    acc = dec.accept_counters()
    draft = "sharded" if layout.tp > 1 and args.draft_mode == "sharded" else "replicated"
    table = Table(title=f"{args.model} {layout.name}: k={args.k}, M={args.rounds}, {args.bursts} bursts, "
                        f"draft {draft}; checked against 1-GPU greedy (near-tie tol {tol:g} x max(1, |top logit|))")
    for col in ("seq", "committed", "acceptance", "tokens/round", "agreed", "first divergence", "passes"):
        table.add_column(col, justify="right")
    for b, res in enumerate(checks):
        rounds = int(acc[b, 1])
        table.add_row(str(b), str(len(out[b])), f"{acc[b, 0] / max(1, rounds * args.k):.2f}",
                      f"{len(out[b]) / max(1, rounds):.2f}", f"{res['agreed']}/{res['compared']}", describe(res),
                      "[green]yes[/green]" if res["ok"] else "[red]NO[/red]")
    console.print(table)
    total = sum(map(len, out))
    console.print(f"{total} tokens in {wall * 1e3:.1f} ms: {total / wall:,.0f} tokens/s; host syncs: {syncs} "
                  f"over {args.bursts} bursts ({syncs / args.bursts:.1f} per burst per rank); rank agreement "
                  f"checked at {dec.check.bursts} drains")
    failed = [(b, res) for b, res in enumerate(checks) if not res["ok"]]
    for b, res in failed:
        d = res["divergence"]
        print(f"graphburst demo: sequence {b} leaves 1-GPU greedy at token {d['at']} ({d['theirs']} vs {d['ours']}): "
              f"the logits differ by {d['gap']:.4f} > {d['allowed']:.4f}, not a near-tie", file=sys.stderr, flush=True)
    return 1 if failed else 0

"""``serve --tp N`` on every rank: flag checks before any group, this rank's loop, the run.

Rank 0 serves (JSONL through :func:`graphburst.serving.jsonl.run`, or HTTP through
:func:`graphburst.serving.http.run`, with the loop built here from the command's
:class:`~graphburst.serving.factory.ServeConfig`) and the other ranks follow its plans
(:class:`.lockstep.LockstepLoop`).
"""

from __future__ import annotations

import signal
import sys

from ..serving.factory import TINY_RANDOM
from .dist import Context, Layout
from .lockstep import LockstepLoop, PlanChannel


def check_args(args) -> None:
    """FlagError for ``serve --tp N`` that cannot run, before any process group."""
    from ..cli_args import FlagError
    from . import dist
    from .launch import check_draft

    if args.model is None:
        raise FlagError("--tp", f"needs --model {TINY_RANDOM} or --model DIR --draft DIR (the stub models are not "
                                f"split)")
    if args.engine != "graph":
        raise FlagError("--engine", f"serving with --tp runs the graph engine only, got {args.engine!r}")
    _, world, _ = dist.env_world()
    if world == 1:
        raise FlagError("--tp", f"launch with torchrun --nproc_per_node {args.tp} -m graphburst serve ...")
    try:
        from ..models.checkpoint import read_config
        from .models import TINY

        cfg = TINY if args.model == TINY_RANDOM else read_config(args.model)
        draft_cfg = None if args.model == TINY_RANDOM or args.draft is None else read_config(args.draft)
        dist.check_layout(cfg, Layout(tp=args.tp), world)
    except (ValueError, OSError) as exc:
        raise FlagError("--tp", str(exc)) from None
    check_draft(draft_cfg, args.tp, args.draft_mode)


def build(config, ctx: Context, backend) -> LockstepLoop:
    """This rank's models and loop (``config``: a ServeConfig), after the ranks agreed on the model and flags."""
    import torch

    from .models import TINY, random_pair
    from .runner import build_pair, hash_parts

    layout = Layout(tp=config.tp)
    dtype = getattr(torch, config.dtype or "float32")
    if config.model == TINY_RANDOM:
        full_t, full_d = random_pair(TINY, batch=1, capacity=16, device=ctx.device, dtype=dtype, seed=0)
    else:
        from ..models.checkpoint import load_llama

        full_t = load_llama(config.model, batch=1, capacity=16, dtype=dtype, device=ctx.device)
        full_d = load_llama(config.draft, batch=1, capacity=16, dtype=dtype, device=ctx.device)
    flags = {f: getattr(config, f) for f in ("k", "rounds", "batch", "capacity", "dtype", "p_min", "sampling",
                                             "pipelined", "draft_mode")}
    ctx.agree_on("model and flags", *hash_parts(full_t, full_d, layout, **flags))
    target, draft = build_pair(full_t, full_d, ctx, layout, batch=config.batch, capacity=config.capacity,
                               backend=backend, p_min=config.p_min or 0.0, draft_mode=config.draft_mode)
    del full_t, full_d
    return LockstepLoop(target, draft, ctx, PlanChannel(ctx), k=config.k, m_rounds=config.rounds,
                        pipelined=config.pipelined, depth=config.pipeline_depth, sampling=config.sampling,
                        spec_max_batch=config.spec_max_batch)


def _serve(config, loop: LockstepLoop, console) -> int:
    """Rank 0: JSONL or HTTP serving over this rank's loop."""
    if config.http:
        from ..serving import http  # aiohttp: only when asked for (the [serve] extra)

        return http.run(config, console, loop=loop)
    from ..serving import jsonl

    return jsonl.run(config, loop)


def run(config, console) -> int:
    """``serve --tp N`` on every rank (``config``: a ServeConfig): rank 0 serves (JSONL or HTTP), the others
    follow."""
    from ..backend import Backend, get_backend
    from . import dist
    from .runner import drop_graphs

    gpu = get_backend(config.backend).is_gpu
    ctx = loop = None
    ok = False
    code = 1
    try:
        ctx = dist.init(gpu=gpu, timeout_s=config.dist_timeout)
        backend = Backend("cupy", ctx.local_rank) if gpu else Backend("numpy")
        loop = build(config, ctx, backend)
        if loop.leader:
            if config.http:
                # A peer that fails stops the server the way SIGTERM does; the exit code says it failed.
                loop.on_fatal = lambda: signal.raise_signal(signal.SIGTERM)
            code = _serve(config, loop, console)
            if loop.fatal is None:
                loop.finish()
            else:
                print(f"graphburst serve: rank 0: stopped: {loop.fatal}", file=sys.stderr, flush=True)
                code = 1
        else:
            for sig in (signal.SIGTERM, signal.SIGINT):  # leave on rank 0's stop plan, not on torchrun's signal
                signal.signal(sig, signal.SIG_IGN)
            loop.follow()
            code = 0
        print(f"graphburst serve: {loop.summary()}", file=sys.stderr, flush=True)
        ok = loop.fatal is None
    except Exception as exc:  # noqa: BLE001 - one line naming the rank, then a non-zero exit
        rank = ctx.rank if ctx is not None else dist.env_world()[0]
        print(f"graphburst serve: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        if ok and loop is not None and loop.graph is not None:
            drop_graphs(loop.graph)
        clean = dist.shutdown(ctx, ok=ok)
        if ok and not clean:
            print(f"graphburst serve: rank {ctx.rank}: process-group teardown did not finish in time",
                  file=sys.stderr, flush=True)
    return code

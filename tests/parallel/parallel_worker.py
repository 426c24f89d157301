"""One rank of the CPU parallel tests (gloo + numpy backend), launched by tests/parallel/test_parallel.py via torchrun.

``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/parallel/parallel_worker.py SCENARIO OUT_DIR``
writes ``OUT_DIR/rank{R}.json`` and exits 0, or prints ``rank R failed: ...`` and exits 1.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from graphburst.engine.decoder import SpecDecoder
from graphburst.capture import BurstGraph
from graphburst.models.checkpoint import wrap_pair
from graphburst.parallel import dist
from graphburst.parallel.check import RankDivergence
from graphburst.parallel.dist import Layout
from graphburst.parallel.models import TINY, random_pair
from graphburst.parallel.runner import ParallelBurst, ParallelDecoder, build_pair, hash_parts

CFG = TINY.replace(vocab_size=509)  # odd: the vocab-parallel head's padding is exercised
if os.environ.get("GB_TEST_SWITCHES") == "1":
    # Every architecture switch at once: Qwen2's q/k/v biases (sharded with their rows, random
    # and non-zero here), Qwen3's per-head q/k norms (replicated) and a head_dim unrelated to
    # hidden / heads. Not one HF family; it holds each switch's sharding against TP=1.
    CFG = CFG.replace(qkv_bias=True, qk_norm=True, head_dim=24, model_type="qwen3")
GPU = os.environ.get("GB_TEST_GPU") == "1"  # NCCL + cupy on cuda:LOCAL_RANK (tests/parallel/test_parallel_gpu.py)
BATCH, K, M, CAP = 3, 3, 4, 1024
BURSTS = int(os.environ.get("GB_TEST_BURSTS", "10"))
PROMPTS = [[5, 17, 300, 2, 9, 44, 101], [7], [250, 3, 3, 80]]  # ragged


def backend_of(ctx):
    from graphburst.backend import Backend

    return Backend("cupy", ctx.local_rank) if GPU else Backend("numpy")


def reference(ctx, seed: int) -> list[list[int]]:
    """TP=1 tokens: the whole pair on this rank alone (no collectives)."""
    t, d = random_pair(CFG, batch=BATCH, capacity=CAP, seed=seed, device=ctx.device)
    target, draft = wrap_pair(t, d, batch=BATCH, capacity=CAP, backend=backend_of(ctx))
    dec = SpecDecoder(target, draft, k=K, m_rounds=M)
    dec.prefill(PROMPTS)
    run = BurstGraph(dec).run
    out = [[] for _ in PROMPTS]
    for _ in range(BURSTS):
        for b, toks in enumerate(run()):
            out[b] += toks.tolist()
    return out


def parallel(ctx, layout: Layout, seed: int, draft_mode="sharded", diverge_at=None, raise_at=None, die_at=None,
             drain_timeout_s=None):
    t, d = random_pair(CFG, batch=1, capacity=16, seed=seed, device=ctx.device)
    ctx.agree_on("model and flags", *hash_parts(t, d, layout, k=K, m=M, batch=BATCH))
    target, draft = build_pair(t, d, ctx, layout, batch=BATCH, capacity=CAP, backend=backend_of(ctx),
                               draft_mode=draft_mode)
    dec = ParallelDecoder(target, draft, ctx, k=K, m_rounds=M)
    dec.prefill(PROMPTS)
    burst = ParallelBurst(dec, drain_timeout_s=drain_timeout_s)
    out = [[] for _ in PROMPTS]
    for i in range(BURSTS):
        if raise_at == i and ctx.rank == 1:
            raise ValueError("injected failure on rank 1")
        if die_at == i and ctx.rank == 1:
            # Dies without a word and exits 0, so torchrun does not stop rank 0: rank 0's next
            # graph replay waits in its collectives for a peer that is gone.
            print("rank 1: dying before burst", i + 1, file=sys.stderr, flush=True)
            os._exit(0)
        if diverge_at == i and ctx.rank == 1:
            dec.bufs.pend[0] = (dec.bufs.pend[0] + 1) % CFG.vocab_size  # this rank's next round starts elsewhere
        for b, toks in enumerate(burst.run()):
            out[b] += toks.tolist()
    return out, dec, burst


def lockstep_loop(ctx):
    """This rank's ``serve --tp 2 --model tiny-random`` loop (small, unpipelined: each step one burst)."""
    from graphburst.parallel.serve_tp import build
    from graphburst.serving.factory import ServeConfig

    config = ServeConfig(model="tiny-random", dtype="float32", k=K, rounds=M, batch=2, capacity=256,
                         pipelined=False, draft_mode="sharded", tp=2)
    return build(config, ctx, backend_of(ctx))


def lockstep(ctx, scenario: str) -> dict:
    """Lockstep serving faults: a follower whose schedule differs; a prefill whose failure is not the request's."""
    from graphburst.parallel.dist import ParallelError
    from graphburst.serving.request import Request

    loop = lockstep_loop(ctx)
    out = {"raised": None}
    if scenario == "lockstep_prefill_fails":
        def broken(*a, **kw):  # as a collective inside prefill would fail: not a bad request
            raise RuntimeError(f"injected collective failure on rank {ctx.rank}")
        loop.dec.admission.prefill_slots = broken  # what prefill and the loop's prefill_slots both run
    try:
        if ctx.rank == 0:
            state = loop.submit(Request(prompt=[5, 17, 300], max_new_tokens=6, id="a"))
            try:
                while not loop.idle:
                    loop.step()
                loop.finish()
            finally:
                out["request"] = {"error": state.error, "done": state.done}
        else:
            if scenario == "lockstep_schedule_diverges":
                loop.loop.submit(Request(prompt=[7], max_new_tokens=3, id="only-here"))  # rank 0 never sent it
            loop.follow()
    except ParallelError as exc:
        out["raised"] = f"{type(exc).__name__}: {exc}"
    out["fatal"] = loop.fatal
    return out


def stage_info(dec) -> dict:
    target = dec.target
    own = target.module.own
    expect = [target.cache.layers[i].length for i in own] + [ly.length for ly in dec.draft.cache.layers]
    expect.append(dec.bufs.pos_ctr)
    same = len(dec.table.targets) == len(expect) and all(a is b for a, b in zip(dec.table.targets, expect))
    to_host = lambda a: dec.backend.to_host(a, dec.stream).tolist()  # noqa: E731
    lengths = [to_host(target.cache.layers[i].length) for i in own]
    absent = [i for i, ly in enumerate(target.cache.layers) if ly is None]
    return {"own": [own.start, own.stop], "table_is_stage_local": same, "table_len": len(dec.table),
            "resolved": dec.table.resolve() is not None, "own_lengths": lengths, "absent": absent,
            "pos_ctr": to_host(dec.bufs.pos_ctr)}


def main(scenario: str, out_dir: str) -> int:
    torch.set_num_threads(1)  # deterministic CPU kernels, and CI has 2 cores
    ctx = None
    ok = False
    result: dict = {"scenario": scenario}
    try:
        ctx = dist.init(gpu=GPU, timeout_s=float(os.environ.get("GB_TEST_TIMEOUT", "20")))
        result["rank"] = ctx.rank
        if scenario == "tokens":
            ref = reference(ctx, seed=3)
            result["ref_tokens"] = sum(map(len, ref))
            for name, layout, mode in (("tp2", Layout(tp=2), "replicated"), ("tp2_sharded_draft", Layout(tp=2),
                                                                               "sharded"), ("pp2", Layout(pp=2), "")):
                got, dec, burst = parallel(ctx, layout, seed=3, draft_mode=mode or "sharded")
                result[name] = {"equal": got == ref, "tokens": sum(map(len, got)), "checks": dec.check.bursts,
                                "host_syncs": dec.host_syncs, "graph": burst.graph.info()}
                if layout.pp > 1:
                    result[name]["stage"] = stage_info(dec)
                burst.close()
        elif scenario == "diverge":
            try:
                parallel(ctx, Layout(tp=2), seed=3, diverge_at=2)
                result["raised"] = None
            except RankDivergence as exc:
                result["raised"] = str(exc)
        elif scenario == "mismatch":
            try:
                parallel(ctx, Layout(pp=2), seed=3 + ctx.rank)  # rank 1 loads "another checkpoint"
                result["raised"] = None
            except ValueError as exc:
                result["raised"] = str(exc)
        elif scenario == "raise":
            parallel(ctx, Layout(tp=2), seed=3, raise_at=2)
        elif scenario == "die":
            parallel(ctx, Layout(tp=2), seed=3, die_at=2, drain_timeout_s=float(os.environ["GB_TEST_DRAIN_TIMEOUT"]))
        elif scenario.startswith("lockstep_"):
            result.update(lockstep(ctx, scenario))
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
        ok = True
    except Exception as exc:  # noqa: BLE001 - reported in one line, then a non-zero exit
        if os.environ.get("GB_TRACEBACK"):
            import traceback
            traceback.print_exc()
        print(f"rank {os.environ.get('RANK')} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    result["shutdown_clean"] = dist.shutdown(ctx, ok=ok)
    if not ok:
        # The failing rank stays a moment after leaving the group, so the test sees the other
        # rank report its own error rather than torchrun's SIGTERM racing it on a loaded machine.
        time.sleep(float(os.environ.get("GB_TEST_LINGER_S", "0")))
    if ok:
        with open(os.path.join(out_dir, f"rank{result['rank']}.json"), "w") as f:
            json.dump(result, f)
    return 0 if ok else 1


if __name__ == "__main__":
    code = main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: nothing left to hang on

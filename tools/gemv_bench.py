"""cuBLAS (F.linear) against the weight-streaming GEMV (models/decode/gemv.py) at decode shapes, and a
sweep of the GEMV's tilings to fill ``gemv.CONFIGS`` (H200, bf16).

    PYTHONPATH=. python3 tools/gemv_bench.py --shapes 1b 8b --m 1 5 16 64 --sweep-m 1 5 --json gemv.json

Per (shape, projection, M): correctness first (cuBLAS and every GEMV tiling against the fp32
reference, within ``TOL``; a wrong tiling is reported, never timed), then each is timed as a
CUDA graph of ``--reps`` back-to-back calls that cycle through enough copies of the weight to
exceed twice the L2 (so every call streams its weight from HBM, as a forward does), CUDA
events, the median of ``--trials`` replays divided by the calls. GB/s counts the weight, x
and y bytes once; ``%HBM`` is that over 4.8 TB/s.

One rich row per (shape, projection, M): cuBLAS, the GEMV on CONFIGS' tiling, and (at
``--sweep-m``) the best swept tiling. Then, per ``(next_pow2(N), next_pow2(K))`` bucket, the
tiling with the least summed time over the swept M, printed as a ``CONFIGS`` literal to paste
into models/decode/gemv.py. Set ``llama_decode.GEMV_MAX_M`` to the largest M where the
GEMV beats cuBLAS on every projection (0 if it never does).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from graphburst.bench.graph_timing import graph_us
from graphburst.models.decode.gemv import CONFIGS, FMA_MAX_M, GemvConfig, default_config, gemv, pick_config

#: HBM bandwidth the %HBM column divides by (H200: 4.8 TB/s)
HBM_BYTES_PER_S = 4.8e12
#: (hidden, intermediate, q rows, kv rows each, vocab) of the shapes
SHAPES = {"1b": (2048, 8192, 2048, 512, 128256), "8b": (4096, 14336, 4096, 1024, 128256)}
#: bf16 bound of a tiling's output against the fp32 reference (outputs ~1: two bf16 ulps)
TOL = dict(rtol=2e-2, atol=4e-2)
#: the swept tilings (each distinct one is a Triton compile, ~1 s: the grid stays small): W rows per
#: program, K per tile, warps, pipeline stages; split-K is swept around the default's (x1/2, x1, x2)
SWEEP_BLOCK_N = (16, 32, 64)
SWEEP_BLOCK_K = (256, 512)
SWEEP_WARPS = (4, 8)
SWEEP_STAGES = (3,)
#: fp32 accumulators per thread past which the multiply-accumulate path spills (ptxas -v, sm_90a: 64 per
#: thread took 128 registers, 128 took 248, 256 spilled 6.5 kB)
FMA_MAX_ACC = 128


def projections(name: str) -> list[tuple[str, int, int]]:
    """(projection, N, K) of one layer and the head."""
    d, f, q, kv, vocab = SHAPES[name]
    return [("qkv", q + 2 * kv, d), ("o", d, q), ("gate_up", 2 * f, d), ("down", d, f), ("head", vocab, d)]


def candidates(n: int, k: int, sms: int) -> list[GemvConfig]:
    """Every swept tiling for an (N, K) weight; split-K around the default's, each split >= one tile."""
    out = []
    for bn, bk, warps, stages in itertools.product(SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_WARPS, SWEEP_STAGES):
        base = default_config(n, k, sms).split_k * 32 // bn  # the default's program count at this block_n
        splits = sorted({max(1, min(-(-k // bk), s)) for s in (max(1, base // 2), max(1, base), 2 * max(1, base))})
        out += [GemvConfig(bn, bk, warps, s, stages) for s in splits]
    return out


def choose(sweeps: dict, n_swept: dict) -> dict[tuple[int, int], GemvConfig]:
    """Per bucket, the tiling with the least summed µs among those that ran (and were right) at every swept M."""
    best = {}
    for key, acc in sweeps.items():
        full = [c for c, times in acc.items() if len(times) == n_swept[key]]
        if full:
            best[key] = min(full, key=lambda c: sum(acc[c]))
    return best


def bucket(n: int, k: int) -> tuple[int, int]:
    return (1 << (n - 1).bit_length(), 1 << (k - 1).bit_length())


def configs_literal(best: dict[tuple[int, int], GemvConfig]) -> str:
    """A ``CONFIGS = {...}`` literal (eval'd back by the tests)."""
    rows = "".join(f"    {key}: GemvConfig({c.block_n}, {c.block_k}, {c.num_warps}, {c.split_k}, {c.num_stages}),\n"
                   for key, c in sorted(best.items()))
    return "CONFIGS: dict[tuple[int, int], GemvConfig] = {\n" + rows + "}"


def cycling_graph_us(calls: list, reps: int, trials: int) -> float:
    """Median µs per call of a CUDA graph of ``reps`` calls cycling through ``calls``
    (``graph_timing.graph_us`` over a closure that takes the next call each time)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:  # compile, autotune and allocate every copy outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    nxt = itertools.cycle(calls).__next__
    return graph_us(lambda: nxt()(), reps, trials)


def measure(fn, x, ws, want, reps: int, trials: int) -> tuple[float | None, str]:
    """(µs per call, "ok") or (None, why not): checked against ``want`` on ws[0] before it is timed."""
    try:
        got = fn(x, ws[0])
        torch.cuda.synchronize()
    except Exception as e:  # a tiling that does not compile or launch (shared memory, registers) is a result
        return None, f"not run: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
    if not torch.allclose(got.float(), want, **TOL):
        return None, f"wrong: max |diff| {(got.float() - want).abs().max().item():.3g}"
    return cycling_graph_us([lambda w=w: fn(x, w) for w in ws], max(reps, len(ws)), trials), "ok"  # every copy once


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["1b", "8b"])
    ap.add_argument("--m", nargs="+", type=int, default=[1, 5, 16, 64], help="rows (B * T)")
    ap.add_argument("--sweep-m", nargs="*", type=int, default=[1, 5], help="rows at which the tilings are swept")
    ap.add_argument("--proj", nargs="+", choices=("qkv", "o", "gate_up", "down", "head"),
                    help="projections (default: all)")
    ap.add_argument("--reps", type=int, default=40, help="calls per graph")
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, sweeps, n_swept = [], {}, {}  # sweeps: bucket -> {GemvConfig: [µs at each swept M]}
    for name in a.shapes:
        for proj, n, k in projections(name):
            if a.proj and proj not in a.proj:
                continue
            wbytes = n * k * 2
            copies = max(1, -(-2 * l2 // wbytes))
            ws = [(torch.randn(n, k, device=dev, generator=gen) / k ** 0.5).bfloat16() for _ in range(copies)]
            for m in a.m:
                x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
                want = x.float() @ ws[0].float().T
                nbytes = wbytes + (m * k + m * n) * 2
                rec = {"shape": name, "proj": proj, "N": n, "K": k, "M": m, "weight_copies": copies}
                for label, fn in (("cublas", F.linear), ("gemv", gemv)):
                    us, status = measure(fn, x, ws, want, a.reps, a.trials)
                    rec[label] = {"us": None if us is None else round(us, 2), "status": status,
                                  "GB/s": None if us is None else round(nbytes / us / 1e3, 1)}
                rec["gemv"]["config"] = list(pick_config(n, k, dev))
                if m == 1:  # M = 1 runs multiply-accumulate (FMA_MAX_M); CONFIGS' tiling on tl.dot too
                    us, status = measure(lambda xx, w: gemv(xx, w, fma=False), x, ws, want, a.reps, a.trials)
                    rec["gemv_dot_at_m1"] = {"us": None if us is None else round(us, 2), "status": status}
                if m in (a.sweep_m or []):
                    n_swept[bucket(n, k)] = n_swept.get(bucket(n, k), 0) + 1
                    results = []
                    for cfg in candidates(n, k, props.multi_processor_count):
                        if m <= FMA_MAX_M and cfg.block_n * cfg.block_k > FMA_MAX_ACC * 32 * cfg.num_warps:
                            continue  # multiply-accumulate keeps block_n x block_k fp32 per program: it would spill
                        us, status = measure(lambda xx, w, c=cfg: gemv(xx, w, config=c), x, ws, want, a.reps,
                                             a.trials)
                        results.append((cfg, us, status))
                        if us is not None:
                            sweeps.setdefault(bucket(n, k), {}).setdefault(cfg, []).append(us)
                    ok = [r for r in results if r[1] is not None]
                    if ok:
                        cfg, us, _ = min(ok, key=lambda r: r[1])
                        rec["best"] = {"config": list(cfg), "us": round(us, 2), "GB/s": round(nbytes / us / 1e3, 1)}
                    rec["swept"] = [{"config": list(c), "us": None if u is None else round(u, 2), "status": s}
                                    for c, u, s in results]
                rows.append(rec)
                print(json.dumps({k2: v for k2, v in rec.items() if k2 != "swept"}), flush=True)
            del ws
            torch.cuda.empty_cache()
    best = choose(sweeps, n_swept)
    if a.json:  # before the table: a rendering problem must not cost the measurements
        with open(a.json, "w") as f:
            json.dump({"device": props.name, "rows": rows,
                       "configs": {f"{key[0]}x{key[1]}": list(c) for key, c in best.items()},
                       "current": {f"{key[0]}x{key[1]}": list(c) for key, c in CONFIGS.items()}}, f, indent=1)
    console = Console(width=170)
    console.print(table_of(rows))
    if best:
        console.print(configs_literal(best), markup=False, highlight=False)
    return 0


def table_of(rows: list[dict]) -> Table:
    table = Table(title="GEMV vs cuBLAS (bf16, µs per call streamed from HBM; %HBM of 4.8 TB/s)")
    for col in ("shape", "proj", "N", "K", "M", "cuBLAS µs", "%HBM", "GEMV µs", "%HBM", "GEMV/cuBLAS",
                "tl.dot µs", "best µs", "%HBM", "best (bn, bk, warps, split, stages)"):
        table.add_column(col, justify="right")

    def cell(d, key="us"):
        return "-" if not d else (f"{d[key]:.1f}" if d.get(key) is not None else d.get("status", "-")[:24])

    def pct(d):
        return "-" if not d or d.get("GB/s") is None else f"{d['GB/s'] * 1e9 / HBM_BYTES_PER_S:.0%}"

    for r in rows:
        cu, gv, best = r["cublas"], r["gemv"], r.get("best")
        ratio = f"{gv['us'] / cu['us']:.2f}" if gv["us"] and cu["us"] else "-"
        table.add_row(r["shape"], r["proj"], str(r["N"]), str(r["K"]), str(r["M"]), cell(cu), pct(cu), cell(gv),
                      pct(gv), ratio, cell(r.get("gemv_dot_at_m1")), cell(best), pct(best),
                      str(tuple(best["config"])) if best else "-")
    return table


if __name__ == "__main__":
    sys.exit(main())

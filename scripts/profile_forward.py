"""Where a Llama forward's time goes on the GPU: graph-replay time against a bandwidth floor,
then (unless ``--no-profile``) its kernel time per forward split into GEMM, attention, the
fused elementwise kernels and other (total and per layer), the gap (graph time minus summed
kernel time), issue 20's non-GEMM µs per layer ((graph - GEMM) / layers) and the top kernels.

    PYTHONPATH=. python3 scripts/profile_forward.py --shape 1b 8b --batch 1 64 \\
        --capacity 1024 4096 16384 --valid 512 --kernels auto off --json out.json

One verify-shaped forward (T = k + 1) and one draft-shaped forward (T = 1) per shape,
batch, capacity, attention layout and decode kernels (``auto``: the fused Triton decode
path on CUDA, its projections on the GEMV at B * T <= GEMV_MAX_M; ``cublas``: the same path
with every projection on cuBLAS; ``off``: SDPA over the whole cache with an additive mask). ``--valid`` sets
every sequence's valid KV rows (default capacity / 2), so a capacity sweep at a fixed
``--valid`` shows whether the forward follows the bytes it must read or the bytes it
allocated. floor = (weight bytes + valid KV bytes read + KV bytes written) / 4.8 TB/s.
``--attention fold`` is ``Llama(fold_gqa=True)``; ``--shape 8b-tp2`` is one rank's shard
of the 8B shape under TP=2, without the collectives.

Correctness first: each config's fused forward is checked against the SDPA forward on
the same weights and KV (``--kernels`` containing ``auto``) before it is timed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict

import torch
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

from graphburst.bench.real_models import MODELS, random_target
from graphburst.parallel.models import LLAMA_8B
from graphburst.parallel.tp import local_config
from tp_floor import graph_us  # scripts/ is on sys.path when a script runs

#: HBM bandwidth the floor divides by (H200: 4.8 TB/s)
HBM_BYTES_PER_S = 4.8e12
#: the fused forward's label per ``--kernels`` choice
PATHS = {"auto": "fused", "cublas": "fused-cublas"}
#: kernel name -> category, first match wins. Attention goes first: PyTorch's memory-efficient
#: attention is a CUTLASS kernel (``fmha_cutlassF_...``) and flash's split-KV kernels say "splitkv".
#: GEMM: cuBLAS / cuBLASLt / CUTLASS names on the H200 (``nvjet_...``, ``..._gemm_...``) and the
#: Triton GEMV (``models/decode/gemv.py``: ``_gemv`` and its split-K sum ``_split_k_sum``).
#: fused: the per-layer elementwise work (graphburst's Triton ``_add_rmsnorm``, ``_rope_kv_write``,
#: ``_silu_mul``; aten's norm kernel on the SDPA path). other: the rest (copies, adds, index, argmax...).
CATEGORIES = (
    ("attention", re.compile(r"attention|attn|fmha|flash|sdpa|_combine|softmax", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|split_?k", re.IGNORECASE)),
    ("fused", re.compile(r"rmsnorm|rms_norm|layer_norm|rope|rotary|silu|swiglu|kv_write", re.IGNORECASE)),
)
OTHER = "other"


def shape(name):
    """``8b-tp2``: one rank's shard of the 8B shape under TP=2 (heads, KV heads, FFN and head rows halved)."""
    if name == "8b-tp2":
        return local_config(LLAMA_8B, 2).replace(vocab_size=-(-LLAMA_8B.vocab_size // 2))
    return LLAMA_8B if name == "8b" else MODELS[name].cfg


def floor_us(cfg, wbytes: int, b: int, t: int, valid: int, elem: int) -> float:
    """(weights + valid KV rows read + new KV rows written) / HBM bandwidth, in µs."""
    row = 2 * cfg.num_key_value_heads * cfg.head_dim * elem * cfg.num_hidden_layers  # K and V, every layer
    return (wbytes + b * (valid + t) * row + b * t * row) / HBM_BYTES_PER_S * 1e6


def check(model, tok, pos, lengths) -> float:
    """Max |fused - SDPA| logits over the same weights and KV (the KV is restored after)."""
    saved = [kv.clone() for kv in model.kv]
    ops, model.decode_ops = model.decode_ops, None
    want = model(tok, pos, lengths)
    for kv, s in zip(model.kv, saved):
        kv.copy_(s)
    model.decode_ops = ops
    got = model(tok, pos, lengths)
    for kv, s in zip(model.kv, saved):
        kv.copy_(s)
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    # bf16 through a random-weight model: the fused kernels round RoPE, norms and softmax once
    # where SDPA's path rounds each product, and 32 layers amplify it (8b: 6% of the largest
    # logit on the H200); a wiring bug is O(scale). tests/models/decode/test_decode_kernels_gpu.py holds
    # the same forward to 1e-5 in fp32.
    if not err <= 0.25 * scale + 1e-3:
        raise SystemExit(f"fused forward disagrees with SDPA: max |diff| {err:.4g} (logits up to {scale:.4g})")
    return err / max(scale, 1e-9)


def category(name: str) -> str:
    """A kernel's category (``CATEGORIES``), ``other`` if none matches."""
    return next((cat for cat, pat in CATEGORIES if pat.search(name)), OTHER)


def breakdown(events, layers: int, calls: int, graph_us: float, top: int) -> dict:
    """Per-forward kernel time by category from ``(name, device µs)`` events of ``calls`` forwards.

    ``gap_us``: graph-replay time minus the summed kernel time (launch gaps and idle time
    inside the graph). ``nongemm_per_layer_us`` is issue 20's figure, (graph µs - GEMM µs) /
    layers: everything a layer costs outside its GEMMs, gaps included (the head GEMM is a
    GEMM too; embedding, final norm and argmax count, a few µs); target <= 10.
    ``nongemm_kernel_per_layer_us`` leaves the gaps out.
    """
    if calls < 1 or layers < 1:
        raise ValueError(f"calls ({calls}) and layers ({layers}) must be >= 1")
    per = defaultdict(lambda: [0, 0.0])
    cats = {cat: [0, 0.0] for cat, _ in CATEGORIES} | {OTHER: [0, 0.0]}
    for name, us in events:
        per[name][0] += 1
        per[name][1] += us
        c = cats[category(name)]
        c[0] += 1
        c[1] += us
    total = sum(us for _, us in per.values()) / calls
    gemm = cats["gemm"][1] / calls
    out = {"kernel_sum_us": round(total, 1), "kernels": round(sum(n for n, _ in per.values()) / calls, 1),
           "per_layer": round(sum(n for n, _ in per.values()) / calls / layers, 1),
           "gap_us": round(graph_us - total, 1), "gap_per_layer_us": round((graph_us - total) / layers, 2),
           "nongemm_per_layer_us": round((graph_us - gemm) / layers, 2),
           "nongemm_kernel_per_layer_us": round((total - gemm) / layers, 2)}
    for cat, (n, us) in cats.items():
        out[f"{cat}_us"] = round(us / calls, 1)
        out[f"{cat}_per_layer_us"] = round(us / calls / layers, 2)
        out[f"{cat}_kernels"] = round(n / calls, 1)
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    out["top"] = [(nm[:90], category(nm), round(c / calls, 1), round(us / calls, 1)) for nm, (c, us) in rows]
    return out


def profile_one(fn, layers: int, top: int, graph_us: float, calls: int = 5) -> dict:
    """``calls`` eager forwards under torch.profiler (the kernels the graph replays), per forward."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    events = [(ev.name, ev.device_time) for ev in prof.events() if ev.device_type == cuda]
    return {"profiled_calls": calls, **breakdown(events, layers, calls, graph_us, top)}


def table_of(records: list) -> Table:
    """One row per timed config (the per-kernel split shown when profiled, ``-`` otherwise)."""
    table = Table(title="Llama forward, bf16, CUDA-graph replay medians; per-forward kernel µs by category")
    cols = ("shape", "B", "T", "cap", "valid", "path", "graph µs", "floor µs", "x floor", "GEMM µs", "attn µs",
            "fused µs", "other µs", "gap µs", "non-GEMM µs/layer", "kernels/layer")
    for col in cols:
        table.add_column(col, justify="right")
    for r in records:
        prof = [f"{r[key]:.0f}" if key in r else "-" for key in ("gemm_us", "attention_us", "fused_us", "other_us",
                                                                 "gap_us")]
        table.add_row(r["shape"], str(r["batch"]), str(r["T"]), str(r["capacity"]), str(r["valid"]), r["path"],
                      f"{r['graph_us']:.0f}", f"{r['floor_us']:.0f}", f"{r['x_floor']:.2f}", *prof,
                      str(r.get("nongemm_per_layer_us", "-")), str(r.get("per_layer", "-")))
    return table


def summary(r: dict) -> str:
    """One line per config for a batch log."""
    line = (f"{r['shape']} B={r['batch']} T={r['T']} cap={r['capacity']} {r['path']}: graph {r['graph_us']:.0f} µs "
            f"({r['x_floor']:.2f}x floor)")
    if "gemm_us" in r:
        line += (f"; GEMM {r['gemm_us']:.0f}, attention {r['attention_us']:.0f}, fused {r['fused_us']:.0f}, "
                 f"other {r['other_us']:.0f}, gap {r['gap_us']:.0f} µs; non-GEMM {r['nongemm_per_layer_us']} "
                 f"µs/layer (target <= 10)")
    return line


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="+", default=["1b", "8b"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1])
    ap.add_argument("--capacity", nargs="+", type=int, default=[1024])
    ap.add_argument("--valid", type=int, help="valid KV rows per sequence (default: capacity / 2)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--t", nargs="+", type=int, help="tokens per forward (default: k + 1 and 1)")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--attention", nargs="+", choices=("gqa", "fold"), default=["gqa"])
    ap.add_argument("--kernels", nargs="+", choices=("auto", "cublas", "off"), default=["auto"],
                    help="decode kernels: auto (fused Triton path on CUDA), cublas (the fused path with its "
                         "projections on cuBLAS, not the GEMV), or off (SDPA)")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--no-profile", action="store_true", help="graph timings only (no per-kernel profile)")
    ap.add_argument("--profile-calls", type=int, default=5, help="eager forwards the per-kernel profile averages")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.profile_calls < 1 or a.trials < 1:
        raise SystemExit(f"--profile-calls ({a.profile_calls}) and --trials ({a.trials}) must be >= 1")
    out = []
    configs = [(n, b, c, at) for n in a.shape for b in a.batch for c in a.capacity for at in a.attention]
    for name, b, cap, attn in configs:
        cfg = shape(name)
        valid = cap // 2 if a.valid is None else a.valid
        if not 0 <= valid <= cap - a.k - 1:
            raise SystemExit(f"--valid {valid} must be in [0, capacity - k - 1 = {cap - a.k - 1}]")
        model = random_target(type("S", (), {"cfg": cfg})(), batch=b, capacity=cap, kv_slack=a.k + 2,
                              dtype=torch.bfloat16, device="cuda", fold_gqa=attn == "fold")
        fused = model.decode_ops
        for kv in model.kv:
            kv.normal_()
        lengths = [torch.full((b,), valid, dtype=torch.int32, device="cuda")] * cfg.num_hidden_layers
        pos = torch.full((b,), valid, dtype=torch.int32, device="cuda")
        wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for t in a.t or (a.k + 1, 1):
            tok = torch.randint(0, cfg.vocab_size, (b, t), device="cuda")
            fn = lambda: model(tok, pos, lengths)  # noqa: E731
            for kern in a.kernels:
                model.decode_ops = {"auto": fused, "cublas": fused and fused._replace(gemv_max_m=0)}.get(kern)
                with torch.no_grad():
                    err = check(model, tok, pos, lengths) if model.decode_ops is not None else None
                    g_us = graph_us(fn, reps=1, trials=a.trials)
                    prof = {} if a.no_profile else profile_one(fn, cfg.num_hidden_layers, a.top, g_us,
                                                                a.profile_calls)
                fl = floor_us(cfg, wbytes, b, t, valid, 2)
                rec = {"shape": name, "batch": b, "T": t, "capacity": cap, "valid": valid, "attention": attn,
                       "path": "sdpa" if model.decode_ops is None else PATHS[kern],
                       "graph_us": round(g_us, 1),
                       "floor_us": round(fl, 1), "x_floor": round(g_us / fl, 2),
                       "check_rel_diff": None if err is None else round(err, 4), **prof}
                out.append(rec)
                print(json.dumps(rec), flush=True)
                print("summary:", summary(rec), flush=True)
        del model, lengths
        torch.cuda.empty_cache()
    if a.json:  # before the table: a rendering problem must not cost the measurements
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    Console(width=200).print(table_of(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a Llama forward's time goes on the GPU: kernel count, the top kernels by device
time, and graph-replay time against the sum of kernel times (the launch gaps).

    PYTHONPATH=. python3 scripts/profile_forward.py --shape 1b 8b --batch 1 16 --attention gqa fold

One verify-shaped forward (T = k + 1) and one draft-shaped forward (T = 1) per shape and
attention layout (``gqa``: SDPA with ``enable_gqa``; ``fold``: ``Llama(fold_gqa=True)``,
the query groups folded into the query length). ``--shape 8b-tp2`` is one rank's shard
of the 8B shape under TP=2, without the collectives: the per-rank compute floor.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from graphburst.bench.real_models import MODELS, random_target
from graphburst.parallel.models import LLAMA_8B
from graphburst.parallel.tp import local_config
from tp_floor import graph_us  # scripts/ is on sys.path when a script runs


def shape(name):
    """``8b-tp2``: one rank's shard of the 8B shape under TP=2 (heads, KV heads, FFN and head rows halved)."""
    if name == "8b-tp2":
        return local_config(LLAMA_8B, 2).replace(vocab_size=-(-LLAMA_8B.vocab_size // 2))
    return LLAMA_8B if name == "8b" else MODELS[name].cfg


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="+", default=["1b", "8b"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1])
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--attention", nargs="+", choices=("gqa", "fold"), default=["gqa"])
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    out = []
    for name, b, attn in [(n, b, at) for n in a.shape for b in a.batch for at in a.attention]:
        cfg = shape(name)
        model = random_target(type("S", (), {"cfg": cfg})(), batch=b, capacity=a.capacity, kv_slack=a.k + 2,
                              dtype=torch.bfloat16, device="cuda", fold_gqa=attn == "fold")
        lengths = [torch.full((b,), a.capacity // 2, dtype=torch.int32, device="cuda")] * cfg.num_hidden_layers
        pos = torch.full((b,), a.capacity // 2, dtype=torch.int32, device="cuda")
        wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for t in (a.k + 1, 1):
            tok = torch.randint(0, cfg.vocab_size, (b, t), device="cuda")
            fn = lambda: model(tok, pos, lengths)  # noqa: E731
            with torch.no_grad():
                g_us = graph_us(fn, reps=1, trials=20)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    fn()
                    torch.cuda.synchronize()
            per = defaultdict(lambda: [0, 0.0])
            n = 0
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    n += 1
                    per[ev.name][0] += 1
                    per[ev.name][1] += ev.device_time
            k_us = sum(v[1] for v in per.values())
            rows = sorted(per.items(), key=lambda kv: -kv[1][1])[: a.top]
            rec = {"shape": name, "batch": b, "T": t, "attention": attn, "graph_us": round(g_us, 1),
                   "kernel_sum_us": round(k_us, 1), "kernels": n, "per_layer": round(n / cfg.num_hidden_layers, 1),
                   "bw_floor_us": round(wbytes / 4.8e12 * 1e6, 1),
                   "top": [(nm[:90], c, round(us, 1)) for nm, (c, us) in rows]}
            out.append(rec)
            print(json.dumps(rec, indent=1), flush=True)
        del model
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

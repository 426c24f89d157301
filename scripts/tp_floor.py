"""What TP=2 can save on one GPU: each per-layer op of the 8B shape, timed at the full
size and at one rank's shard (heads, KV heads, FFN and head rows halved), with no
collectives at all. The ratio of the sums is the best TP=2 round a layout could reach
with free communication and these kernels.

    PYTHONPATH=. python3 scripts/tp_floor.py --json OUT.json

Every op is captured as a CUDA graph of ``--reps`` back-to-back calls (weights larger
than L2, so each call streams them from HBM) and timed with CUDA events; medians of 15.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from graphburst.parallel.models import LLAMA_8B


def graph_us(fn, reps: int, trials: int = 15) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(trials):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / reps)
    out.sort()
    return out[len(out) // 2]


def layer_ops(world: int, t: int, cap: int, dt=torch.bfloat16):
    """name -> (callable, weight bytes) for one layer of ``world``'s shard at T=t, B=1."""
    c = LLAMA_8B
    d, hd = c.hidden_size, c.head_dim
    h, kv, f = c.num_attention_heads // world, c.num_key_value_heads // world, c.intermediate_size // world
    dev = "cuda"
    nl = 8  # distinct weight copies, cycled, so consecutive calls never hit L2
    x = torch.randn(1, t, d, device=dev, dtype=dt)
    w_qkv = [torch.randn((h + 2 * kv) * hd, d, device=dev, dtype=dt) * 0.02 for _ in range(nl)]
    w_o = [torch.randn(d, h * hd, device=dev, dtype=dt) * 0.02 for _ in range(nl)]
    w_gu = [torch.randn(2 * f, d, device=dev, dtype=dt) * 0.02 for _ in range(nl)]
    w_dn = [torch.randn(d, f, device=dev, dtype=dt) * 0.02 for _ in range(nl)]
    a_o = torch.randn(1, t, h * hd, device=dev, dtype=dt)
    a_dn = torch.randn(1, t, f, device=dev, dtype=dt)
    q = torch.randn(1, h, t, hd, device=dev, dtype=dt)
    keys = torch.randn(1, kv, cap, hd, device=dev, dtype=dt)
    vals = torch.randn(1, kv, cap, hd, device=dev, dtype=dt)
    mask = torch.zeros(1, 1, t, cap, device=dev, dtype=dt)
    mask[..., cap // 2 + t:] = float("-inf")
    nw = torch.ones(d, device=dev, dtype=dt)
    i = [0]

    def cyc(ws):
        def pick():
            i[0] = (i[0] + 1) % nl
            return ws[i[0]]
        return pick
    pq, po, pg, pd = cyc(w_qkv), cyc(w_o), cyc(w_gu), cyc(w_dn)
    ops = {
        "qkv_gemm": (lambda: F.linear(x, pq()), w_qkv[0].numel() * 2),
        "o_gemm": (lambda: F.linear(a_o, po()), w_o[0].numel() * 2),
        "gate_up_gemm": (lambda: F.linear(x, pg()), w_gu[0].numel() * 2),
        "down_gemm": (lambda: F.linear(a_dn, pd()), w_dn[0].numel() * 2),
        "sdpa": (lambda: F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=kv != h), 0),
        "rms_norm": (lambda: F.rms_norm(x, (d,), nw, 1e-5), 0),
        "residual_add": (lambda: x + x, 0),
        "silu_mul": (lambda: F.silu(a_dn) * a_dn, 0),
    }
    return ops


def head_op(world: int, t: int, dt=torch.bfloat16):
    c = LLAMA_8B
    v = -(-c.vocab_size // world)
    w = [torch.randn(v, c.hidden_size, device="cuda", dtype=dt) * 0.02 for _ in range(2)]
    x = torch.randn(1, t, c.hidden_size, device="cuda", dtype=dt)
    i = [0]

    def fn():
        i[0] ^= 1
        return F.linear(x, w[i[0]]).float()
    return fn, w[0].numel() * 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", nargs="+", type=int, default=[5, 1])
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--reps", type=int, default=32)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = []
    for t in a.t:
        for world in (1, 2):
            with torch.no_grad():
                ops = layer_ops(world, t, a.capacity)
                rec = {"world": world, "T": t, "ops": {}}
                for name, (fn, nbytes) in ops.items():
                    us = graph_us(fn, a.reps)
                    rec["ops"][name] = {"us": round(us, 2), "bytes": nbytes,
                                        "tb_per_s": round(nbytes / us / 1e6, 2) if nbytes else None}
                fn, nbytes = head_op(world, t)
                us = graph_us(fn, 4)
                rec["ops"]["lm_head"] = {"us": round(us, 2), "bytes": nbytes, "tb_per_s": round(nbytes / us / 1e6, 2)}
                del ops
                torch.cuda.empty_cache()
            rec["layer_us"] = round(sum(v["us"] for k, v in rec["ops"].items() if k != "lm_head")
                                    + rec["ops"]["rms_norm"]["us"] + rec["ops"]["residual_add"]["us"], 2)
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    for t in a.t:
        one, two = [r for r in rows if r["T"] == t]
        print(f"T={t}: per-layer {one['layer_us']} -> {two['layer_us']} us "
              f"({two['layer_us'] / one['layer_us']:.2f}x); GEMMs only "
              f"{sum(one['ops'][k]['us'] for k in ('qkv_gemm', 'o_gemm', 'gate_up_gemm', 'down_gemm')):.1f} -> "
              f"{sum(two['ops'][k]['us'] for k in ('qkv_gemm', 'o_gemm', 'gate_up_gemm', 'down_gemm')):.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

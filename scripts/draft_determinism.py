"""Is the 8B-shaped 2-layer bf16 draft bitwise reproducible on one GPU?

    PYTHONPATH=. python3 scripts/draft_determinism.py

Captures the draft's forward (T = 1 and T = 5) as a CUDA graph and replays it 300 times,
alone and with 8192^2 GEMMs running on another stream (other kernels on the SMs, as the
NCCL kernels of a tensor-parallel graph are), counting replays whose logits differ in any
bit from the first. Then the same for SDPA, the qkv GEMM and the head alone, eagerly.
Prints one JSON object of counts (docs/benchmarks.md, "Replicated drafts": all 0 on the
H200, 2026-11-30).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from graphburst.parallel.models import LLAMA_8B, random_llama

DT = torch.bfloat16
LENGTH = 300  # valid KV rows before the forward


def noise(stream, a, n: int) -> None:
    """``n`` large GEMMs enqueued on ``stream`` (they overlap what the current stream runs next)."""
    with torch.cuda.stream(stream):
        for _ in range(n):
            a @ a


@torch.no_grad()
def forward_counts(res: dict, stream, a) -> None:
    cfg = LLAMA_8B.replace(num_hidden_layers=2)
    model = random_llama(cfg, batch=1, capacity=512, device="cuda", dtype=DT, seed=1, residual_scale=0.1,
                         keep_layers=2)
    for kv in model.kv:
        kv.normal_(0, 1)
    lengths = [torch.full((1,), LENGTH, dtype=torch.int32, device="cuda")] * cfg.num_hidden_layers
    pos = torch.full((1,), LENGTH, dtype=torch.int32, device="cuda")
    for t in (1, 5):
        tok = torch.randint(0, cfg.vocab_size, (1, t), device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(tok, pos, lengths)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(tok, pos, lengths)
        graph.replay()
        torch.cuda.synchronize()
        ref = out.clone()
        for mode in ("alone", "noise"):
            diffs = 0
            for i in range(300):
                if mode == "noise":
                    noise(stream, a, 1 + i % 3)
                graph.replay()
                torch.cuda.synchronize()
                diffs += not torch.equal(out, ref)
            res[f"forward_T{t}_{mode}_diffs_of_300"] = diffs


@torch.no_grad()
def op_counts(res: dict, stream, a) -> None:
    for t in (1, 5):
        q = torch.randn(1, 32, t, 128, device="cuda", dtype=DT)
        k = torch.randn(1, 8, 512, 128, device="cuda", dtype=DT)
        v = torch.randn_like(k)
        mask = torch.zeros(1, 1, t, 512, device="cuda", dtype=DT)
        mask[..., LENGTH + t:] = float("-inf")
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        diffs = 0
        for i in range(300):
            noise(stream, a, 1 + i % 3)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            torch.cuda.synchronize()
            diffs += not torch.equal(y, ref)
        res[f"sdpa_T{t}_noise_diffs_of_300"] = diffs
        for name, rows in (("gemm_qkv", 6144), ("gemm_head", 128256)):
            w = torch.randn(rows, 4096, device="cuda", dtype=DT)
            x = torch.randn(1, t, 4096, device="cuda", dtype=DT)
            ref = F.linear(x, w)
            diffs = 0
            for i in range(100):
                noise(stream, a, 1 + i % 3)
                y = F.linear(x, w)
                torch.cuda.synchronize()
                diffs += not torch.equal(y, ref)
            res[f"{name}_T{t}_noise_diffs_of_100"] = diffs


def main() -> int:
    torch.manual_seed(0)
    stream = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=DT)
    res: dict = {}
    forward_counts(res, stream, a)
    op_counts(res, stream, a)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

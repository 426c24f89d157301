"""What admitting prompts costs a real model: host and GPU time of one ``prefill_checked`` call.

A random-weight shape of ``graphburst bench real`` (bf16 on a GPU) behind a SpecDecoder of
64 slots; each case admits some prompts at position 0, six times (new slots each time),
and the figures are medians over the last four (so a prefill-graph bucket is captured by
then: ``models.prefill_graphs``). Host time is the call's own (it never waits for the GPU);
GPU time is a CUDA event pair around it on the decoder's stream. Before timing, every
case's first token is checked against the model's own greedy continuation (a full
re-run of the prompt that shares no state with the prefill).

``--eager`` turns the prefill graphs off (the plain eager prefill, for a before/after on
one lease); ``--padded`` keeps them but pads each prompt to its call's longest instead of
packing the prompts end to end (``models.packed_prefill``, the default); ``--warmup ROWS`` warms their buckets first, as serving does; ``--profile``
prints torch.profiler's table of the last case's call.

``--chunked`` adds the later-chunk cases (:data:`CHUNK_CASES`).

Usage: ``PYTHONPATH=. python scripts/prefill_profile.py [--model 1b] [--eager | --padded] [--warmup ROWS] [--chunked]
[--cases N] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

sys.path.insert(0, ".")
from graphburst import SpecDecoder  # noqa: E402
from graphburst.backend import get_backend  # noqa: E402
from graphburst.bench.real_models import MODELS, instance, random_target, subspace_draft  # noqa: E402
from graphburst.models.parity import NEAR_TIE_TOL, near_tie  # noqa: E402
from graphburst.models.torch_adapter import TorchDraft, TorchTarget  # noqa: E402

BATCH, K, M, MAX_PROMPT = 64, 4, 8, 512
REPS, TIMED = 6, 4  # calls per case, of which the last TIMED are timed
#: (label, rows, lengths): fixed sizes, and lognormal lengths (mean 128 in [16, 512], the load
#: benchmark's) drawn once per case ("the same") or anew for every call ("new each time": cold buckets)
CASES = (("1 x 128", 1, 128), ("1 x 512", 1, 512), ("4 x 128", 4, 128), ("11 x 128", 11, 128),
         ("11 lognormal, the same", 11, "same"), ("11 lognormal, new each time", 11, "new"))
#: (label, rows, lengths, cached): a prompt's later chunk of 512 tokens behind its first ``cached``
#: (written, untimed, by a non-final chunk just before), alone or beside fresh lognormal prompts:
#: what a chunked-prefill server (``--prefill-chunk 512``) admits while a long prompt arrives
CHUNK_CASES = (("1 x 512 at 512", 1, 512, 512), ("1 x 512 at 512 + 10 lognormal", 11, "same", 512))


def _lognormal(rng, n):
    return np.clip(np.rint(rng.lognormal(np.log(128) - 0.125, 0.5, n)), 16, MAX_PROMPT).astype(int)


def build(name: str, backend, eager: bool, dtype: str, padded: bool = False):
    import torch

    spec = MODELS[name]
    device = f"cuda:{backend.device_id}" if backend.is_gpu else "cpu"
    cap = 2 * MAX_PROMPT + M * (K + 1)
    src = random_target(spec, batch=BATCH, capacity=cap, kv_slack=K + 2, dtype=getattr(torch, dtype), device=device,
                        seed=0)
    draft = instance(src, layers=spec.draft_layers) if spec.draft_cfg is None else subspace_draft(src, spec, seed=0)
    graphs = False if eager else None  # None: the adapters' default (on a GPU)
    packed = False if padded and not eager else None  # None: packed where the module can
    target = TorchTarget(src, batch=BATCH, capacity=cap, backend=backend, prefill_graphs=graphs, packed_prefill=packed)
    dft = TorchDraft(draft, batch=BATCH, capacity=cap, backend=backend, prefill_graphs=graphs, packed_prefill=packed)
    return SpecDecoder(target, dft, k=K, m_rounds=M)


def _check_first_tokens(dec, rows: dict, tol: float) -> None:
    """pend after the prefill against the model's own greedy next token (row BATCH - 1 as scratch),
    under the near-tie rule (``models.parity``): in bf16 a fresh prefill and a whole re-run reduce
    in other orders, so two candidates whose logits lie within the rounding may swap."""
    import torch

    module = dec.target.module
    pend = dec.backend.to_host(dec.bufs.pend, dec.stream)
    device = module.rope_cos.device
    row = torch.tensor([BATCH - 1], device=device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    for b, prompt in rows.items():
        tokens = torch.tensor([prompt.tolist()], device=device)
        last = torch.tensor([len(prompt) - 1], device=device)
        with torch.no_grad():
            logits = module(tokens, zero, [zero] * len(module.layers), row, logits_at=last)[0, -1].float()
        want, got = int(logits.argmax()), int(pend[b])
        if got != want and not near_tie(logits, got, want, tol)["ok"]:
            raise AssertionError(f"slot {b}: prefill's first token {got}, greedy {want}: "
                                 f"{near_tie(logits, got, want, tol)}, not a near-tie")


def measure(dec, label: str, n: int, lengths, rng, *, check: bool = True, tol: float = 0.0, cached: int = 0) -> dict:
    """Six calls of one case, the last four timed. ``cached``: the first slot's call is a later
    chunk of 512 tokens at that position, its first ``cached`` tokens written just before (untimed)."""
    import torch

    gpu = dec.backend.is_gpu
    fixed = _lognormal(rng, n - bool(cached)) if lengths == "same" else None
    host_ms, gpu_ms = [], []
    for rep in range(REPS):
        lens = (fixed if fixed is not None else _lognormal(rng, n) if lengths == "new" else np.full(n, lengths))
        slots = sorted(rng.choice(BATCH - 1, n, replace=False).tolist())  # BATCH - 1: the greedy check's scratch
        if cached:  # the first slot continues a prompt: its whole prompt, of which the call is the tail
            lens = [cached + MAX_PROMPT, *lens] if len(lens) < n else [cached + lens[0], *lens[1:]]
        rows = {b: rng.integers(0, dec.target.vocab, int(ln)).astype(np.int32) for b, ln in zip(slots, lens)}
        starts = {b: 0 for b in rows}
        if cached:
            head = slots[0]
            dec.prefill_checked({head: rows[head][:cached]}, {head: 0}, final=False)
            starts[head] = cached
        call = {b: r[starts[b]:] for b, r in rows.items()}
        if gpu:
            stream = torch.cuda.ExternalStream(dec.stream.ptr)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record(stream)
        t0 = time.perf_counter()
        dec.prefill_checked(call, starts, limits={b: 64 for b in rows})
        t1 = time.perf_counter()
        if gpu:
            end.record(stream)
            torch.cuda.synchronize()
        if check and rep == 0:
            _check_first_tokens(dec, rows, tol)
        if rep >= REPS - TIMED:
            host_ms.append((t1 - t0) * 1e3)
            if gpu:
                gpu_ms.append(start.elapsed_time(end))
    graphs = dec.target.prefill_graphs
    return {"case": label, "rows": n, "tokens": int(sum(len(r) for r in call.values())),
            "padded_to_longest": int(n * max(len(r) for r in call.values())),
            "host_ms": float(np.median(host_ms)), "gpu_ms": float(np.median(gpu_ms)) if gpu else None,
            "captures": None if graphs is None else graphs.captures}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=("auto", "cupy", "numpy"))
    p.add_argument("--model", default="1b", choices=sorted(MODELS))
    p.add_argument("--dtype", default=None, help="default bfloat16 on a GPU, float32 on the CPU")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--eager", action="store_true", help="no prefill graphs (the eager prefill)")
    mode.add_argument("--padded", action="store_true",
                      help="prefill graphs that pad each prompt to its call's longest (not packed)")
    p.add_argument("--warmup", type=int, default=0, metavar="ROWS",
                   help="warm the prefill graphs' buckets of up to ROWS rows first (as serve --prefill-warmup)")
    p.add_argument("--tol", type=float, default=None,
                   help="the near-tie rule's tolerance (models.parity; default NEAR_TIE_TOL of the dtype). The "
                        "8b shape's bf16 reference forward (attention over the cache under a mask) and the fresh "
                        "prefill differ by up to 0.35 on ~5.5 logits on the H200, both ~0.4 from fp32: 0.08")
    p.add_argument("--cases", type=int, default=len(CASES), help="run the first N cases")
    p.add_argument("--chunked", action="store_true",
                   help="then the later-chunk cases (a 512-token chunk at 512, alone and beside fresh prompts)")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of one more call of the last case")
    p.add_argument("--json")
    a = p.parse_args(argv)
    backend = get_backend(a.backend)
    dtype = a.dtype or ("bfloat16" if backend.is_gpu else "float32")
    dec = build(a.model, backend, a.eager, dtype, a.padded)
    warmed = [m.warm_prefill(a.warmup) for m in (dec.target, dec.draft)] if a.warmup else []
    for role, w in zip(("target", "draft"), warmed):
        if w:
            print(f"{a.model} {role} warm-up: {w['buckets']} buckets in {w['seconds']:.2f} s")
    rng = np.random.default_rng(0)
    tol = NEAR_TIE_TOL.get(dtype, NEAR_TIE_TOL["bfloat16"]) if a.tol is None else a.tol
    rows = [measure(dec, label, n, lengths, rng, tol=tol) for label, n, lengths in CASES[: a.cases]]
    if a.chunked:
        rows += [measure(dec, label, n, lengths, rng, tol=tol, cached=cached)
                 for label, n, lengths, cached in CHUNK_CASES]
    graphs = dec.target.prefill_graphs
    mode = "eager" if graphs is None else "packed" if graphs.packed else "graphs"
    for r in rows:
        gpu = "-" if r["gpu_ms"] is None else f"{r['gpu_ms']:.2f}"
        print(f"{a.model} {mode} {r['case']:>28}: host {r['host_ms']:7.2f} ms, "
              f"GPU {gpu} ms, {r['tokens']} tokens ({r['padded_to_longest']} padded to the longest), "
              f"captures {r['captures']}")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        label, n, lengths = CASES[a.cases - 1]
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if backend.is_gpu else [])) as prof:
            measure(dec, label, n, lengths, rng, check=False)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "backend": backend.name, "prefill": mode, "warmup_rows": a.warmup, "tol": tol,
                       "warmed": warmed, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()

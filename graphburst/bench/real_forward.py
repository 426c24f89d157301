"""``graphburst bench real --profile forward``: where one Llama forward's time goes.

One verify-shaped forward (T = k + 1) and one draft-shaped forward (T = 1) per model shape,
batch, capacity, attention layout and decode kernels, random weights:

* **graph µs**: the forward captured as a CUDA graph and replayed (medians of ``--trials``),
  against the **bytes floor** = (weight bytes + valid KV bytes read + KV bytes written) / 4.8 TB/s
  (``x floor``). ``--valid`` fixes every sequence's valid KV rows (default capacity / 2), so a
  capacity sweep at a fixed ``--valid`` shows whether the forward follows the bytes it must
  read or the bytes it allocated.
* **kernel time per forward by category** (``--profile-calls`` eager forwards under
  ``torch.profiler``, the kernels the graph replays): GEMM, attention, the fused elementwise
  kernels and other, in total and per layer; the **gap** (graph µs minus the summed kernel
  µs: launch gaps and idle time inside the graph) and **non-GEMM µs per layer**
  ((graph µs - GEMM µs) / layers: everything a layer costs outside its GEMMs, gaps included).

Decode kernels (``--kernels``): ``auto`` is the model's own choice (the fused Triton decode
path on CUDA, SDPA on the CPU), ``cublas`` the fused path with every projection on cuBLAS
(no GEMV), ``gemv`` the fused path with every projection and the head on the Triton GEMV
(``Llama(decode_kernels="gemv")``), ``pdl`` the same with programmatic dependent launch of
every Triton kernel (``decode_kernels="pdl"``), ``folded`` ``pdl`` with the norms, SiLU x up
and the GEMV's split-K sums folded into the projections' kernels (``decode_kernels="folded"``,
``models/decode/folded.py``), ``reference`` the fused path on the kernels'
plain-torch references (how a CPU runs the fused wiring), ``off`` SDPA over the whole cache
under an additive mask. ``gemv``, ``pdl`` and ``folded`` run Triton, so on the CPU only under
``TRITON_INTERPRET=1`` (else they are SDPA there, as ``auto`` is, and timed once). Under
``pdl`` the kernels overlap (each one's profiled time includes its wait on the one before),
so the kernel sum can pass the graph time and the gap go negative: compare graph µs. ``fold``
attention is ``Llama(fold_gqa=True)``; the model ``8b-tp2`` is one rank's shard of the 8b
shape under TP=2 (heads, KV heads, FFN and head rows halved), without the collectives.

**Correctness first**: every fused forward is checked against the SDPA forward on the same
weights and KV before it is timed; one that disagrees is reported and not timed, and the
command exits 1 after writing everything else. On the CPU the figures are host time of
plain calls and self CPU time per op (a correctness run, not a GPU timing).
"""

from __future__ import annotations

import os
import re

from .common import fmt, new_table

#: HBM bandwidth the floor divides by (H200: 4.8 TB/s)
HBM_BYTES_PER_S = 4.8e12
#: the fused forward's label per ``--kernels`` choice (a choice without the fused path is "sdpa")
PATHS = {"auto": "fused", "cublas": "fused-cublas", "gemv": "fused-gemv", "pdl": "fused-pdl",
         "folded": "fused-folded", "reference": "fused-reference"}
#: kernel name -> category, first match wins. Attention goes first: PyTorch's memory-efficient
#: attention is a CUTLASS kernel (``fmha_cutlassF_...``) and flash's split-KV kernels say "splitkv".
#: GEMM: cuBLAS / cuBLASLt / CUTLASS names on the H200 (``nvjet_...``, ``..._gemm_...``), the
#: Triton GEMV (``models/decode/gemv.py``: ``_gemv`` and its split-K sum ``_split_k_sum``; the folded
#: ``_folded_gemv``, its norm and SiLU prologues included) and the CPU's aten matrix products.
#: fused: the per-layer elementwise work (graphburst's Triton ``_add_rmsnorm``, ``_rope_kv_write``,
#: ``_silu_mul``; aten's norm kernel on the SDPA path).
#: other: the rest (copies, adds, index, argmax...).
CATEGORIES = (
    ("attention", re.compile(r"attention|attn|fmha|flash|sdpa|_combine|softmax", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|split_?k|^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$",
                        re.IGNORECASE)),
    ("fused", re.compile(r"rmsnorm|rms_norm|layer_norm|rope|rotary|silu|swiglu|kv_write", re.IGNORECASE)),
)
OTHER = "other"
#: the TP=2 shard of the 8b shape (a forward-view model only: it has no draft to prefill)
SHARD = "8b-tp2"


def shape(name: str):
    """The LlamaConfig of a model of ``real_models.MODELS`` or of :data:`SHARD`."""
    from .real_models import MODELS

    if name == SHARD:
        from ..parallel.tp import local_config

        full = MODELS["8b"].cfg
        return local_config(full, 2).replace(vocab_size=-(-full.vocab_size // 2))
    return MODELS[name].cfg


def param_bytes(cfg, elem: int) -> int:
    """Bytes of a model's parameters from its config alone (the memory check, before anything is built)."""
    d, hd, h, kv, f = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.intermediate_size
    layer = d * hd * (2 * h + 2 * kv) + 3 * d * f + 2 * d
    tables = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    return (cfg.num_hidden_layers * layer + d + tables) * elem


def kv_row_bytes(cfg, elem: int) -> int:
    """One position's K and V in every layer."""
    return 2 * cfg.num_key_value_heads * cfg.head_dim * elem * cfg.num_hidden_layers


def floor_us(cfg, wbytes: int, b: int, t: int, valid: int, elem: int) -> float:
    """(weights + valid KV rows read + new KV rows written) / HBM bandwidth, in µs."""
    row = kv_row_bytes(cfg, elem)
    return (wbytes + b * (valid + t) * row + b * t * row) / HBM_BYTES_PER_S * 1e6


def check(model, tok, pos, lengths) -> float:
    """Max |fused - SDPA| logits over the same weights and KV, relative to the largest logit (the KV is
    restored after); AssertionError past the bound."""
    saved = [kv.clone() for kv in model.kv]
    ops, model.decode_ops = model.decode_ops, None
    try:
        want = model(tok, pos, lengths)
    finally:
        model.decode_ops = ops
    for kv, s in zip(model.kv, saved):
        kv.copy_(s)
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
        raise AssertionError(f"fused forward disagrees with SDPA: max |diff| {err:.4g} (logits up to {scale:.4g})")
    return err / max(scale, 1e-9)


def category(name: str) -> str:
    """A kernel's category (``CATEGORIES``), ``other`` if none matches."""
    return next((cat for cat, pat in CATEGORIES if pat.search(name)), OTHER)


def breakdown(totals: dict, layers: int, calls: int, graph_us: float, top: int) -> dict:
    """Per-forward kernel time by category from ``{name: (launches, µs)}`` of ``calls`` profiled forwards.

    ``gap_us``: graph-replay time minus the summed kernel time (launch gaps and idle time
    inside the graph). ``nongemm_per_layer_us``, (graph µs - GEMM µs) / layers, is everything
    a layer costs outside its GEMMs, gaps included (the head GEMM is a GEMM too; embedding,
    final norm and argmax count, a few µs); ``nongemm_kernel_per_layer_us`` leaves the gaps out.
    """
    if calls < 1 or layers < 1:
        raise ValueError(f"calls ({calls}) and layers ({layers}) must be >= 1")
    cats = {cat: [0, 0.0] for cat, _ in CATEGORIES} | {OTHER: [0, 0.0]}
    for name, (n, us) in totals.items():
        c = cats[category(name)]
        c[0] += n
        c[1] += us
    total = sum(us for _, us in totals.values()) / calls
    launches = sum(n for n, _ in totals.values()) / calls
    gemm = cats["gemm"][1] / calls
    out = {"kernel_sum_us": round(total, 1), "kernels": round(launches, 1), "per_layer": round(launches / layers, 1),
           "gap_us": round(graph_us - total, 1), "gap_per_layer_us": round((graph_us - total) / layers, 2),
           "nongemm_per_layer_us": round((graph_us - gemm) / layers, 2),
           "nongemm_kernel_per_layer_us": round((total - gemm) / layers, 2)}
    for cat, (n, us) in cats.items():
        out[f"{cat}_us"] = round(us / calls, 1)
        out[f"{cat}_per_layer_us"] = round(us / calls / layers, 2)
        out[f"{cat}_kernels"] = round(n / calls, 1)
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    out["top"] = [(nm[:90], category(nm), round(c / calls, 1), round(us / calls, 1)) for nm, (c, us) in rows]
    return out


def profile_forward(fn, layers: int, top: int, graph_us: float, calls: int, cuda: bool, trace=None) -> dict:
    """``calls`` eager forwards under torch.profiler (the kernels the graph replays), per forward."""
    from .real_profile import op_totals, profiled

    def forwards():
        for _ in range(calls):
            fn()

    prof = profiled(forwards, cuda, trace, only_cuda=True)
    out = {"profiled_calls": calls, **breakdown(op_totals(prof, cuda), layers, calls, graph_us, top)}
    if trace is not None:
        out["trace"] = trace
    return out


def run(s: dict, backend, console, failures: list) -> list[dict]:
    """Every config of the sweep, checked then timed; one record each (a failed check: ``failed``, no times)."""
    import torch

    from ..models import llama_decode
    from .graph_timing import graph_us
    from .real_models import random_target

    cuda = backend.is_gpu
    device = f"cuda:{backend.device_id}" if cuda else "cpu"
    dtype = getattr(torch, s["dtype"])
    elem = dtype.itemsize
    out = []
    configs = [(n, b, c, at) for n in s["models"] for b in s["batches"] for c in s["capacities"]
               for at in s["attention"]]
    for name, b, cap, attn in configs:
        cfg = shape(name)
        valid = cap // 2 if s["valid"] is None else s["valid"]
        model = random_target(None, cfg=cfg, batch=b, capacity=cap, kv_slack=s["k"] + 2, dtype=dtype, device=device,
                              fold_gqa=attn == "fold", seed=s["seed"])
        fused = model.decode_ops  # the model's own choice ("auto"): Triton on CUDA, None (SDPA) on the CPU
        fits = llama_decode.unsupported(model) is None
        ops = {"auto": fused, "cublas": fused and fused._replace(gemv_max_m=0), "off": None,
               "reference": llama_decode.reference_ops() if fits else None}
        for kern in ("gemv", "pdl", "folded"):  # built only when asked for: they import Triton
            if kern in s["kernels"]:
                runs = fits and llama_decode.triton_runs_on(torch.device(device))
                if runs:
                    ops[kern] = llama_decode.folded_ops() if kern == "folded" else \
                        llama_decode.gemv_ops(pdl=kern == "pdl")
                else:
                    ops[kern] = None
        gen = torch.Generator(device=device).manual_seed(s["seed"])
        for kv in model.kv:
            kv.normal_(generator=gen)
        lengths = [torch.full((b,), valid, dtype=torch.int32, device=device)] * cfg.num_hidden_layers
        pos = torch.full((b,), valid, dtype=torch.int32, device=device)
        # Every parameter, an untied embedding table too (of which a forward gathers B * T rows): the
        # floor as the published profiles computed it.
        wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for t in s["tokens"] or (s["k"] + 1, 1):
            tok = torch.randint(0, cfg.vocab_size, (b, t), device=device, generator=gen)
            fn = lambda: model(tok, pos, lengths)  # noqa: E731
            done = set()
            for kern in s["kernels"]:
                model.decode_ops = ops[kern]
                path = "sdpa" if model.decode_ops is None else PATHS[kern]
                if path in done:  # "auto" is "off" where the fused path does not run (the CPU): time it once
                    continue
                done.add(path)
                fl = floor_us(cfg, wbytes, b, t, valid, elem)
                rec = {"shape": name, "batch": b, "T": t, "capacity": cap, "valid": valid, "attention": attn,
                       "path": path, "floor_us": round(fl, 1)}
                with torch.no_grad():
                    try:
                        err = check(model, tok, pos, lengths) if model.decode_ops is not None else None
                    except AssertionError as exc:
                        rec["failed"] = str(exc)
                        failures.append(f"forward {summary_head(rec)}: {exc}")
                        out.append(rec)
                        continue
                    g_us = graph_us(fn, reps=1, trials=s["trials"], cuda=cuda)
                    trace = None if s["trace"] is None else os.path.join(
                        s["trace"], f"forward_{name}_B{b}_T{t}_cap{cap}_{attn}_{path}.json")
                    prof = {} if not s["profile_calls"] else profile_forward(
                        fn, cfg.num_hidden_layers, s["top"], g_us, s["profile_calls"], cuda, trace)
                rec.update(graph_us=round(g_us, 1), x_floor=round(g_us / fl, 2),
                           check_rel_diff=None if err is None else round(err, 4), **prof)
                out.append(rec)
                console.print(summary(rec), markup=False, highlight=False)
        del model, lengths
        if cuda:
            torch.cuda.empty_cache()
    return out


def table(records: list, title_label: str):
    """One row per config (the per-kernel split when profiled, ``-`` otherwise; a failed check says so)."""
    t = new_table(f"forward: Llama forward, {title_label}; graph-replay medians, per-forward kernel µs by category",
                  ("model", "B", "T", "cap", "valid", "attention", "path", "graph µs", "floor µs", "x floor",
                   "GEMM µs", "attn µs", "fused µs", "other µs", "gap µs", "non-GEMM µs/layer", "kernels/layer",
                   "check"))
    for r in records:
        prof = [fmt(r.get(key), 0) for key in ("gemm_us", "attention_us", "fused_us", "other_us", "gap_us")]
        check_txt = ("[red]FAILED[/red] (see the JSON)" if "failed" in r else
                     "-" if r["check_rel_diff"] is None else f"{r['check_rel_diff']:.4f} of max |logit|")
        t.add_row(r["shape"], str(r["batch"]), str(r["T"]), str(r["capacity"]), str(r["valid"]), r["attention"],
                  r["path"], fmt(r.get("graph_us"), 0), fmt(r["floor_us"], 0), fmt(r.get("x_floor")), *prof,
                  fmt(r.get("nongemm_per_layer_us")), fmt(r.get("per_layer"), 1), check_txt)
    return t


def summary_head(r: dict) -> str:
    return f"{r['shape']} B={r['batch']} T={r['T']} cap={r['capacity']} {r['attention']} {r['path']}"


def summary(r: dict) -> str:
    """One line per config for a batch log."""
    if "failed" in r:
        return f"{summary_head(r)}: FAILED: {r['failed']}"
    line = f"{summary_head(r)}: graph {r['graph_us']:.0f} µs ({r['x_floor']:.2f}x floor)"
    if "gemm_us" in r:
        line += (f"; GEMM {r['gemm_us']:.0f}, attention {r['attention_us']:.0f}, fused {r['fused_us']:.0f}, "
                 f"other {r['other_us']:.0f}, gap {r['gap_us']:.0f} µs; non-GEMM {r['nongemm_per_layer_us']} "
                 f"µs/layer")
    return line

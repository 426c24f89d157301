"""``graphburst bench real --profile prefill``: what admitting prompts costs a real model.

A random-weight model of ``graphburst bench real`` behind a SpecDecoder of :data:`BATCH`
slots; each case admits some prompts at position 0 with one ``prefill_checked`` call,
:data:`REPS` times (new slots each time), and the figures are medians over the last
:data:`TIMED` (so a prefill-graph bucket is captured by then: ``models.prefill_graphs``).
Host time is the call's own (it never waits for the GPU); GPU time is a CUDA event pair
around it on the decoder's stream.

**Correctness first**: each case's first call is checked, before any call is timed, against
the model's own greedy continuation (a full re-run of each prompt that shares no state with
the prefill), under the near-tie rule; a case that fails is reported and not timed, and the
command exits 1 after writing everything else.

``--prefill-mode``: ``auto`` (the adapters' default: packed prefill graphs on a GPU, the
eager prefill on the CPU), ``padded`` (prefill graphs that pad each prompt to its call's
longest instead of packing the prompts end to end) or ``eager`` (no prefill graphs).
``--prefill-warmup ROWS`` warms the graphs' buckets first, as serving does;
``--prefill-chunked`` adds the later-chunk cases (:data:`CHUNK_CASES`).
"""

from __future__ import annotations

import os
import time

import numpy as np

from .common import fmt, new_table

BATCH, MAX_PROMPT = 64, 512
REPS, TIMED = 6, 4  # calls per case, of which the last TIMED are timed
#: (label, rows, lengths): fixed sizes, and lognormal lengths (mean 128 in [16, 512], the load
#: benchmark's) drawn once per case ("the same") or anew for every call ("new each time": cold buckets)
CASES = (("1 x 128", 1, 128), ("1 x 512", 1, 512), ("4 x 128", 4, 128), ("11 x 128", 11, 128),
         ("11 lognormal, the same", 11, "same"), ("11 lognormal, new each time", 11, "new"))
#: (label, rows, lengths, cached): a prompt's later chunk of 512 tokens behind its first ``cached``
#: (written, untimed, by a non-final chunk just before), alone or beside fresh lognormal prompts:
#: what a chunked-prefill server (``--prefill-chunk 512``) admits while a long prompt arrives
CHUNK_CASES = (("1 x 512 at 512", 1, 512, 512), ("1 x 512 at 512 + 10 lognormal", 11, "same", 512))
MODES = ("auto", "padded", "eager")


def capacity(s: dict) -> int:
    """KV rows per slot: a later chunk's whole prompt (two of MAX_PROMPT) and a burst after it."""
    return 2 * MAX_PROMPT + s["m"] * (s["k"] + 1)


def _lognormal(rng, n):
    return np.clip(np.rint(rng.lognormal(np.log(128) - 0.125, 0.5, n)), 16, MAX_PROMPT).astype(int)


def build(name: str, backend, s: dict):
    """The model's SpecDecoder of BATCH slots, its prefill as ``s["prefill_mode"]`` says."""
    import torch

    from ..engine.decoder import SpecDecoder
    from ..models.torch_adapter import TorchDraft, TorchTarget
    from .real_models import MODELS, instance, random_target, subspace_draft

    spec = MODELS[name]
    device = f"cuda:{backend.device_id}" if backend.is_gpu else "cpu"
    cap = capacity(s)
    src = random_target(spec, batch=BATCH, capacity=cap, kv_slack=s["k"] + 2, dtype=getattr(torch, s["dtype"]),
                        device=device, seed=s["seed"])
    draft = instance(src, layers=spec.draft_layers) if spec.draft_cfg is None else subspace_draft(src, spec,
                                                                                                  seed=s["seed"])
    mode = s["prefill_mode"]
    graphs = False if mode == "eager" else None  # None: the adapters' default (on a GPU)
    packed = False if mode == "padded" else None  # None: packed where the module can
    kw = dict(batch=BATCH, capacity=cap, backend=backend, prefill_graphs=graphs, packed_prefill=packed)
    return SpecDecoder(TorchTarget(src, **kw), TorchDraft(draft, **kw), k=s["k"], m_rounds=s["m"])


def check_first_tokens(dec, rows: dict, tol: float) -> None:
    """pend after the prefill against the model's own greedy next token (row BATCH - 1 as scratch),
    under the near-tie rule (``models.parity``): in bf16 a fresh prefill and a whole re-run reduce
    in other orders, so two candidates whose logits lie within the rounding may swap."""
    import torch

    from ..models.parity import near_tie

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
    """REPS calls of one case, the last TIMED timed; the first checked (AssertionError) before any is timed.

    ``cached``: the first slot's call is a later chunk of 512 tokens at that position, its
    first ``cached`` tokens written just before (untimed).
    """
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
            check_first_tokens(dec, rows, tol)
        if rep >= REPS - TIMED:
            host_ms.append((t1 - t0) * 1e3)
            if gpu:
                gpu_ms.append(start.elapsed_time(end))
    graphs = dec.target.prefill_graphs
    return {"case": label, "rows": n, "tokens": int(sum(len(r) for r in call.values())),
            "padded_to_longest": int(n * max(len(r) for r in call.values())),
            "host_ms": float(np.median(host_ms)), "gpu_ms": float(np.median(gpu_ms)) if gpu else None,
            "captures": None if graphs is None else graphs.captures}


def run(s: dict, backend, console, failures: list) -> list[dict]:
    """One entry per model: its mode, tolerance, warm-up and one row per case (a failed case: ``failed``)."""
    from ..models.parity import NEAR_TIE_TOL
    from .real_profile import op_totals, profiled, top_rows

    out = []
    for name in s["models"]:
        dec = build(name, backend, s)
        warmed = [m.warm_prefill(s["prefill_warmup"]) for m in (dec.target, dec.draft)] if s["prefill_warmup"] else []
        for role, w in zip(("target", "draft"), warmed):
            if w:
                console.print(f"{name} {role} warm-up: {w['buckets']} buckets in {w['seconds']:.2f} s")
        rng = np.random.default_rng(s["seed"])
        tol = NEAR_TIE_TOL.get(s["dtype"], NEAR_TIE_TOL["bfloat16"]) if s["prefill_tol"] is None else s["prefill_tol"]
        cases = [(label, n, lengths, 0) for label, n, lengths in CASES[: s["prefill_cases"]]]
        if s["prefill_chunked"]:
            cases += list(CHUNK_CASES)
        rows = []
        for label, n, lengths, cached in cases:
            try:
                rows.append(measure(dec, label, n, lengths, rng, tol=tol, cached=cached))
            except AssertionError as exc:
                rows.append({"case": label, "rows": n, "failed": str(exc)})
                failures.append(f"prefill {name} {label}: {exc}")
        graphs = dec.target.prefill_graphs
        entry = {"model": name, "backend": backend.name,
                 "prefill": "eager" if graphs is None else "packed" if graphs.packed else "graphs",
                 "warmup_rows": s["prefill_warmup"], "tol": tol, "warmed": warmed, "results": rows}
        if s["trace"] is not None and cases:
            label, n, lengths, cached = cases[-1]
            path = os.path.join(s["trace"], f"prefill_{name}.json")
            prof = profiled(lambda: measure(dec, label, n, lengths, rng, check=False, cached=cached), backend.is_gpu,
                            path)
            entry["profile"] = {"case": label, "trace": path, "calls": REPS,
                                "top_host": top_rows(op_totals(prof, False), REPS),
                                "top_kernels": top_rows(op_totals(prof, True), REPS) if backend.is_gpu else None}
        out.append(entry)
        del dec
    return out


def table(entries: list, title_label: str):
    """One row per model and case: host and GPU ms of one admission, medians."""
    t = new_table(f"prefill: one prefill_checked admission into {BATCH} slots, {title_label}; medians of the last "
                  f"{TIMED} of {REPS} calls",
                  ("model", "prefill", "case", "rows", "tokens", "padded to longest", "host ms", "GPU ms", "captures",
                   "first tokens"))
    for e in entries:
        for r in e["results"]:
            if "failed" in r:
                t.add_row(e["model"], e["prefill"], r["case"], str(r["rows"]), "-", "-", "-", "-", "-",
                          "[red]FAILED[/red] (see the JSON)")
                continue
            t.add_row(e["model"], e["prefill"], r["case"], str(r["rows"]), str(r["tokens"]),
                      str(r["padded_to_longest"]), fmt(r["host_ms"]), fmt(r["gpu_ms"]),
                      "-" if r["captures"] is None else str(r["captures"]), f"greedy (tol {e['tol']:g})")
    return t


def summary(entry: dict) -> list[str]:
    """One line per case for a batch log."""
    out = []
    for r in entry["results"]:
        head = f"{entry['model']} {entry['prefill']} {r['case']}"
        if "failed" in r:
            out.append(f"{head}: FAILED: {r['failed']}")
            continue
        gpu = "-" if r["gpu_ms"] is None else f"{r['gpu_ms']:.2f}"
        out.append(f"{head}: host {r['host_ms']:.2f} ms, GPU {gpu} ms, {r['tokens']} tokens "
                   f"({r['padded_to_longest']} padded to the longest), captures {r['captures']}")
    return out

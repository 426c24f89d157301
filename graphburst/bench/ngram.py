"""``graphburst bench ngram``: the prompt-lookup drafter, its search and end to end.

Part 1 (:mod:`.ngram_search`): µs per round of the search kernel against batch and
history length, each config checked bit-exact against the numpy twin before it is timed
(CUDA events around graph replays, medians).

Part 2 (:mod:`.ngram_e2e`): acceptance and tokens/s of graphburst with ``NgramDraft``
against the same target's plain graphed decoding (graphburst's own with no draft, and a torch
graph of plain forwards), the same lookup synced every round, and
transformers' ``generate`` plain and with prompt lookup, per workload, batch and k. The
target is a random-weight shape (``--model tiny|small|1b``, default 1b: token-id workloads)
or a trained checkpoint (``--model smollm2-135m``, a GGUF file or a directory with a
tokenizer: the real-text classes of :mod:`.text_prompts`, chat requests through the model's
own template). **Correctness first**: every engine's tokens are compared with graphburst's
before any timing (identical, or up to a first divergence that is a near-tie of the target's
own logits, the rule of ``bench real``); an engine that fails is recorded, never timed, and
the command exits 1. Then ``--reps`` timed runs per engine, each from the prompts to the last
token (prefill and syncs included), medians. A fixed number of tokens is
generated (no stop at the end of turn), the same for every engine.
"""

from __future__ import annotations

import functools
import statistics

from rich.console import Console

from ..cli_args import (FlagError, add_decode_kernels_flag, check_decode_kernels, checkpoint, int_in, real_in,
                        writable_file)
from ..constants import MAX_K, NGRAM_MAX
from ..models.ngram import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN
from .common import fmt, int_list, label, new_table, write_results
from .ngram_search import run_search_bench

PARTS = ("search", "e2e")
#: the end-to-end engines: k-independent ones, then those run at every k (the HF ones at B = 1 only)
ENGINES = ("plain", "graphburst-plain", "hf-plain", "graphburst-ngram", "graphburst-ngram-sync", "hf-lookup")
MODEL_NAMES = ("tiny", "small", "1b")
SMOKE = dict(model="tiny", batches="1,2", histories="64,512", e2e_batches="1,2", prompt_len=32, new_tokens=24,
             reps=1, m=2, workloads="random,repeat,echo", k="4")
FULL = dict(model="1b", batches="1,8,64,256", histories="512,2048,8192,32768", e2e_batches="1,16", prompt_len=512,
            new_tokens=256, reps=3, m=8, workloads="random,repeat,echo", k="4")
#: the defaults a trained checkpoint changes (--model smollm2-135m): the text classes, three k, three batches
CHECKPOINT = dict(e2e_batches="1,16,64", new_tokens=128, k="2,4,8", workloads="edit_code,rewrite_prose,"
                  "quote_document,continue_list,open_questions")


def add_parser(sub) -> None:
    p = sub.add_parser("ngram", help="prompt-lookup drafting: the search's us per round, acceptance and tokens/s")
    p.add_argument("--backend", choices=("auto", "cupy", "numpy"), default="auto",
                   help="cupy (GPU), numpy (CPU reference) or auto")
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes: every code path in seconds (CI)")
    p.add_argument("--parts", default="search,e2e", help="comma list of search,e2e")
    p.add_argument("--batches", default=None, help="search: comma list of B (default 1,8,64,256)")
    p.add_argument("--histories", default=None, help="search: comma list of history lengths (default 512..32768)")
    p.add_argument("--model", default=None,
                   help=f"e2e target: a random-weight shape ({','.join(MODEL_NAMES)}; default 1b), or a checkpoint "
                        "with a tokenizer (smollm2-135m, a .gguf file, a directory): its real-text workloads")
    p.add_argument("--e2e-batches", default=None, help="e2e: comma list of B (default 1,16; HF runs B=1 only)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="e2e: comma list of the engines timed (default all; graphburst-ngram at the first k "
                        "also runs untimed as every engine's reference)")
    p.add_argument("--workloads", default=None,
                   help="e2e: comma list of random,repeat,echo (token ids), or, with a checkpoint, of edit_code,"
                        "rewrite_prose,quote_document,continue_list,open_questions (real text, the default there)")
    p.add_argument("--prompt-len", type=int_in(4, 16384), default=None, help="e2e: prompt tokens (default 512)")
    p.add_argument("--new-tokens", type=int_in(2, 16384), default=None, help="e2e: tokens generated (default 256)")
    p.add_argument("-k", default=None, help=f"drafts per round, a comma list in 1..{MAX_K} (default 4; 2,4,8 "
                                             "with a checkpoint)")
    p.add_argument("-m", type=int_in(1, 64), default=None, help="rounds per burst (default 8)")
    p.add_argument("--ngram-min", type=int_in(1, NGRAM_MAX), default=DEFAULT_NGRAM_MIN,
                   help="shortest n-gram looked up")
    p.add_argument("--ngram-max", type=int_in(1, NGRAM_MAX), default=DEFAULT_NGRAM_MAX,
                   help="longest n-gram looked up, tried first")
    p.add_argument("--reps", type=int_in(1, 1000), default=None, help="timed runs per config (search: x10)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default bf16 on GPU, fp32 on CPU")
    add_decode_kernels_flag(p)
    p.add_argument("--tol", type=real_in(0.0, 1.0), default=0.01, help="near-tie tolerance (as bench real)")
    p.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0, help="seed of the weights, prompts and histories")
    p.add_argument("--json", type=writable_file, default="ngram_bench.json", help="results file (JSON)")


def settings(args) -> dict:
    d = dict(SMOKE if args.smoke else FULL)
    if args.model is not None and args.model not in MODEL_NAMES:
        d.update(model=args.model, **({} if args.smoke else CHECKPOINT))
        if args.smoke:
            d["workloads"] = CHECKPOINT["workloads"]
    for name in d:
        if getattr(args, name, None) is not None:
            d[name] = getattr(args, name)
    return dict(d, parts=args.parts.split(","), batches=int_list(d["batches"]),
                histories=int_list(d["histories"]), e2e_batches=int_list(d["e2e_batches"]),
                workloads=d["workloads"].split(","), ks=int_list(d["k"]),
                n_min=args.ngram_min, n_max=args.ngram_max, tol=args.tol, seed=args.seed, dtype=args.dtype,
                decode_kernels=args.decode_kernels or "auto", engines=args.engines.split(","))


def check_args(args) -> None:
    """Every flag checked before any work (FlagError names the flag)."""
    for flag, text in (("--batches", args.batches), ("--histories", args.histories),
                       ("--e2e-batches", args.e2e_batches)):
        if text is not None:
            try:
                values = int_list(text)
            except ValueError:
                raise FlagError(flag, f"a comma list of positive ints is needed, got {text!r}") from None
            if not values or min(values) < 1:
                raise FlagError(flag, f"needs positive values, got {text!r}")
    if args.k is not None:
        try:
            ks = int_list(args.k)
        except ValueError:
            raise FlagError("-k", f"a comma list of ints in 1..{MAX_K} is needed, got {args.k!r}") from None
        if not ks or not all(1 <= k <= MAX_K for k in ks):
            raise FlagError("-k", f"needs values in 1..{MAX_K}, got {args.k!r}")
    if args.model is not None and args.model not in MODEL_NAMES:
        checkpoint(args.model, flag="--model")
    check_decode_kernels(args.decode_kernels, args.backend)
    if args.ngram_min > args.ngram_max:
        raise FlagError("--ngram-min", f"{args.ngram_min} is above --ngram-max {args.ngram_max}")
    s = settings(args)
    bad = [e for e in s["engines"] if e not in ENGINES]
    if bad or not s["engines"]:
        raise FlagError("--engines", f"choose from {','.join(ENGINES)}, got {args.engines!r}")
    bad = [p for p in s["parts"] if p not in PARTS]
    if bad or not s["parts"]:
        raise FlagError("--parts", f"choose from {','.join(PARTS)}, got {args.parts!r}")
    from .ngram_e2e import TEXT_WORKLOADS, WORKLOADS  # torch is needed by part 2 only

    allowed = WORKLOADS + (TEXT_WORKLOADS if s["model"] not in MODEL_NAMES else ())
    bad = [w for w in s["workloads"] if w not in allowed]
    if bad:
        why = " (the text workloads need a checkpoint with a tokenizer)" if bad[0] in TEXT_WORKLOADS else ""
        raise FlagError("--workloads", f"unknown workload {bad[0]!r}{why} (choose from {','.join(allowed)})")


def _search_part(console, backend, s) -> tuple:
    reps = 10 * s["reps"]
    ks = ",".join(map(str, s["ks"]))
    table = new_table(f"ngram_search, us per round (k={ks}, n={s['n_min']}..{s['n_max']}) - {label(backend)}",
                      ["k", "B", "history", "checked", "drafts", "us median", "us min", "host numpy twin us"])
    rows = []
    for k in s["ks"]:
        part = run_search_bench(backend, batches=s["batches"], histories=s["histories"], k=k, n_min=s["n_min"],
                                n_max=s["n_max"], reps=reps,
                                progress=lambda r, k=k: console.print(f"search k={k} B={r['batch']} H={r['history']}: "
                                                                      f"{r['us_median']:.2f} us"))
        for r in part:
            r["k"] = k
            table.add_row(str(k), str(r["batch"]), str(r["history"]), "yes", str(r["drafts_proposed"]),
                          fmt(r["us_median"]), fmt(r["us_min"]), fmt(r["host_twin_us"], 0))
        rows += part
    return table, rows


def _target(s, backend, dtype, device):
    """(source model, tokenizer or None, description) of ``--model``: a random shape or a checkpoint."""
    from .real_models import MODELS, random_target
    from ..models.tokenizer import render_user_message
    from .text_prompts import CLASSES, load_prompts

    kv_slack = max(s["ks"]) + 2
    slack = s["new_tokens"] + s["m"] * (max(s["ks"]) + 1) + 8  # a prompt's rows beyond it
    batch = max(s["e2e_batches"])
    if s["model"] in MODEL_NAMES:
        spec = MODELS[s["model"]]
        src = random_target(spec, batch=batch, capacity=s["prompt_len"] + slack, kv_slack=kv_slack, dtype=dtype,
                            device=device, seed=s["seed"], decode_kernels=s["decode_kernels"])
        return src, None, spec.note
    from ..models.checkpoint import load_llama
    from ..models.tokenizer import checkpoint_tokenizer

    tokenizer = checkpoint_tokenizer(s["model"])
    # the longest prompt sizes the KV capacity: a rendered text prompt, or prompt_len token ids
    lengths = [len(render_user_message(tokenizer, text)) for wl in s["workloads"] if wl in CLASSES for text in load_prompts(wl)]
    lengths += [s["prompt_len"]] if any(wl not in CLASSES for wl in s["workloads"]) else []
    src = load_llama(s["model"], batch=batch, capacity=max(lengths) + slack, dtype=dtype, device=device,
                     kv_slack=kv_slack, decode_kernels=s["decode_kernels"])
    return src, tokenizer, f"{s['model']} (trained checkpoint)"


def _e2e_part(console, backend, s) -> tuple:
    import torch

    from ..engine.mode import BurstMode
    from .ngram_e2e import HFGenerate, NgramBurst, PlainLoop, timed, workload
    from .real_checks import compare_other, reference_logits
    from .real_models import instance

    device = "cuda" if backend.is_gpu else "cpu"
    dtype = getattr(torch, s["dtype"] or ("bfloat16" if backend.is_gpu else "float32"))
    src, tokenizer, note = _target(s, backend, dtype, device)
    ref_model = instance(src, batch=1)
    oracle = lambda prompt, prefix: reference_logits(ref_model, prompt, prefix)  # noqa: E731
    ks = ",".join(map(str, s["ks"]))
    kernels = "" if s["decode_kernels"] == "auto" else f", decode kernels {s['decode_kernels']}"
    table = new_table(f"prompt lookup, {s['model']} target ({str(dtype).split('.')[-1]}{kernels}), k={ks}, M={s['m']}, "
                      f"n={s['n_min']}..{s['n_max']}, {s['new_tokens']} new tokens - {label(backend)}",
                      ["workload", "B", "k", "engine", "tokens/s", "tokens/forward", "accepted/round",
                       "rounds/sync", "agreed", "vs plain", "vs synced"])
    rows, failures = [], []  # failures: engines whose tokens diverged from graphburst's, not at a near-tie
    for batch in s["e2e_batches"]:
        # k-independent engines: plain graphed decoding (2M forwards per graph replay: a burst's most at k=1).
        # Only the engines asked for are built.
        burst = functools.partial(NgramBurst, src, batch=batch, m=s["m"], n_min=s["n_min"], n_max=s["n_max"],
                                  backend=backend)
        makers = {"plain": lambda: PlainLoop(src, batch=batch, steps=2 * s["m"]),
                  "graphburst-plain": lambda: burst(k=0)}
        if batch == 1:
            makers["hf-plain"] = lambda: HFGenerate(src, lookup=0, n_max=s["n_max"])
        fixed = {name: make() for name, make in makers.items() if name in s["engines"]}
        by_k = {}
        for k in s["ks"]:
            makers = {"graphburst-ngram": lambda k=k: burst(k=k),
                      "graphburst-ngram-sync": lambda k=k: burst(k=k, mode=BurstMode.PER_ROUND_SYNC)}
            if batch == 1:
                makers["hf-lookup"] = lambda k=k: HFGenerate(src, lookup=k, n_max=s["n_max"])
            by_k[k] = {name: make() for name, make in makers.items() if name in s["engines"]}
        # the reference every engine is checked against: graphburst at the first k, untimed
        reference = by_k[s["ks"][0]].get("graphburst-ngram") or burst(k=s["ks"][0])
        for wl in s["workloads"]:
            prompts = workload(wl, src, batch=batch, prompt_len=s["prompt_len"], seed=s["seed"] + batch,
                               tokenizer=tokenizer)
            ref, _, _ = timed(reference, prompts, s["new_tokens"])
            runs = [(None, name, eng) for name, eng in fixed.items()] + \
                [(k, name, eng) for k in s["ks"] for name, eng in by_k[k].items()]
            results = {}
            for k, name, eng in runs:
                tokens, info, _ = timed(eng, prompts, s["new_tokens"])  # the check, and a warm-up
                try:
                    agreed = [compare_other(f"{name} ({wl}, B={batch}, k={k}, seq {b})", tokens[b], ref[b],
                                            list(prompts[b]), oracle, s["tol"])["agreed"] for b in range(batch)]
                except AssertionError as exc:  # recorded, never timed; the exit status says so (as bench real)
                    failures.append(str(exc))
                    console.print(f"[red]FAILED correctness[/red]: {exc}")
                    rows.append(dict(workload=wl, batch=batch, k=k, engine=name, failed=str(exc)[:300]))
                    table.add_row(wl, str(batch), "-" if k is None else str(k), name, "FAILED", *["-"] * 6)
                    continue
                secs = [timed(eng, prompts, s["new_tokens"])[2] for _ in range(s["reps"])]
                tps = batch * s["new_tokens"] / statistics.median(secs)
                per_forward = (info["accepted"] + info["rounds"]) / info["rounds"] if "rounds" in info else \
                    (s["new_tokens"] / info["forwards"] if name.startswith("hf-lookup") else 1.0)
                accepted = info["accepted"] / info["rounds"] if "rounds" in info else \
                    (per_forward - 1.0 if name == "hf-lookup" else None)
                results[(k, name)] = dict(workload=wl, batch=batch, k=k, engine=name, tokens_per_s=tps,
                                          tokens_per_forward=per_forward, accepted_per_round=accepted,
                                          rounds_per_sync=info.get("rounds_per_sync"),
                                          agreed_tokens=min(agreed), compared_tokens=s["new_tokens"],
                                          seconds_median=statistics.median(secs), reps=s["reps"])
            plain = results.get((None, "plain"), {}).get("tokens_per_s")
            for (k, name), r in results.items():
                r["speedup_vs_plain"] = None if plain is None else r["tokens_per_s"] / plain
                synced = results.get((k, "graphburst-ngram-sync"))
                r["speedup_vs_synced"] = synced and r["tokens_per_s"] / synced["tokens_per_s"] \
                    if name == "graphburst-ngram" else None
                rows.append(r)
                table.add_row(wl, str(batch), "-" if k is None else str(k), name, fmt(r["tokens_per_s"], 1),
                              fmt(r["tokens_per_forward"]), fmt(r["accepted_per_round"]), fmt(r["rounds_per_sync"]),
                              f"{r['agreed_tokens']}/{r['compared_tokens']}", fmt(r["speedup_vs_plain"]),
                              fmt(r["speedup_vs_synced"]))
            console.print(f"e2e {wl} B={batch}: " + ", ".join(f"{n}{'' if k is None else f' k={k}'} "
                                                              f"{r['tokens_per_s']:.1f} tok/s"
                                                              for (k, n), r in results.items()))
    return table, rows, dict(model=note, dtype=str(dtype), capacity=src.capacity, failures=failures)


def run(args, console: Console, backend) -> int:
    s = settings(args)
    tables, results, meta = [], {}, {}
    if "search" in s["parts"]:
        table, results["search"] = _search_part(console, backend, s)
        tables.append(table)
    if "e2e" in s["parts"]:
        table, results["e2e"], meta = _e2e_part(console, backend, s)
        tables.append(table)
    write_results(console, args.json, backend=backend, tables=tables, results=results,
                  settings={k: v for k, v in s.items()}, **meta)
    return 1 if meta.get("failures") else 0

"""``graphburst bench ngram``: the prompt-lookup drafter, its search and end to end.

Part 1 (:mod:`.ngram_search`): µs per round of the search kernel against batch and
history length, each config checked bit-exact against the numpy twin before it is timed
(CUDA events around graph replays, medians).

Part 2 (:mod:`.ngram_e2e`): acceptance and tokens/s of graphburst with ``NgramDraft``
on a random-weight target (``--model``, default the 1b shape) against the same target's
plain decoding and transformers' prompt lookup, per workload and batch. **Correctness
first**: every engine's tokens are compared with graphburst's before any timing (identical,
or up to a first divergence that is a near-tie of the target's own logits, the rule of
``bench real``); a failure stops the run. Then ``--reps`` timed runs per engine
(untimed prefill excluded, syncs included), medians.
"""

from __future__ import annotations

import statistics

from rich.console import Console

from ..cli_args import FlagError, int_in, real_in, writable_file
from ..constants import MAX_K, NGRAM_MAX
from ..models.ngram import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN
from .common import fmt, int_list, label, new_table, write_results
from .ngram_search import run_search_bench

PARTS = ("search", "e2e")
MODEL_NAMES = ("tiny", "small", "1b")
SMOKE = dict(model="tiny", batches="1,2", histories="64,512", e2e_batches="1,2", prompt_len=32, new_tokens=24,
             reps=1, m=2, workloads="random,repeat,echo")
FULL = dict(model="1b", batches="1,8,64,256", histories="512,2048,8192,32768", e2e_batches="1,16", prompt_len=512,
            new_tokens=256, reps=3, m=8, workloads="random,repeat,echo")


def add_parser(sub) -> None:
    p = sub.add_parser("ngram", help="prompt-lookup drafting: the search's us per round, acceptance and tokens/s")
    p.add_argument("--backend", choices=("auto", "cupy", "numpy"), default="auto",
                   help="cupy (GPU), numpy (CPU reference) or auto")
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes: every code path in seconds (CI)")
    p.add_argument("--parts", default="search,e2e", help="comma list of search,e2e")
    p.add_argument("--batches", default=None, help="search: comma list of B (default 1,8,64,256)")
    p.add_argument("--histories", default=None, help="search: comma list of history lengths (default 512..32768)")
    p.add_argument("--model", choices=MODEL_NAMES, default=None, help="e2e target shape (default 1b)")
    p.add_argument("--e2e-batches", default=None, help="e2e: comma list of B (default 1,16; HF runs B=1 only)")
    p.add_argument("--workloads", default=None, help="e2e: comma list of random,repeat,echo")
    p.add_argument("--prompt-len", type=int_in(4, 16384), default=None, help="e2e: prompt tokens (default 512)")
    p.add_argument("--new-tokens", type=int_in(2, 16384), default=None, help="e2e: tokens generated (default 256)")
    p.add_argument("-k", type=int_in(1, MAX_K), default=4, help="drafts per round")
    p.add_argument("-m", type=int_in(1, 64), default=None, help="rounds per burst (default 8)")
    p.add_argument("--ngram-min", type=int_in(1, NGRAM_MAX), default=DEFAULT_NGRAM_MIN,
                   help="shortest n-gram looked up")
    p.add_argument("--ngram-max", type=int_in(1, NGRAM_MAX), default=DEFAULT_NGRAM_MAX,
                   help="longest n-gram looked up, tried first")
    p.add_argument("--reps", type=int_in(1, 1000), default=None, help="timed runs per config (search: x10)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--tol", type=real_in(0.0, 1.0), default=0.01, help="near-tie tolerance (as bench real)")
    p.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0, help="seed of the weights, prompts and histories")
    p.add_argument("--json", type=writable_file, default="ngram_bench.json", help="results file (JSON)")


def settings(args) -> dict:
    d = dict(SMOKE if args.smoke else FULL)
    for name in d:
        if getattr(args, name, None) is not None:
            d[name] = getattr(args, name)
    return dict(d, parts=args.parts.split(","), batches=int_list(d["batches"]),
                histories=int_list(d["histories"]), e2e_batches=int_list(d["e2e_batches"]),
                workloads=d["workloads"].split(","), k=args.k,
                n_min=args.ngram_min, n_max=args.ngram_max, tol=args.tol, seed=args.seed, dtype=args.dtype)


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
    if args.ngram_min > args.ngram_max:
        raise FlagError("--ngram-min", f"{args.ngram_min} is above --ngram-max {args.ngram_max}")
    s = settings(args)
    bad = [p for p in s["parts"] if p not in PARTS]
    if bad or not s["parts"]:
        raise FlagError("--parts", f"choose from {','.join(PARTS)}, got {args.parts!r}")
    from .ngram_e2e import WORKLOADS  # noqa: F401 (torch is needed by part 2 only)

    bad = [w for w in s["workloads"] if w not in WORKLOADS]
    if bad:
        raise FlagError("--workloads", f"unknown workload {bad[0]!r} (choose from {','.join(WORKLOADS)})")


def _search_part(console, backend, s) -> tuple:
    reps = 10 * s["reps"]
    table = new_table(f"ngram_search, us per round (k={s['k']}, n={s['n_min']}..{s['n_max']}) - {label(backend)}",
                      ["B", "history", "checked", "drafts", "us median", "us min", "host numpy twin us"])
    rows = run_search_bench(backend, batches=s["batches"], histories=s["histories"], k=s["k"], n_min=s["n_min"],
                            n_max=s["n_max"], reps=reps,
                            progress=lambda r: console.print(f"search B={r['batch']} H={r['history']}: "
                                                             f"{r['us_median']:.2f} us"))
    for r in rows:
        table.add_row(str(r["batch"]), str(r["history"]), "yes", str(r["drafts_proposed"]), fmt(r["us_median"]),
                      fmt(r["us_min"]), fmt(r["host_twin_us"], 0))
    return table, rows


def _e2e_part(console, backend, s) -> tuple:
    import torch

    from .ngram_e2e import HFGenerate, NgramBurst, PlainLoop, timed, workload
    from .real_checks import compare_other, reference_logits
    from .real_models import MODELS, instance, random_target

    device = "cuda" if backend.is_gpu else "cpu"
    dtype = getattr(torch, s["dtype"] or ("bfloat16" if backend.is_gpu else "float32"))
    spec = MODELS[s["model"]]
    capacity = s["prompt_len"] + s["new_tokens"] + s["m"] * (s["k"] + 1) + 8
    src = random_target(spec, batch=max(s["e2e_batches"]), capacity=capacity, kv_slack=s["k"] + 2, dtype=dtype,
                        device=device, seed=s["seed"])
    ref_model = instance(src, batch=1)
    oracle = lambda prompt, prefix: reference_logits(ref_model, prompt, prefix)  # noqa: E731
    table = new_table(f"prompt lookup, {s['model']} target ({str(dtype).split('.')[-1]}), k={s['k']}, M={s['m']}, "
                      f"n={s['n_min']}..{s['n_max']}, {s['new_tokens']} new tokens - {label(backend)}",
                      ["workload", "B", "engine", "tokens/s", "tokens/forward", "accepted/round", "agreed",
                       "vs plain"])
    rows, failures = [], []  # failures: engines whose tokens diverged from graphburst's, not at a near-tie
    for batch in s["e2e_batches"]:
        engines = {"graphburst-ngram": NgramBurst(src, batch=batch, k=s["k"], m=s["m"], n_min=s["n_min"],
                                                  n_max=s["n_max"], backend=backend),
                   "plain": PlainLoop(src, batch=batch, steps=s["m"] * (s["k"] + 1) // 2 or 1)}
        if batch == 1:
            engines["hf-lookup"] = HFGenerate(src, lookup=s["k"], n_max=s["n_max"])
            engines["hf-plain"] = HFGenerate(src, lookup=0, n_max=s["n_max"])
        for wl in s["workloads"]:
            prompts = workload(wl, src, batch=batch, prompt_len=s["prompt_len"], seed=s["seed"] + batch)
            ref, info, _ = timed(engines["graphburst-ngram"], prompts, s["new_tokens"])  # checked run, untimed
            results = {}
            for name, eng in engines.items():
                tokens, info, _ = timed(eng, prompts, s["new_tokens"])  # the check, and a warm-up
                try:
                    agreed = [compare_other(f"{name} ({wl}, B={batch}, seq {b})", tokens[b], ref[b],
                                            list(prompts[b]), oracle, s["tol"])["agreed"] for b in range(batch)]
                except AssertionError as exc:  # recorded, never timed; the exit status says so (as bench real)
                    failures.append(str(exc))
                    console.print(f"[red]FAILED correctness[/red]: {exc}")
                    rows.append(dict(workload=wl, batch=batch, engine=name, failed=str(exc)[:300]))
                    table.add_row(wl, str(batch), name, "FAILED", "-", "-", "-", "-")
                    continue
                secs = [timed(eng, prompts, s["new_tokens"])[2] for _ in range(s["reps"])]
                tps = batch * s["new_tokens"] / statistics.median(secs)
                per_forward = (info["accepted"] + info["rounds"]) / info["rounds"] if "rounds" in info else \
                    (s["new_tokens"] / info["forwards"] if name.startswith("hf-lookup") else 1.0)
                accepted = info["accepted"] / info["rounds"] if "rounds" in info else \
                    (per_forward - 1.0 if name == "hf-lookup" else None)
                results[name] = dict(workload=wl, batch=batch, engine=name, tokens_per_s=tps,
                                     tokens_per_forward=per_forward, accepted_per_round=accepted,
                                     agreed_tokens=min(agreed), compared_tokens=s["new_tokens"],
                                     seconds_median=statistics.median(secs), reps=s["reps"])
            plain = results["plain"]["tokens_per_s"] if "plain" in results else None
            for name, r in results.items():
                r["speedup_vs_plain"] = None if plain is None else r["tokens_per_s"] / plain
                rows.append(r)
                table.add_row(wl, str(batch), name, fmt(r["tokens_per_s"], 1), fmt(r["tokens_per_forward"]),
                              fmt(r["accepted_per_round"]), f"{r['agreed_tokens']}/{r['compared_tokens']}",
                              fmt(r["speedup_vs_plain"]))
            console.print(f"e2e {wl} B={batch}: " + ", ".join(f"{n} {r['tokens_per_s']:.1f} tok/s"
                                                              for n, r in results.items()))
    return table, rows, dict(model=spec.note, dtype=str(dtype), capacity=capacity, failures=failures)


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

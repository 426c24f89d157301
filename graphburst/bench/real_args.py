"""``graphburst bench real``'s flags: the settings a run takes, checked before any work.

Three runs share the command: the engine comparison (the default), the profile views
(``--profile [forward,prefill]``, :mod:`.real_forward` and :mod:`.real_prefill`) and the
summary of saved results (``--summary FILE ...``, :mod:`.real_summary`, nothing run). A
flag of one run given to another is refused, so it is never silently ignored. Every size
is bounded by the memory it would take (``check_run_memory``, ``check_profile_memory``),
and ``--eps`` / ``--accepts`` are finite and in (0, 1]. :mod:`graphburst.bench.real` runs it.
"""

from __future__ import annotations

import math
import os

from ..cli_args import (FlagError, add_decode_kernels_flag, check_decode_kernels, check_memory, int_in, real_in,
                        writable_file)
from .common import float_list, int_list
from .real_forward import SHARD, kv_row_bytes, param_bytes
from .real_forward import shape as shape_config
from .real_prefill import BATCH, CASES, MAX_PROMPT, MODES
from .real_prefill import capacity as prefill_capacity
from .real_report import SAME_KERNEL_ORDER

# The torch-dependent modules (real_models, real_engines, real_checks) are imported when
# the benchmark runs: the CLI imports this module for every command, torch or not.
MODEL_NAMES = ("tiny", "small", "smollm2", "1b", "8b", "qwen3-tiny", "qwen3-0.6b", "qwen3-8b",
               "qwen3-tiny-pair")  # real_models.MODELS

ENGINES = ("hf", "eager", "vllm", "graphburst", "gapless", "compile")
DEFAULT_ENGINES = "hf,eager,vllm,graphburst,gapless"
EPS_GRID = (0.0, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0)
CALIBRATION = dict(batch=4, rounds=16)
SMOKE = dict(models="tiny", batches="1,2", rounds=4, reps=1, m=2, m_sweep="1,2,4", accepts="0.5,0.95")
DEFAULT_PLOT = "docs/real_models_h200.png"


PROFILE_VIEWS = ("forward", "prefill")
DEFAULT_JSON = "real_bench.json"
PROFILE_JSON = "real_profile.json"
#: the profile views' defaults, and their ``--smoke`` defaults (the tiny model: every code path in seconds)
PROFILE = dict(models="1b", batches="1", capacities="1024", trials=20, profile_calls=5, top=8, attention="gqa",
               kernels="auto", prefill_cases=len(CASES), prefill_mode="auto", prefill_warmup=0)
PROFILE_SMOKE = dict(models="tiny", capacities="64", trials=2, profile_calls=1, kernels="auto,reference",
                     prefill_cases=3)
ATTENTION = ("gqa", "fold")
KERNELS = ("auto", "cublas", "gemv", "pdl", "folded", "reference", "off")

#: which run reads each flag that is not shared by all (dest -> (flag, runs)); given to another run it is refused
OWNED = {
    "accepts": ("--accepts", {"engines"}), "eps": ("--eps", {"engines"}), "engines": ("--engines", {"engines"}),
    "m_sweep": ("--m-sweep", {"engines"}), "no_m_sweep": ("--no-m-sweep", {"engines"}),
    "rounds": ("--rounds", {"engines"}), "reps": ("--reps", {"engines"}), "plot": ("--plot", {"engines"}),
    "no_plot": ("--no-plot", {"engines"}), "hf_tol": ("--hf-tol", {"engines"}),
    "prompt_len": ("--prompt-len", {"engines"}), "compile_timeout": ("--compile-timeout", {"engines"}),
    "capacities": ("--capacities", {"forward"}), "valid": ("--valid", {"forward"}),
    "tokens": ("--tokens", {"forward"}), "attention": ("--attention", {"forward"}),
    "kernels": ("--kernels", {"forward"}), "trials": ("--trials", {"forward"}),
    "decode_kernels": ("--decode-kernels", {"engines"}),
    "profile_calls": ("--profile-calls", {"forward"}), "top": ("--top", {"forward"}),
    "prefill_mode": ("--prefill-mode", {"prefill"}), "prefill_warmup": ("--prefill-warmup", {"prefill"}),
    "prefill_cases": ("--prefill-cases", {"prefill"}), "prefill_chunked": ("--prefill-chunked", {"prefill"}),
    "prefill_tol": ("--prefill-tol", {"prefill"}),
    "batches": ("--batches", {"engines", "forward"}), "m": ("-m", {"engines", "prefill"}),
    "models": ("--models", {"engines", "forward", "prefill"}), "k": ("-k", {"engines", "forward", "prefill"}),
    "dtype": ("--dtype", {"engines", "forward", "prefill"}), "seed": ("--seed", {"engines", "forward", "prefill"}),
    "json": ("--json", {"engines", "forward", "prefill"}), "trace": ("--trace", {"engines", "forward", "prefill"}),
    "smoke": ("--smoke", {"engines", "forward", "prefill"}),
}

PROFILE_HELP = """\
--profile [VIEWS] runs the profile views instead of the engine comparison (VIEWS: a comma list of
forward,prefill; --profile alone runs both), one table per view, the JSON (default real_profile.json)
holding results.forward and results.prefill:
  forward: one verify-shaped (T = k + 1) and one draft-shaped (T = 1) Llama forward per --models x
    --batches x --capacities x --attention x --kernels, each fused forward checked against SDPA
    first, then its CUDA-graph replay time against the bytes floor ((weights + valid KV read + KV
    written) / 4.8 TB/s), its kernel time per forward by category (GEMM, attention, fused
    elementwise, other; total and per layer), non-GEMM µs per layer and the gap (graph time minus
    the summed kernel time). Defaults: --models 1b, --batches 1, --capacities 1024.
  prefill: host and GPU ms of one prefill_checked admission into a 64-slot decoder per case
    (1 x 128 ... 11 lognormal prompts; --prefill-chunked adds later chunks), each case's first
    tokens checked against the model's greedy continuation first. Default --models 1b.
--summary FILE ... prints one line per config of saved bench real JSON (either run's) and runs nothing.
With --smoke: the tiny model and small sizes (seconds, CPU or GPU)."""


def add_parser(sub) -> None:
    p = sub.add_parser("real", help="random-weight Llama models: graphburst vs HF, eager and vllm-style loops; "
                                    "--profile: where a forward's and an admission's time goes",
                       epilog=PROFILE_HELP)
    run = p.add_mutually_exclusive_group()
    run.add_argument("--profile", nargs="?", const=",".join(PROFILE_VIEWS), default=None, metavar="VIEWS",
                     help=f"run the profile views instead (comma list of {','.join(PROFILE_VIEWS)}; alone: both; "
                          "see below)")
    run.add_argument("--summary", nargs="+", default=None, metavar="FILE",
                     help="print one line per config of these bench real JSON files and exit (runs nothing)")
    p.add_argument("--backend", choices=("auto", "cupy", "numpy"), default="auto",
                   help="cupy (GPU), numpy (CPU reference, models on CPU torch) or auto")
    p.add_argument("--smoke", action="store_true", help="tiny model, few rounds: every code path in seconds (CI)")
    p.add_argument("--models", default=None,
                   help=f"comma list of {','.join(MODEL_NAMES)} (default small,1b; --profile: 1b; the forward view "
                        f"also takes {SHARD}, one rank's shard of the 8b shape under TP=2)")
    p.add_argument("--batches", default=None, help="comma list of batch sizes (default 1,4,16; --profile: 1)")
    p.add_argument("--accepts", default=None, help="acceptance levels ε is calibrated to (default 0.5,0.8,0.95)")
    p.add_argument("--eps", default=None, help="comma list of ε values to use instead of calibrating")
    p.add_argument("--engines", default=None,
                   help=f"comma list of {','.join(ENGINES)} (default {DEFAULT_ENGINES})")
    p.add_argument("-k", type=int_in(1, 16), default=None, help="drafts per round (default 4)")
    p.add_argument("-m", type=int_in(1, 64), default=None, help="rounds per burst (default 8)")
    p.add_argument("--m-sweep", default=None, help="graphburst M values at B=1 (default 1,2,4,8,16)")
    p.add_argument("--no-m-sweep", action="store_true", help="skip the M sweep")
    p.add_argument("--rounds", type=int_in(1, 4096), default=None, help="rounds per timed run (default 32)")
    p.add_argument("--reps", type=int_in(1, 100), default=None, help="timed rotations over the engines (default 3)")
    p.add_argument("--prompt-len", type=int_in(1, 4096), default=None, help="prompt tokens per sequence (default 16)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="weights and KV (default bfloat16)")
    add_decode_kernels_flag(p, whose="the comparison's models' (every engine but hf and compile; --profile forward "
                                     "takes --kernels)")
    p.add_argument("--hf-tol", type=real_in(0.0, 1.0), default=None,
                   help="near-tie tolerance for engines with other kernels, relative to max(1, |top logit|) "
                        "(default 0.01)")
    p.add_argument("--seed", type=int_in(0, 2**31 - 1), default=None,
                   help="seed of the random weights and prompts (default 0)")
    p.add_argument("--json", type=writable_file, default=None,
                   help=f"results file (JSON; default {DEFAULT_JSON}, with --profile {PROFILE_JSON})")
    p.add_argument("--plot", type=writable_file, default=None,
                   help=f"PNG of tokens/s against acceptance (default {DEFAULT_PLOT} for a full GPU run, else none)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--compile-timeout", type=int_in(1, 86400), default=None, metavar="S",
                   help="seconds the compile engine's probe (a child process compiling the model) may take "
                        "(default 900)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="torch.profiler Chrome traces into DIR, top kernels in the JSON: of one B=1 run per engine "
                        "and model (mid ε); with --profile, of each profiled forward and of one more admission of "
                        "the last prefill case")
    f = p.add_argument_group("the forward view (--profile forward)")
    f.add_argument("--capacities", default=None, help="comma list of KV rows per sequence (default 1024)")
    f.add_argument("--valid", type=int_in(0, 1 << 20), default=None,
                   help="valid KV rows per sequence (default capacity / 2)")
    f.add_argument("--tokens", default=None, help="comma list of tokens per forward, T (default k + 1,1)")
    f.add_argument("--attention", default=None,
                   help=f"comma list of {','.join(ATTENTION)} (fold: Llama(fold_gqa=True); default gqa)")
    f.add_argument("--kernels", default=None,
                   help="comma list of decode kernels: auto (the fused Triton path on CUDA, SDPA on the CPU), cublas "
                        "(the fused path, every projection on cuBLAS), gemv (the fused path, every projection and "
                        "the head on the Triton GEMV), pdl (gemv with programmatic dependent launch; Hopper or "
                        "later), folded (pdl with the norms, SiLU and split-K sums folded into the projections), "
                        "reference (the fused path on the kernels' torch references), off (SDPA); default auto")
    f.add_argument("--trials", type=int_in(1, 10_000), default=None, help="graph replays timed, median (default 20)")
    f.add_argument("--profile-calls", type=int_in(0, 1000), default=None,
                   help="eager forwards the per-kernel profile averages; 0: graph timings only (default 5)")
    f.add_argument("--top", type=int_in(0, 1000), default=None, help="top kernels per config in the JSON (default 8)")
    q = p.add_argument_group("the prefill view (--profile prefill)")
    q.add_argument("--prefill-mode", choices=MODES, default=None,
                   help="auto: packed prefill graphs on a GPU, the eager prefill on the CPU; padded: prefill graphs "
                        "padding each prompt to its call's longest; eager: no prefill graphs (default auto)")
    q.add_argument("--prefill-warmup", type=int_in(0, BATCH), default=None, metavar="ROWS",
                   help="warm the prefill graphs' buckets of up to ROWS rows first, as serve --prefill-warmup "
                        "(default 0)")
    q.add_argument("--prefill-cases", type=int_in(0, len(CASES)), default=None, metavar="N",
                   help=f"run the first N of the {len(CASES)} cases (default all)")
    q.add_argument("--prefill-chunked", action="store_true",
                   help="then the later-chunk cases (a 512-token chunk at 512, alone and beside fresh prompts)")
    q.add_argument("--prefill-tol", type=real_in(0.0, 1.0), default=None,
                   help="the first-token check's near-tie tolerance (models.parity; default NEAR_TIE_TOL of the "
                        "dtype). The 8b shape's bf16 reference forward and the fresh prefill differ by up to 0.35 "
                        "on ~5.5 logits on an H200, both ~0.4 from fp32: 0.08")


def json_path(args) -> str:
    return args.json or (PROFILE_JSON if args.profile is not None else DEFAULT_JSON)


def settings(args) -> dict:
    """The engine comparison's settings with defaults (``--smoke`` defaults where not given)."""
    d = dict(models="small,1b", batches="1,4,16", rounds=32, reps=3, m=8, m_sweep="1,2,4,8,16",
             accepts="0.5,0.8,0.95")
    if args.smoke:
        d.update(SMOKE)
    pick = lambda name: d[name] if getattr(args, name) is None else getattr(args, name)  # noqa: E731
    s = dict(models=pick("models").split(","), batches=int_list(pick("batches")), rounds=pick("rounds"),
             reps=pick("reps"), m=pick("m"), m_sweep=[] if args.no_m_sweep else int_list(pick("m_sweep")),
             accepts=float_list(pick("accepts")), eps=None if args.eps is None else float_list(args.eps),
             engines=(args.engines or DEFAULT_ENGINES).split(","), compile_timeout=args.compile_timeout or 900,
             prompt_len=args.prompt_len or 16, tol=0.01 if args.hf_tol is None else args.hf_tol,
             decode_kernels=args.decode_kernels or "auto", **_shared(args))
    return s


def _shared(args) -> dict:
    return dict(k=args.k or 4, dtype=args.dtype or "bfloat16", seed=args.seed or 0, trace=args.trace)


def profile_settings(args) -> dict:
    """The profile views' settings with defaults (``--smoke`` defaults where not given)."""
    d = dict(PROFILE)
    if args.smoke:
        d.update(PROFILE_SMOKE)
    pick = lambda name: d[name] if getattr(args, name) is None else getattr(args, name)  # noqa: E731
    return dict(views=[v for v in PROFILE_VIEWS if v in args.profile.split(",")], models=pick("models").split(","),
                batches=int_list(pick("batches")), capacities=int_list(pick("capacities")), valid=args.valid,
                tokens=int_list(args.tokens) if args.tokens else None, attention=pick("attention").split(","),
                kernels=pick("kernels").split(","), trials=pick("trials"), profile_calls=pick("profile_calls"),
                top=pick("top"), m=args.m or 8, prefill_mode=pick("prefill_mode"),
                prefill_warmup=pick("prefill_warmup"), prefill_cases=pick("prefill_cases"),
                prefill_chunked=args.prefill_chunked, prefill_tol=args.prefill_tol, **_shared(args))


def _refuse_foreign(args, runs: set, why: str) -> None:
    """FlagError for the first flag given that none of ``runs`` reads."""
    for dest, (flag, readers) in OWNED.items():
        value = getattr(args, dest)
        if value is not None and value is not False and not readers & runs:
            raise FlagError(flag, why)


def check_args(args) -> None:
    """Every flag checked before any model is built (FlagError names the flag)."""
    if args.summary is not None:
        _refuse_foreign(args, set(), "--summary only prints saved results: it takes no run flags")
        from .real_summary import load

        for path in args.summary:
            try:
                load(path)
            except ValueError as exc:
                raise FlagError("--summary", str(exc)) from None
        return
    if args.profile is not None:
        _check_profile(args)
    else:
        _refuse_foreign(args, {"engines"}, "only with --profile (the profile views' flag)")
        _check_comparison(args)
    if args.trace is not None and not os.path.isdir(args.trace):
        raise FlagError("--trace", f"{args.trace!r} is not a directory")
    try:
        import torch
    except ImportError:
        raise FlagError("--backend", "bench real needs PyTorch: pip install 'graphburst[torch]'") from None
    from ..backend import cuda_available

    if args.backend != "numpy" and cuda_available() and not torch.cuda.is_available():
        # graphburst would run on the GPU and the models on the CPU: nothing meaningful to time.
        raise FlagError("--backend", f"{args.backend} picks the GPU but this torch build has no CUDA; "
                                     "install CUDA torch or use --backend numpy")
    gpu = args.backend != "numpy" and cuda_available()
    # A GPU run is bounded by the device's memory (an H200 takes far more than a host-side limit).
    device_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if gpu else None
    if args.profile is not None:
        s = profile_settings(args)
        launched_pdl = [k for k in ("pdl", "folded") if k in s["kernels"]]
        if gpu and "forward" in s["views"] and launched_pdl:
            from ..models.llama_decode import pdl_unsupported

            why = pdl_unsupported(torch.device("cuda", torch.cuda.current_device()))
            if why is not None:
                raise FlagError("--kernels", f"{launched_pdl[0]}: {why}")
        check_profile_memory(s, device_bytes)
    else:
        check_run_memory(settings(args), device_bytes)


def _lists(args, flags) -> None:
    """Comma-list flags parse, hold a value, and (``positive``) hold no integer below 1."""
    for flag, text, parse, positive in flags:
        if text is None:
            continue
        try:
            values = parse(text)
        except ValueError:
            raise FlagError(flag, f"a comma list of numbers is needed, got {text!r}") from None
        if not values:
            raise FlagError(flag, f"needs at least one value, got {text!r}")
        if positive and min(values) < 1:
            raise FlagError(flag, f"needs positive integers, got {text!r}")


def _names(flag: str, names: list, allowed) -> None:
    bad = [n for n in names if n not in allowed]
    if bad:
        raise FlagError(flag, f"unknown {flag.lstrip('-').rstrip('s')} {bad[0]!r} (choose from {','.join(allowed)})")


def _check_comparison(args) -> None:
    check_decode_kernels(args.decode_kernels, args.backend)
    _lists(args, (("--batches", args.batches, int_list, True), ("--m-sweep", args.m_sweep, int_list, True),
                  ("--accepts", args.accepts, float_list, False), ("--eps", args.eps, float_list, False)))
    for flag, text in (("--accepts", args.accepts), ("--eps", args.eps)):
        if text is None:
            continue
        # ε near 0 makes the target compute the draft's function, 1 is the random model as drawn; at 0
        # the blocks past the draft vanish. An acceptance level of 0 has no ε to calibrate to.
        bad = [v for v in float_list(text) if not (math.isfinite(v) and 0 < v <= 1)]
        if flag == "--accepts" and bad:
            raise FlagError(flag, f"acceptance levels are in (0, 1], got {bad[0]} in {text!r}")
        if flag == "--eps" and bad:
            raise FlagError(flag, f"each ε must be a finite number in (0, 1], got {bad[0]} in {text!r}: ε scales "
                                  "the target's blocks past the draft, 1 leaving them as drawn; at 0 they vanish and "
                                  "the target computes the draft itself (every draft accepted, nothing to compare)")
    s = settings(args)
    _names("--models", s["models"], MODEL_NAMES)
    _names("--engines", s["engines"], ENGINES)
    if not any(e in s["engines"] for e in SAME_KERNEL_ORDER):
        raise FlagError("--engines", f"needs at least one of {','.join(SAME_KERNEL_ORDER)} as the reference")
    for m in [s["m"]] + s["m_sweep"]:
        if s["rounds"] % m:
            raise FlagError("--rounds", f"{s['rounds']} rounds must be a multiple of every M used ({m})")


def _check_profile(args) -> None:
    views = args.profile.split(",")
    bad = [v for v in views if v not in PROFILE_VIEWS]
    if bad or not views:
        raise FlagError("--profile", f"unknown view {(bad or [''])[0]!r} (choose from {','.join(PROFILE_VIEWS)}; "
                                     "torch.profiler traces of the engines: --trace DIR)")
    _refuse_foreign(args, set(views), f"not read by --profile {args.profile}")
    _lists(args, (("--batches", args.batches, int_list, True), ("--capacities", args.capacities, int_list, True),
                  ("--tokens", args.tokens, int_list, True)))
    s = profile_settings(args)
    _names("--models", s["models"], MODEL_NAMES + (SHARD,) if "forward" in views else MODEL_NAMES)
    _names("--attention", s["attention"], ATTENTION)
    _names("--kernels", s["kernels"], KERNELS)
    longest = max(s["tokens"] or (s["k"] + 1, 1))
    if longest > 1024:
        raise FlagError("--tokens", f"a decode forward of {longest} tokens is a prefill: at most 1024")
    for cap in s["capacities"]:
        valid = cap // 2 if s["valid"] is None else s["valid"]
        if valid + longest > cap:
            raise FlagError("--valid" if s["valid"] is not None else "--capacities",
                            f"{valid} valid rows + {longest} new tokens pass the capacity {cap}")


def check_profile_memory(s, device_bytes: int | None = None) -> None:
    """Refuse profile sizes whose weights, KV caches and logits would pass the GPU's memory (the CPU: the flag
    limit). The weights count here: a view builds one model at a time, so they are most of what it holds."""
    from .real_models import MODELS, run_bytes

    item = 2 if s["dtype"] == "bfloat16" else 4
    where = "limit" if device_bytes is None else "of the GPU"
    if "forward" in s["views"]:
        t, b, cap = max(s["tokens"] or (s["k"] + 1,)), max(s["batches"]), max(s["capacities"])
        for name in s["models"]:
            cfg = shape_config(name)
            need = param_bytes(cfg, item) + b * (cap + s["k"] + 2) * kv_row_bytes(cfg, item) \
                + 2 * b * t * cfg.vocab_size * 4
            check_memory(need, f"model {name}'s weights, KV caches and logits at batch {b} x {cap} rows",
                         ("--capacities", "--batches", "--models"), limit=device_bytes, where=where)
    if "prefill" in s["views"]:
        for name in s["models"]:
            spec = MODELS[name]
            weights = param_bytes(spec.cfg, item) + (0 if spec.draft_cfg is None else param_bytes(spec.draft_cfg, item))
            need = weights + run_bytes(spec, batch=BATCH, capacity=prefill_capacity(s), k=s["k"],
                                       prompt_len=MAX_PROMPT, item=item, engines=1)
            check_memory(need, f"model {name}'s weights and the prefill view's {BATCH} slots", ("--models", "-m", "-k"),
                         limit=device_bytes, where=where)


def _capacity(s) -> int:
    # Every engine decodes --rounds rounds; the start-up calibration runs its own number.
    return s["prompt_len"] + max(s["rounds"], CALIBRATION["rounds"]) * (s["k"] + 1)


def check_run_memory(s, device_bytes: int | None = None) -> None:
    """Refuse sizes whose caches and logits would pass the GPU's memory, or cli_args.MAX_FLAG_BYTES on the
    CPU (rather than a 24 GB surprise)."""
    from .real_models import MODELS, run_bytes

    batch, engines = max(s["batches"]), len(s["engines"])
    for name in s["models"]:
        # each engine's caches and logits, and those of the source model the engines share weights with
        need = run_bytes(MODELS[name], batch=batch, capacity=_capacity(s), k=s["k"], prompt_len=s["prompt_len"],
                         item=2 if s["dtype"] == "bfloat16" else 4, engines=engines + 1)
        check_memory(need, f"{engines} engines and their source model x batch {batch} of model {name} "
                           f"({_capacity(s)} positions)",
                     ("--batches", "--rounds", "--prompt-len", "--engines"), limit=device_bytes,
                     where="limit" if device_bytes is None else "of the GPU")

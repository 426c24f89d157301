"""``graphburst bench real``'s flags: the settings a run takes, checked before any work.

Every size is bounded by the memory it would take (``check_run_memory``), and ``--eps`` /
``--accepts`` are finite and in (0, 1]. :mod:`graphburst.bench.real` runs the benchmark.
"""

from __future__ import annotations

import math
import os

from ..cli_args import FlagError, check_memory, int_in, real_in, writable_file
from .common import float_list, int_list
from .real_report import SAME_KERNEL_ORDER

# The torch-dependent modules (real_models, real_engines, real_checks) are imported when
# the benchmark runs: the CLI imports this module for every command, torch or not.
MODEL_NAMES = ("tiny", "small", "1b", "8b", "qwen3-tiny", "qwen3-0.6b", "qwen3-8b", "qwen3-tiny-pair")  # real_models.MODELS

ENGINES = ("hf", "eager", "vllm", "graphburst", "gapless", "compile")
DEFAULT_ENGINES = "hf,eager,vllm,graphburst,gapless"
EPS_GRID = (0.0, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0)
CALIBRATION = dict(batch=4, rounds=16)
SMOKE = dict(models="tiny", batches="1,2", rounds=4, reps=1, m=2, m_sweep="1,2,4", accepts="0.5,0.95")
DEFAULT_PLOT = "docs/real_models_h200.png"


def add_parser(sub) -> None:
    p = sub.add_parser("real", help="random-weight Llama models: graphburst vs HF, eager and vllm-style loops")
    p.add_argument("--backend", choices=("auto", "cupy", "numpy"), default="auto",
                   help="cupy (GPU), numpy (CPU reference, models on CPU torch) or auto")
    p.add_argument("--smoke", action="store_true", help="tiny model, few rounds: every code path in seconds (CI)")
    p.add_argument("--models", default=None, help=f"comma list of {','.join(MODEL_NAMES)} (default small,1b)")
    p.add_argument("--batches", default=None, help="comma list of batch sizes (default 1,4,16)")
    p.add_argument("--accepts", default=None, help="acceptance levels ε is calibrated to (default 0.5,0.8,0.95)")
    p.add_argument("--eps", default=None, help="comma list of ε values to use instead of calibrating")
    p.add_argument("--engines", default=DEFAULT_ENGINES, help=f"comma list of {','.join(ENGINES)}")
    p.add_argument("-k", type=int_in(1, 16), default=4, help="drafts per round")
    p.add_argument("-m", type=int_in(1, 64), default=None, help="rounds per burst (default 8)")
    p.add_argument("--m-sweep", default=None, help="graphburst M values at B=1 (default 1,2,4,8,16)")
    p.add_argument("--no-m-sweep", action="store_true", help="skip the M sweep")
    p.add_argument("--rounds", type=int_in(1, 4096), default=None, help="rounds per timed run (default 32)")
    p.add_argument("--reps", type=int_in(1, 100), default=None, help="timed rotations over the engines (default 3)")
    p.add_argument("--prompt-len", type=int_in(1, 4096), default=16, help="prompt tokens per sequence")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="weights and KV")
    p.add_argument("--hf-tol", type=real_in(0.0, 1.0), default=0.01,
                   help="near-tie tolerance for engines with other kernels, relative to max(1, |top logit|)")
    p.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0, help="seed of the random weights and prompts")
    p.add_argument("--json", type=writable_file, default="real_bench.json", help="results file (JSON)")
    p.add_argument("--plot", type=writable_file, default=None,
                   help=f"PNG of tokens/s against acceptance (default {DEFAULT_PLOT} for a full GPU run, else none)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--compile-timeout", type=int_in(1, 86400), default=900, metavar="S",
                   help="seconds the compile engine's probe (a child process compiling the model) may take")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="torch.profiler traces of one B=1 run per engine and model (mid ε) into DIR; top kernels "
                        "per round in the JSON")


def settings(args) -> dict:
    """The run's settings with defaults (``--smoke`` defaults where not given)."""
    d = dict(models="small,1b", batches="1,4,16", rounds=32, reps=3, m=8, m_sweep="1,2,4,8,16",
             accepts="0.5,0.8,0.95")
    if args.smoke:
        d.update(SMOKE)
    pick = lambda name: d[name] if getattr(args, name) is None else getattr(args, name)  # noqa: E731
    s = dict(models=pick("models").split(","), batches=int_list(pick("batches")), rounds=pick("rounds"),
             reps=pick("reps"), m=pick("m"), m_sweep=[] if args.no_m_sweep else int_list(pick("m_sweep")),
             accepts=float_list(pick("accepts")), eps=None if args.eps is None else float_list(args.eps),
             engines=args.engines.split(","), k=args.k, prompt_len=args.prompt_len, dtype=args.dtype,
             tol=args.hf_tol, seed=args.seed, compile_timeout=args.compile_timeout)
    return s


def check_args(args) -> None:
    """Every flag checked before any model is built (FlagError names the flag)."""
    for flag, text, parse in (("--batches", args.batches, int_list), ("--m-sweep", args.m_sweep, int_list),
                              ("--accepts", args.accepts, float_list), ("--eps", args.eps, float_list)):
        if text is not None:
            try:
                values = parse(text)
            except ValueError:
                raise FlagError(flag, f"a comma list of numbers is needed, got {text!r}") from None
            if not values:
                raise FlagError(flag, f"needs at least one value, got {text!r}")
            if flag in ("--batches", "--m-sweep") and min(values) < 1:
                raise FlagError(flag, f"needs positive integers, got {text!r}")
            # ε near 0 makes the target compute the draft's function, 1 is the random model as drawn; at 0
            # the blocks past the draft vanish. An acceptance level of 0 has no ε to calibrate to.
            bad = [v for v in values if not (math.isfinite(v) and 0 < v <= 1)]
            if flag == "--accepts" and bad:
                raise FlagError(flag, f"acceptance levels are in (0, 1], got {bad[0]} in {text!r}")
            if flag == "--eps" and bad:
                raise FlagError(flag, f"each ε must be a finite number in (0, 1] (0: the target is the draft, "
                                      f"1: the random model as drawn), got {bad[0]} in {text!r}")
    s = settings(args)
    bad = [m for m in s["models"] if m not in MODEL_NAMES]
    if bad:
        raise FlagError("--models", f"unknown model {bad[0]!r} (choose from {','.join(MODEL_NAMES)})")
    bad = [e for e in s["engines"] if e not in ENGINES]
    if bad:
        raise FlagError("--engines", f"unknown engine {bad[0]!r} (choose from {','.join(ENGINES)})")
    if not any(e in s["engines"] for e in SAME_KERNEL_ORDER):
        raise FlagError("--engines", f"needs at least one of {','.join(SAME_KERNEL_ORDER)} as the reference")
    for m in [s["m"]] + s["m_sweep"]:
        if s["rounds"] % m:
            raise FlagError("--rounds", f"{s['rounds']} rounds must be a multiple of every M used ({m})")
    if args.profile is not None and not os.path.isdir(args.profile):
        raise FlagError("--profile", f"{args.profile!r} is not a directory")
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
    check_run_memory(s, torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if gpu else None)


def _capacity(s) -> int:
    # Every engine decodes --rounds rounds; the start-up calibration runs its own number.
    return s["prompt_len"] + max(s["rounds"], CALIBRATION["rounds"]) * (s["k"] + 1)


def check_run_memory(s, device_bytes: int | None = None) -> None:
    """Refuse sizes whose caches and logits would pass the GPU's memory, or cli_args.MAX_FLAG_BYTES on the
    CPU (rather than a 24 GB surprise)."""
    from .real_models import MODELS, run_bytes

    batch, engines = max(s["batches"]), len(s["engines"]) + 1  # + the source model they share weights with
    for name in s["models"]:
        need = run_bytes(MODELS[name], batch=batch, capacity=_capacity(s), k=s["k"], prompt_len=s["prompt_len"],
                         item=2 if s["dtype"] == "bfloat16" else 4, engines=engines)
        check_memory(need, f"{engines} engines x batch {batch} of model {name} ({_capacity(s)} positions)",
                     ("--batches", "--rounds", "--prompt-len", "--engines"), limit=device_bytes,
                     where="limit" if device_bytes is None else "of the GPU")

"""``graphburst bench real``: decode latency of random-weight Llama models, per engine.

For each model (``real_models.MODELS``) the acceptance knob ε is calibrated once (a
short eager run over a grid), then for each batch size and each ε every engine
(``real_engines``) is built once, **checked, then timed**:

1. **Correctness, before any timing, in every config.** Every engine decodes the same
   prompts for the same number of rounds. Engines with the same kernels (graphburst,
   gapless, vllm-style, eager) must produce identical tokens on every common prefix. Engines with
   other kernels (HF in bf16, torch.compile) must agree up to the end or up to a first
   divergence that is a near-tie: there the reference model's teacher-forced logits of
   the two tokens differ by at most ``tol * max(1, |top logit|)``. At start-up HF in fp32
   must equal graphburst in fp32 on a short prefix under the same rule with tol 1e-4.
   A same-kernel mismatch stops the run; an other-kernel failure is reported, that
   engine is not timed, and the command exits 1 after writing everything else.
2. **Timing.** Rotations over the engines (so drift hits all alike); each run starts
   from a fresh prefill (untimed) and is timed with ``perf_counter`` around the whole
   run, syncs included; medians. The floor is the round's forwards alone (the
   vllm-style graphs replayed back to back, CUDA events), measured in the same run.

Without a GPU it runs on CPU torch with graphburst's numpy backend (``--smoke``: the
tiny model, seconds), through the same engines, checks and writers.
"""

from __future__ import annotations

import contextlib

import statistics
import time

import numpy as np
from rich.console import Console
from rich.progress import Progress

from .common import label, write_results
from .real_args import CALIBRATION, DEFAULT_PLOT, EPS_GRID, _capacity, json_path, profile_settings, settings
# the bench command's hooks (bench/__init__ calls them on this module), defined with the flags
from .real_args import add_parser, check_args  # noqa: F401
from .real_profile import profile_all
from .real_report import NOT_RUN, SAME_KERNEL_ORDER, finish, plot_problem, report

# ---------------------------------------------------------------------- steps

def calibrate(src, draft, s, prompts_for, eps_ctl) -> tuple[list, list]:
    """ε grid -> measured acceptance (eager loop, B=4), then ε per wanted acceptance by interpolation."""
    from .real_engines import TorchLoop

    loop = TorchLoop(src, draft_layers=draft, batch=CALIBRATION["batch"], k=s["k"])
    grid = []
    for eps in EPS_GRID:
        eps_ctl.set(eps)
        loop.prefill(prompts_for(CALIBRATION["batch"]))
        run = loop.run(CALIBRATION["rounds"])
        grid.append(dict(eps=eps, acceptance=run.accepted / (run.rounds * s["k"] * CALIBRATION["batch"])))
    chosen = []
    for want in s["accepts"]:
        # Outside the measured range: the grid point nearest to it (the measured acceptance is reported).
        eps = min(grid, key=lambda g: abs(g["acceptance"] - want))["eps"]
        for lo, hi in zip(grid, grid[1:]):
            if lo["acceptance"] >= want >= hi["acceptance"]:
                span = lo["acceptance"] - hi["acceptance"]
                f = 0.0 if span == 0 else (lo["acceptance"] - want) / span
                eps = lo["eps"] + f * (hi["eps"] - lo["eps"])
                break
        chosen.append(dict(want=want, eps=eps))
    return grid, chosen


def build_engines(src, spec, draft, s, batch, backend, hf) -> tuple[dict, dict]:
    """Every requested engine for one batch size; (engines, not_run reasons).

    ``spec``: the model's ``real_models.ModelSpec`` (the compile probe rebuilds it in a child);
    ``draft``: the self-draft's depth, or a draft model of its own (``real_models.draft_instance``).
    """
    from .real_engines import Burst, TorchLoop

    kw = dict(draft_layers=draft, batch=batch, k=s["k"])
    engines, skipped = {}, {}
    if "compile" not in s["engines"]:
        skipped["compile"] = NOT_RUN["compile_off"]
    for name in s["engines"]:
        if name == "hf":
            if batch != 1:
                skipped[name] = NOT_RUN["hf_batch"]
            elif hf is not None:
                engines[name] = hf
            continue
        if name == "compile":
            t0 = time.perf_counter()
            if src.kv[0].is_cuda:  # a compiler segfault cannot be caught in-process: try it in a child first
                from .compile_probe import probe

                why = probe(spec, batch, s["k"], src.capacity, s["prompt_len"], s["dtype"], s["compile_timeout"])
                if why is not None:
                    skipped[name] = why
                    continue
            try:
                eng = TorchLoop(src, compile_forward=True, **kw)
                eng.prefill([[0] * s["prompt_len"]] * batch)  # torch.compile works at the first calls: do them here
                eng.run(2)
                eng.compile_s = time.perf_counter() - t0
                engines[name] = eng
            except Exception as exc:  # noqa: BLE001 - optional engine: recorded, never fatal
                skipped[name] = f"not run: torch.compile failed: {type(exc).__name__}: {exc}"[:300]
            continue
        if name in ("eager", "vllm"):
            engines[name] = TorchLoop(src, graphs=name == "vllm", **kw)
        else:
            engines[name] = Burst(src, m=s["m"], backend=backend, gapless=name == "gapless", **kw)
    return engines, skipped


def time_config(engines, s, prompts, checked) -> dict:
    """Rotations over the engines; each run freshly prefilled, timed whole, checked against its check run."""
    from .real_checks import sync_all

    names = list(engines)
    ref_tokens = len(checked[next(n for n in SAME_KERNEL_ORDER if n in engines)].tokens[0])
    walls = {n: [] for n in names}
    rates = {n: [] for n in names}  # tokens/s of each timed run (its own token count)
    for rep in range(s["reps"]):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            eng = engines[name]
            eng.prefill(prompts)
            sync_all(engines)
            t0 = time.perf_counter()
            run = eng.run(s["rounds"], tokens=ref_tokens)
            wall = time.perf_counter() - t0  # every run ends in a host sync that reads its last tokens
            for b, (got, want) in enumerate(zip(run.tokens, checked[name].tokens)):
                n = min(len(got), len(want))
                if got[:n] != want[:n]:  # a few tokens more or less is bf16 acceptance, other tokens a bug
                    raise AssertionError(f"{name}: timed run {rep} produced other tokens than its checked run "
                                         f"(sequence {b})")
            walls[name].append(wall * 1e6)
            rates[name].append(sum(map(len, run.tokens)) / wall)
    out = {}
    for name in names:
        run, wall = checked[name], statistics.median(walls[name])
        tokens = sum(map(len, run.tokens))
        out[name] = dict(us_per_round=wall / run.rounds, tokens_per_s=statistics.median(rates[name]), tokens=tokens,
                         rounds=run.rounds, wall_us=wall, wall_us_all=walls[name],
                         acceptance=run.accepted / (run.rounds * s["k"] * len(run.tokens)),
                         syncs_per_token=None if run.syncs is None else run.syncs / tokens)
    return out


def x_floor(timed: dict, floor_us, engines=None, prompts=None, rounds=None) -> None:
    """Add ``x_floor`` and ``over_floor_us`` to every engine; graphburst's graph time per round too."""
    from .real_engines import Burst

    for name, r in timed.items():
        mine = floor_us is not None and name != "hf"
        r["x_floor"] = r["us_per_round"] / floor_us if mine else None
        r["over_floor_us"] = r["us_per_round"] - floor_us if mine else None
        eng = (engines or {}).get(name)
        if isinstance(eng, Burst):
            r["graph_us_per_round"] = eng.graph_us_per_round(prompts, rounds)


def reference_model(engines):
    """The bf16 Llama the near-tie rule asks: a same-kernel engine's own target (its KV row 0 is scratch)."""
    from .real_engines import Burst, TorchLoop

    for eng in engines.values():
        if isinstance(eng, TorchLoop) and eng.same_kernels:
            return eng.target
    return next(e for e in engines.values() if isinstance(e, Burst)).dec.target.module


def m_sweep(src, draft, s, backend, prompts, ref, floor_us, vllm) -> list:
    """graphburst at B=1 over M: checked against the config's reference tokens, then timed."""
    from .real_checks import check_common_prefix
    from .real_engines import Burst

    rows = []
    for m in s["m_sweep"]:
        for gapless in (False, True):
            eng = Burst(src, draft_layers=draft, batch=1, k=s["k"], m=m, backend=backend, gapless=gapless)
            name = "gapless" if gapless else "graphburst"
            eng.prefill(prompts)
            checked = {name: eng.run(s["rounds"])}
            check_common_prefix(f"M sweep: {name} with M={m}", checked[name].tokens, ref, "the config's reference")
            timed = time_config({name: eng}, s, prompts, checked)
            x_floor(timed, floor_us, {name: eng}, prompts, s["rounds"])
            r = dict(m=m, engine=name, **timed[name])
            r["x_vllm"] = None if vllm is None else r["tokens_per_s"] / vllm["tokens_per_s"]
            rows.append(r)
            del eng
    return rows


def run(args, console: Console, backend) -> int:
    """The summary of saved results, the profile views, or the engine comparison (the default)."""
    if args.summary is not None:
        from .real_summary import run as summarize

        return summarize(args.summary, console)
    with _torch_state_restored():
        if args.profile is not None:
            return run_profile(args, console, backend)
        return run_engines(args, console, backend)


@contextlib.contextmanager
def _torch_state_restored():
    """A CPU run tunes torch for itself (:func:`_cpu_torch`): a caller in the same process (the
    command's tests, a program that embeds it) gets its own state back after the run."""
    import torch

    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_flush_denormal(False)  # torch's default; it has no getter for the flag
        torch.set_num_threads(threads)


def _cpu_torch(torch) -> None:
    # Small ε makes subnormal activations, which x86 handles in microcode (100x slower).
    torch.set_flush_denormal(True)
    # The CPU run is a correctness run of tiny models: intra-op threads only contend
    # (10x slower on a shared 2-core CI machine).
    torch.set_num_threads(1)


def run_profile(args, console: Console, backend) -> int:
    """The profile views (``--profile``): each one checked then timed, one table each, one JSON."""
    import torch

    from . import real_forward, real_prefill

    s = profile_settings(args)
    cuda = backend.is_gpu
    if not cuda:
        _cpu_torch(torch)
    console.print(f"[bold]graphburst bench real --profile {','.join(s['views'])}[/bold]: {label(backend)}; torch "
                  f"{torch.__version__} on {_device(backend)}, {s['dtype']}; models {','.join(s['models'])}")
    views = {"forward": real_forward, "prefill": real_prefill}
    results, tables, failures = {}, [], []
    # Timers and graph captures use the current device: make it the backend's.
    with torch.cuda.device(backend.device_id) if cuda else contextlib.nullcontext():
        for view in s["views"]:
            results[view] = views[view].run(s, backend, console, failures)
            tables.append(views[view].table(results[view], label(backend)))
    device = torch.cuda.get_device_name(_device(backend)) if cuda else "cpu"
    write_results(console, json_path(args), backend=backend, tables=tables, results=results, failures=failures,
                  settings=s, device=device, torch=torch.__version__)
    return finish(console, failures)


def run_engines(args, console: Console, backend) -> int:
    """Parse the settings, then per model: build it and its engines, check and time every config; report."""
    import torch

    s = settings(args)
    cuda = backend.is_gpu
    if not cuda:
        _cpu_torch(torch)
    # The docs' PNG is the default only for a full GPU run (a smoke run must not overwrite it).
    plot_path = None if args.no_plot else (args.plot or (DEFAULT_PLOT if cuda and not args.smoke else None))
    problem = plot_problem() if plot_path else None
    if problem:
        console.print(f"[yellow]plot skipped[/yellow]: {problem}")
    results = dict(models={}, configs=[], m_sweep=[])
    failures = []  # correctness failures of engines with other kernels (HF, compile): exit status 1
    console.print(f"[bold]graphburst bench real[/bold]: {label(backend)}; torch {torch.__version__} on "
                  f"{_device(backend)}, {s['dtype']}; models {','.join(s['models'])}; B {s['batches']}; "
                  f"engines {','.join(s['engines'])}")
    levels_n = len(s["eps"]) if s["eps"] else len(s["accepts"])
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("configs", total=len(s["models"]) * (1 + len(s["batches"]) * levels_n))
        for mi, mname in enumerate(s["models"]):
            model = _build_model(mname, mi, s, backend, failures)
            results["models"][mname] = model["info"]
            progress.advance(task)
            for batch in s["batches"]:
                for config in _run_batch(model, batch, args, s, backend, results, failures):
                    results["configs"].append(config)
                    progress.advance(task)
                if cuda:
                    torch.cuda.empty_cache()
            del model
    device = torch.cuda.get_device_name(_device(backend)) if cuda else "cpu"
    return report(console, json_path(args), backend, results, failures, plot_path, problem, settings=s, device=device,
                  torch=torch.__version__)


def _device(backend) -> str:
    return f"cuda:{backend.device_id}" if backend.is_gpu else "cpu"


def _build_model(mname, mi, s, backend, failures) -> dict:
    """One model: its random target, prompts, ε levels (calibrated unless given), HF's fp32 check."""
    import torch

    from .real_checks import fp32_check
    from .real_engines import HFAssisted
    from .real_models import MODELS, Epsilon, argmax_margins, random_target, subspace_draft, weight_bytes

    spec = MODELS[mname]
    device = _device(backend)
    rng = np.random.default_rng(s["seed"] + mi)
    prompt_pool = rng.integers(0, spec.cfg.vocab_size, (max(s["batches"] + [4]), s["prompt_len"])).tolist()
    prompts_for = lambda b: prompt_pool[:b]  # noqa: E731 - the first b prompts, the same in every config
    capacity = _capacity(s)
    src = random_target(spec, batch=CALIBRATION["batch"], capacity=capacity, kv_slack=s["k"] + 2,
                        dtype=getattr(torch, s["dtype"]), device=device, seed=s["seed"],
                        decode_kernels=s["decode_kernels"])
    # The self-draft's depth, or a draft of its own shape built into the target's subspace.
    draft = spec.draft_layers if spec.draft_cfg is None else subspace_draft(src, spec, seed=s["seed"],
                                                                            decode_kernels=s["decode_kernels"])
    eps_ctl = Epsilon(src, spec.draft_layers)
    info = dict(spec=spec.note, layers=spec.cfg.num_hidden_layers, draft_layers=spec.draft_layers,
                draft=None if spec.draft_cfg is None else dict(layers=spec.draft_cfg.num_hidden_layers,
                                                               hidden=spec.draft_cfg.hidden_size,
                                                               weight_bytes=weight_bytes(draft)),
                weight_bytes=weight_bytes(src), margins=argmax_margins(
                    src, torch.tensor(prompts_for(CALIBRATION["batch"]), device=device)))
    if info["margins"]["median"] <= 0 or info["margins"]["ties"] > 0.25:
        raise AssertionError(f"{mname}: greedy argmax margins are degenerate: {info['margins']}")
    if s["eps"]:
        grid, levels = None, [dict(want=None, eps=e) for e in s["eps"]]
    else:
        grid, levels = calibrate(src, draft, s, prompts_for, eps_ctl)
    info.update(eps_grid=grid, levels=levels)
    mid = levels[len(levels) // 2]
    hf, hf_reason = None, None
    if "hf" in s["engines"]:
        try:
            import transformers
        except ImportError:
            hf_reason = "not run: transformers is not installed"
    if "hf" in s["engines"] and hf_reason is None:
        eps_ctl.set(mid["eps"])
        try:
            info["fp32_check"] = dict(eps=mid["eps"], **fp32_check(src, draft, s, backend, prompts_for(1)[0]))
        except AssertionError as exc:  # reported, and the exit status says so; the run goes on
            info["fp32_check"] = dict(eps=mid["eps"], failed=str(exc))
            failures.append(f"{mname}: {exc}")
        if 1 in s["batches"]:
            hf = HFAssisted(src, draft_layers=draft, k=s["k"])
    return dict(name=mname, spec=spec, src=src, draft=draft, eps_ctl=eps_ctl, prompts_for=prompts_for, info=info,
                levels=levels, mid=mid, hf=hf, hf_reason=hf_reason)


def _run_batch(model, batch, args, s, backend, results, failures):
    """Yield one config result per ε level at this batch size: engines built once, checked, then timed."""
    from .real_checks import check_config, reference_logits

    cuda, info, mname, mid = backend.is_gpu, model["info"], model["name"], model["mid"]
    engines, skipped = build_engines(model["src"], model["spec"], model["draft"], s, batch, backend, model["hf"])
    if model["hf_reason"] and "hf" in s["engines"]:
        skipped["hf"] = model["hf_reason"]
    vllm = engines.get("vllm")
    floor = vllm.floor_us(10 if cuda else 1) if vllm else None
    if vllm and batch == 1:
        us = vllm.verify_us(20 if cuda else 1)
        ideal = info["weight_bytes"] / 4.0e12 * 1e6
        info["verify"] = dict(us=us, ideal_us=ideal, ratio=us / ideal, tokens=s["k"] + 1)
    oracle = reference_model(engines)
    for level in model["levels"]:
        model["eps_ctl"].set(level["eps"])
        prompts = model["prompts_for"](batch)
        checked, report = check_config(engines, s, prompts, lambda p, pre: reference_logits(oracle, p, pre), cuda)
        failed = {n: f"FAILED correctness: {r['failed']}" for n, r in report.items() if "failed" in r}
        failures += [f"{mname} B={batch} ε={level['eps']:.4g}: {m}" for m in failed.values()]
        timed = time_config({n: e for n, e in engines.items() if n not in failed}, s, prompts, checked)
        x_floor(timed, floor, engines, prompts, s["rounds"])
        for name, r in timed.items():
            r["correctness"] = report[name]
            if name == "compile":
                r["compile_s"] = engines[name].compile_s
        ref = checked[next(n for n in SAME_KERNEL_ORDER if n in engines)].tokens
        if batch == 1 and level is mid and s["trace"]:
            info["profile"] = profile_all(engines, prompts, s, len(ref[0]), s["trace"], mname, cuda)
        if batch == 1 and level is mid and s["m_sweep"]:
            results["m_sweep"] += [dict(model=mname, eps=level["eps"], **r) for r in m_sweep(
                model["src"], model["draft"], s, backend, prompts, ref, floor, timed.get("vllm"))]
        yield dict(model=mname, batch=batch, eps=level["eps"], want=level["want"], floor_us=floor, engines=timed,
                   not_run={**skipped, **failed})

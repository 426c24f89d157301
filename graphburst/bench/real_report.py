"""What ``graphburst bench real`` prints and draws: rich tables, the targets, the plot.

Pure functions of the results dict that ``real.run`` builds (the same dict goes to the
JSON), so the tables and the plot can be rebuilt from a saved JSON file.
"""

from __future__ import annotations

from .common import fmt, label, new_table, write_results

SAME_KERNEL_ORDER = ("graphburst", "gapless", "vllm", "eager")  # the first present is the correctness reference
SAME_KERNEL_RULE = "identical common prefix"  # same-kernel engines: one run a prefix of the other

NOT_RUN = {"hf_batch": "not run: HF assisted generation supports batch 1 only",
           "compile_off": "not run: opt-in (--engines ...,compile): compiling takes minutes per model and batch"}
ENGINE_ORDER = ("graphburst", "gapless", "vllm", "eager", "compile", "hf")
LABELS = {"graphburst": "graphburst", "gapless": "graphburst gapless", "vllm": "vllm-style graphs",
          "eager": "eager loop", "compile": "torch.compile", "hf": "HF assisted"}
VLLM_GOAL = {"small": 1.4, "1b": 1.15}  # graphburst tokens/s over vllm-style, B=1
FLOOR_GOAL = 1.03
HF_GOAL = 10.0
VERIFY_GOAL = 1.5  # 1B verify GPU time over weight bytes / 4.0 TB/s
PLOT_HELP = "matplotlib is not installed (pip install matplotlib), so no plot; the JSON has every figure"


def _ordered(engines) -> list:
    return [e for e in ENGINE_ORDER if e in engines]


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _tps(cfg, name):
    r = cfg["engines"].get(name)
    return None if r is None else r["tokens_per_s"]


def targets(results) -> list:
    """The targets at B=1 (one row per model, ε and graphburst variant), plus the 1B verify."""
    rows = []
    for cfg in results["configs"]:
        if cfg["batch"] != 1:
            continue
        model = cfg["model"]
        for name in ("graphburst", "gapless"):
            r = cfg["engines"].get(name)
            if r is None:
                continue
            where = dict(model=model, eps=cfg["eps"], acceptance=r["acceptance"], engine=name)
            rows.append(dict(where, target="per round / model-only floor", goal=f"<= {FLOOR_GOAL}",
                             measured=r.get("x_floor"), met=None if r.get("x_floor") is None
                             else r["x_floor"] <= FLOOR_GOAL))
            x = _ratio(r["tokens_per_s"], _tps(cfg, "vllm"))
            goal = VLLM_GOAL.get(model)
            rows.append(dict(where, target="tokens/s / vllm-style tokens/s",
                             goal="-" if goal is None else f">= {goal}", measured=x,
                             met=None if x is None or goal is None else x >= goal))
            x = _ratio(r["tokens_per_s"], _tps(cfg, "hf"))
            rows.append(dict(where, target="tokens/s / HF assisted tokens/s", goal=f">= {HF_GOAL}", measured=x,
                             met=None if x is None else x >= HF_GOAL))
    for model, info in results["models"].items():
        v = info.get("verify")
        if v is not None:
            rows.append(dict(model=model, eps=None, acceptance=None, engine="vllm-style verify graph",
                             target="verify GPU time / (weight bytes / 4.0 TB/s)",
                             goal=f"<= {VERIFY_GOAL}" if model == "1b" else "-", measured=v["ratio"],
                             met=v["ratio"] <= VERIFY_GOAL if model == "1b" else None))
    return rows


def _verdict(met) -> str:
    return "-" if met is None else ("[green]met[/green]" if met else "[red]missed[/red]")


def tables(results, title_label) -> list:
    out = []
    t = new_table(f"models and checks; {title_label}",
                  ["model", "weights MB", "margin median", "margin p10", "ties", "ε -> acceptance (calibration)",
                   "fp32 HF check", "verify µs", "ideal µs", "verify / ideal"])
    for name, info in results["models"].items():
        grid = ", ".join(f"{g['eps']:g}:{g['acceptance']:.2f}" for g in info["eps_grid"] or [])
        fp = info.get("fp32_check")
        if fp is None:
            fp_txt = "-"
        elif "failed" in fp:
            fp_txt = "[red]FAILED[/red] (see the JSON)"
        else:
            fp_txt = f"agreed {fp['agreed']}/{fp['compared']}" + ("" if fp["divergence"] is None else " (near-tie)")
        v = info.get("verify") or {}
        t.add_row(name, fmt(info["weight_bytes"] / 1e6, 1), fmt(info["margins"]["median"], 4),
                  fmt(info["margins"]["p10"], 4), fmt(info["margins"]["ties"], 3), grid or "given by --eps", fp_txt,
                  fmt(v.get("us"), 1), fmt(v.get("ideal_us"), 1), fmt(v.get("ratio")))
    out.append(t)
    for model, info in results["models"].items():
        for engine, prof in (info.get("profile") or {}).items():
            if isinstance(prof, str):
                continue
            t = new_table(f"profile: {model}, B=1, {LABELS[engine]}: top kernels per round ({prof['trace']})",
                          ["kernel", "calls/round", "µs/round"])
            for row in prof["top"]:
                t.add_row(row["name"], fmt(row["calls_per_round"], 1), fmt(row["us_per_round"], 1))
            out.append(t)
    # Columns for engines that ran somewhere (a "not run" reason fills the other cells).
    names = [n for n in ENGINE_ORDER if any(n in c["engines"] for c in results["configs"])]
    t = new_table(f"one row per config: tokens/s per engine (k, M as set; medians); {title_label}",
                  ["model", "B", "ε", "acceptance", "floor µs/round", *(f"{LABELS[n]} tok/s" for n in names),
                   "graphburst µs/round", "graphburst x floor", "graphburst / vllm", "graphburst / HF"])
    for cfg in results["configs"]:
        gb = cfg["engines"].get("graphburst") or {}
        ref = next(cfg["engines"][n] for n in ENGINE_ORDER if n in cfg["engines"])
        cells = []
        for n in names:
            cells.append(fmt(_tps(cfg, n), 0) if n in cfg["engines"] else cfg["not_run"].get(n, "-"))
        t.add_row(cfg["model"], str(cfg["batch"]), f"{cfg['eps']:.4g}", fmt(ref["acceptance"]), fmt(cfg["floor_us"], 1),
                  *cells, fmt(gb.get("us_per_round"), 1), fmt(gb.get("x_floor"), 3),
                  fmt(_ratio(gb.get("tokens_per_s"), _tps(cfg, "vllm"))),
                  fmt(_ratio(gb.get("tokens_per_s"), _tps(cfg, "hf"))))
    out.append(t)
    t = new_table(f"every engine, every config; {title_label}",
                  ["model", "B", "ε", "engine", "µs/round", "tokens/s", "x floor", "µs over floor",
                   "graph µs/round", "syncs/token", "acceptance", "correctness"])
    for cfg in results["configs"]:
        for n in _ordered(cfg["engines"]):
            r = cfg["engines"][n]
            c = r["correctness"]
            if c["rule"] == SAME_KERNEL_RULE:
                check = f"identical to {c['reference']} ({c['common_prefix_tokens']} tokens in common)"
            else:
                agreed = sum(q["agreed"] for q in c["sequences"])
                check = f"{c['rule']}: agreed {agreed}/{sum(q['compared'] for q in c['sequences'])}"
            t.add_row(cfg["model"], str(cfg["batch"]), f"{cfg['eps']:.4g}", LABELS[n], fmt(r["us_per_round"], 1),
                      fmt(r["tokens_per_s"], 0), fmt(r.get("x_floor"), 3), fmt(r.get("over_floor_us"), 1),
                      fmt(r.get("graph_us_per_round"), 1), fmt(r["syncs_per_token"], 3), fmt(r["acceptance"]), check)
    out.append(t)
    if results["m_sweep"]:
        t = new_table(f"graphburst over M at B=1; {title_label}",
                      ["model", "ε", "engine", "M", "µs/round", "tokens/s", "x floor", "graph µs/round",
                       "syncs/token", "/ vllm"])
        for r in results["m_sweep"]:
            t.add_row(r["model"], f"{r['eps']:.4g}", LABELS[r["engine"]], str(r["m"]), fmt(r["us_per_round"], 1),
                      fmt(r["tokens_per_s"], 0), fmt(r.get("x_floor"), 3), fmt(r.get("graph_us_per_round"), 1),
                      fmt(r["syncs_per_token"], 3), fmt(r["x_vllm"]))
        out.append(t)
    t = new_table(f"targets (B=1); {title_label}", ["model", "ε", "acceptance", "engine", "target", "goal",
                                                     "measured", "verdict"])
    for r in results["targets"]:
        t.add_row(r["model"], "-" if r["eps"] is None else f"{r['eps']:.4g}", fmt(r["acceptance"]), r["engine"],
                  r["target"], r["goal"], fmt(r["measured"], 3), _verdict(r["met"]))
    out.append(t)
    return out


def plot_problem() -> str | None:
    """Why no plot can be drawn (None when matplotlib imports)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return PLOT_HELP
    return None


def plot_series(results) -> dict:
    """``{(model, batch): {engine: [(acceptance, tokens/s), ...]}}`` sorted by acceptance."""
    series = {}
    for cfg in results["configs"]:
        panel = series.setdefault((cfg["model"], cfg["batch"]), {})
        for name, r in cfg["engines"].items():
            panel.setdefault(name, []).append((r["acceptance"], r["tokens_per_s"]))
    return {key: {n: sorted(pts) for n, pts in panel.items()} for key, panel in series.items()}


def plot(results, path: str, title_label: str) -> None:
    """Tokens/s against measured acceptance, one panel per (model, batch), one line per engine."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    series = plot_series(results)
    models = list(dict.fromkeys(m for m, _ in series))
    batches = sorted({b for _, b in series})
    fig, axes = plt.subplots(len(models), len(batches), figsize=(4.2 * len(batches), 3.4 * len(models)),
                             squeeze=False)
    for i, model in enumerate(models):
        for j, batch in enumerate(batches):
            ax = axes[i][j]
            for name in _ordered(series.get((model, batch), {})):
                pts = series[(model, batch)][name]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=LABELS[name])
            ax.set_title(f"{model}, B={batch}")
            ax.set_xlabel("measured acceptance")
            ax.set_ylabel("tokens/s")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            if (model, batch) in series:
                ax.legend(fontsize=7)
    fig.suptitle(f"graphburst bench real: tokens/s against acceptance ({title_label})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(console, path, backend, results, failures, plot_path, problem, **meta) -> int:
    """The targets, the plot, the tables and the JSON (``meta`` joins its meta); 1 on any correctness failure."""
    results["targets"] = targets(results)
    plotted = None
    if plot_path and not problem:
        plot(results, plot_path, label(backend))
        plotted = plot_path
        console.print(f"plot written to {plot_path}")
    write_results(console, path, backend=backend, tables=tables(results, label(backend)), results=results,
                  plot=plotted if plotted else (f"not written: {problem}" if problem else None), failures=failures,
                  **meta)
    return finish(console, failures)


def finish(console, failures) -> int:
    """Name every correctness failure after the results are written; the exit status: 1 on any."""
    for line in failures:
        console.print(f"[red]correctness failure[/red]: {line}", highlight=False)
    return 1 if failures else 0

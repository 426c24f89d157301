"""The open-loop benchmark's table (one rich row per rate) and its latency-against-throughput plot."""

from __future__ import annotations

from rich.table import Table

from .common import fmt, new_table

COLUMNS = ["rate /s", "offered /s", "achieved /s", "out tok/s", "TTFT p50 / p99 ms",
           "TTFT p50: queue / prefill / emit / client ms", "ITL p50 / p99 / max ms",
           "TPOT p50 / p99 ms", "E2E p50 / p99 ms", "429", "errors", "accepted /round",
           "rounds /burst", "GPU idle (admission)"]


def _pair(p: dict, digits: int = 1) -> str:
    return f"{fmt(p['p50'], digits)} / {fmt(p['p99'], digits)}"


def _split(split: dict | None) -> str:
    """TTFT's parts at p50 (load_stats.ttft_split), "-" without the server's access log."""
    if not split:
        return "-"
    return " / ".join(fmt(split[name]["p50"]) for name in ("queue", "prefill", "emit", "client"))


def table(rows: list[dict], title: str) -> Table:
    t = new_table(title, COLUMNS)
    for r in rows:
        idle, admission = r["gpu_idle_fraction"], r.get("gpu_admission_fraction")
        t.add_row(f"{r['rate']:g}", fmt(r["offered_rps"]), fmt(r["achieved_rps"]), fmt(r["output_tokens_per_s"], 0),
                  _pair(r["ttft_ms"]), _split(r.get("ttft_split_ms")),
                  _pair(r["itl_ms"], 2) + f" / {fmt(r['itl_max_ms'], 2)}", _pair(r["tpot_ms"], 2), _pair(r["e2e_ms"]),
                  str(r["rejected_429"]), str(r["errors"]), fmt(r["accepted_per_round"]),
                  fmt(r.get("rounds_per_burst")),
                  "-" if idle is None else f"{idle:.1%}" + ("" if admission is None else f" ({admission:.1%})"))
    return t


def plot(rows: list[dict], path: str, title: str) -> None:
    """Latency (log ms) against achieved output tokens/s, one point per rate, labelled with the rate."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    x = [r["output_tokens_per_s"] or 0.0 for r in rows]
    panels = (("time to first token and end to end", (("ttft_ms", "TTFT"), ("e2e_ms", "E2E"))),
              ("per output token", (("tpot_ms", "TPOT"), ("itl_ms", "ITL"))))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (name, series) in zip(axes, panels):
        for key, label in series:
            for q, style in (("p50", "o-"), ("p99", "s--")):
                pts = [(xi, r[key][q]) for xi, r in zip(x, rows) if r[key][q]]  # ITL p50 is often 0: not on a log axis
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{label} {q}")
        at = series[0][0]  # each point labelled with its rate, on the panel's first p50 series
        for xi, r in zip(x, rows):
            if r[at]["p50"]:
                ax.annotate(f"{r['rate']:g}/s", (xi, r[at]["p50"]), fontsize=7, alpha=0.7)
        ax.set_yscale("log")
        ax.set_xlabel("achieved output tokens/s")
        ax.set_ylabel("latency (ms)")
        ax.set_title(name, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
